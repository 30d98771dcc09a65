"""Beam search's decoder steps at fixed shapes, so that on CUDA every step after the first replays one CUDA graph.

On a GPU a small model's step is a few hundred kernels, each launched from Python; the launches, not the
arithmetic, set its speed. :class:`FixedShapeSteps` keeps all of a batch's B * N rows (a sentence that is done
keeps its rows, fed the pad id, and they are never read again), a :class:`~aiayn.model.cache.StaticKVCache` with
room for the batch's step limit, and the position as a device tensor. Then one step is the same kernels on the same
memory every time: the first runs as it is (it projects the memory's keys/values and allocates the cache), the
second is recorded as a CUDA graph (:class:`torch.cuda.CUDAGraph`), and it and every later one replay it. Off CUDA
the same fixed-shape steps run without a graph (what the CPU tests compare with the usual path).

The search keeps its own compact rows (live sentences only, :func:`aiayn.search.beam.beam_search`); this class
maps them to its fixed rows: ``rows`` (the search's rows -> fixed rows), and the beams' reorder, which the next
step applies in place before it decodes. Attention then reads all C cached positions, the later ones masked, so
sums run over more (zero) terms than the usual path's: equal up to rounding, not bit for bit.

Shapes: B sentences, N beams, R = B * N fixed rows, r the search's rows (live sentences' beams, or one per sentence
on the first step), S source length, C step limit, V vocabulary.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from aiayn.model.cache import StaticKVCache


class FixedShapeSteps:
    """The decoder steps of one beam search batch at fixed shapes; a stand-in for the model's ``decode`` and its
    cache in :func:`~aiayn.search.beam.beam_search` (``decode``, ``reorder``, ``reorder_cross``).

    memory (B, S, D) and its mask (B, S) bool (None: no padding): the whole batch's, kept for every step;
    ``steps``: the batch's step limit C; ``pad``: the token fed to the rows of sentences that are done; ``graph``:
    record and replay a CUDA graph (on CUDA only)."""

    def __init__(self, model: nn.Module, memory: Tensor, mem_mask: Tensor | None, beam: int, steps: int, pad: int,
                 graph: bool = True) -> None:
        B, device = memory.size(0), memory.device
        self.model, self.memory, self.mem_mask, self.N, self.pad = model, memory, mem_mask, beam, pad
        self.cache = StaticKVCache(len(model.decoder.layers), steps, device)
        self.tokens = torch.full((B * beam, 1), pad, dtype=torch.long, device=device)  # (R, 1) the step's input
        self.identity = torch.arange(B * beam, device=device)  # (R,) every fixed row continuing itself
        self.beams = torch.arange(beam, device=device)  # (N,)
        self.prior = self.identity.clone()  # (R,) the reorder the next step applies first
        self.slots = self.identity[:B]  # (n,) the live sentences' places in the batch
        self.rows = self.slots * beam  # (r,) the search's rows -> fixed rows; first step: each sentence's beam 0
        self.graph: torch.cuda.CUDAGraph | None = None
        # the first step (the warm-up) and the recording run on one side stream, as CUDA graphs need
        self.stream = torch.cuda.Stream(device) if graph and device.type == "cuda" else None
        self.logits: Tensor | None = None  # (R, V) the last step's (a graph's output: rewritten by each replay)

    def _step(self) -> Tensor:
        """Reorder the beams, decode one step, count it: (R, V) logits. The same kernels every call."""
        self.cache.reorder_rows(self.prior)
        logits = self.model.decode(self.tokens, self.memory, self.mem_mask, self.cache)[:, -1]
        self.cache.advance()
        return logits

    def decode(self, tgt: Tensor, *_: object) -> Tensor:
        """tgt (r, 1) the search's rows' last tokens -> their logits (r, 1, V) (the model's ``decode`` signature;
        memory, mask and cache are this object's own)."""
        self.tokens.fill_(self.pad).index_copy_(0, self.rows, tgt)
        if self.graph is not None:
            self.graph.replay()
        elif self.stream is None:
            self.logits = self._step()
        else:
            self._on_side_stream(first=self.logits is None)
        return self.logits.index_select(0, self.rows).unsqueeze(1)

    def _on_side_stream(self, first: bool) -> None:
        """The first step runs there as it is (it projects the memory's keys/values, allocates the cache); the
        second is recorded there as a CUDA graph, then replayed. A recording CUDA refuses leaves this batch's steps
        running as they are, with a warning."""
        device = self.memory.device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        if first:
            with torch.cuda.stream(self.stream):
                self.logits = self._step()
        else:
            graph = torch.cuda.CUDAGraph()
            try:  # not torch.cuda.graph(), which also synchronizes and empties the allocator's cache every time
                with torch.cuda.stream(self.stream):
                    # allocations now come from the graph's own memory pool; other threads (a server's) may go on
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        self.logits = self._step()
                    finally:
                        graph.capture_end()
            except RuntimeError as e:  # nothing recorded ran: the step runs as it is below
                warnings.warn(f"beam search: a CUDA graph could not be recorded ({e}); steps run without one",
                              RuntimeWarning, stacklevel=3)
                torch.cuda.current_stream(device).wait_stream(self.stream)
                self.stream = None
                self.logits = self._step()
                return
            self.graph = graph
        torch.cuda.current_stream(device).wait_stream(self.stream)
        if self.graph is not None:
            self.graph.replay()

    def reorder(self, indices: Tensor, cross: bool = False) -> None:
        """The search's new rows continue its previous rows ``indices`` (r',): the next step first gives each fixed
        row of a live beam the keys/values of the row it continues (the others keep theirs)."""
        before = self.rows.index_select(0, indices)  # (r',) fixed rows continued
        self.rows = (self.slots[:, None] * self.N + self.beams).reshape(-1)
        self.prior.copy_(self.identity).index_copy_(0, self.rows, before)

    def reorder_cross(self, keep: Tensor) -> None:
        """Sentences leave the search: only the live ones ``keep`` (n',) (positions among the live) remain mapped;
        the fixed rows stay."""
        self.slots = self.slots.index_select(0, keep)
