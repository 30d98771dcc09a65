"""The one id-level "decode these sources": token-budget batches sorted by length, the search the options
name, results in input order. The translator, training's validation BLEU and the attention explorer all
decode through :func:`decode_ids`, so they agree (banned ids, lengths, n-gram blocking included).

The batches are the search's own, not training's: a source costs the row the encoder reads (its ids and the
EOS appended to it) once per row of the search (each beam, or each draw when sampling), and nothing else.

Shapes: B batch, S source length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from torch import Tensor, nn

from aiayn.config import DecodeOptions
from aiayn.device import model_device
from aiayn.search.beam import Beam
from aiayn.search.common import pad_rows
from aiayn.search.greedy import Greedy
from aiayn.search.sampling import Sampling
from aiayn.search.spec import SearchSpec
from aiayn.search.strategy import Hypothesis, Strategy

# The decoding strategies by name, in the order they are asked whether a call's options choose them: a new
# strategy is its class (beside its search) and one entry here, before any it specializes.
STRATEGIES: Mapping[str, Strategy] = MappingProxyType({s.name: s for s in (Sampling(), Greedy(), Beam())})


def strategy_for(options: DecodeOptions) -> Strategy:
    """The strategy ``options`` choose: the first of :data:`STRATEGIES` that says so."""
    return next(s for s in STRATEGIES.values() if s.chosen(options))


def rows_per_source(options: DecodeOptions) -> int:
    """The rows a source costs a search of ``options`` (the beam, or the draws when sampling): a batch's cost
    is its sources' ids and EOS times this."""
    return strategy_for(options).rows(options)


def search_batch(model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec, scores: bool = True
                 ) -> list[list[Hypothesis]]:
    """The hypotheses of one padded batch, best first: src (B, S) ids (EOS included), src_mask (B, S), by the
    strategy the options choose (``scores=False``: greedy search spares the teacher-forced pass, scores NaN)."""
    return strategy_for(spec.options).search(model, src, src_mask, spec, scores)


def decode_batches(widths: Sequence[int], opts: DecodeOptions, device_type: str) -> list[list[int]]:
    """The batches (lists of indices) :func:`decode_ids` searches, for source rows of ``widths`` ids each (a
    source and its EOS: what a sentence costs): sorted by width, equal widths in input order, each within
    ``len(batch) * widest * rows <= opts.batch_tokens(device_type)`` (rows: the beam, or the draws when
    sampling; a single wider source forms its own batch). The budget is per device (``DEFAULT_DECODE_TOKENS``:
    a GPU gets batches 8x the CPU's, so the search's matmuls fill it)."""
    rows_each, budget = rows_per_source(opts), opts.batch_tokens(device_type)
    batches: list[list[int]] = []
    for i in sorted(range(len(widths)), key=widths.__getitem__):  # stable: equal widths keep input order
        # sorted, so the newest source is the widest: the padded batch would be (len + 1) x widths[i]
        if batches and (len(batches[-1]) + 1) * widths[i] * rows_each <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def decode_ids(model: nn.Module, sources: Sequence[Sequence[int]], spec: SearchSpec, scores: bool = True,
               progress: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
    """Search every source (ids without EOS; the spec's EOS is appended) and return its hypotheses, best first,
    in input order, in the token-budget batches of :func:`decode_batches`. The model must be in eval mode.
    ``scores=False`` spares greedy search the teacher-forced pass that scores its outputs; ``progress`` is
    called with the number of sources each batch decoded."""
    device = model_device(model)
    out: list[list[Hypothesis]] = [[] for _ in sources]
    if not sources:
        return out
    rows = [[*s, spec.eos] for s in sources]  # what the encoder reads
    for idx in decode_batches([len(r) for r in rows], spec.options, device.type):
        src = pad_rows([rows[i] for i in idx], spec.pad).to(device)  # (B, S)
        for i, hyps in zip(idx, search_batch(model, src, src != spec.pad, spec, scores)):
            out[i] = hyps
        if progress is not None:
            progress(len(idx))
    return out
