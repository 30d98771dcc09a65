"""The decoder's key/value cache for step-by-step decoding, preallocated and written in place.

Shapes: B batch rows, L decoder layers, H heads, C room (steps the layout holds), T steps cached,
K head width (the larger of d_k and d_v: where they differ, Table 3 row B, the narrower uses the first
columns of its slot), S source length.

Self-attention keys and values of every layer live in one buffer (L, 2, B, H, C, K), a view of a flat
storage. A step writes its (B, H, 1, K) keys/values at position T, with no ``torch.cat`` and no
allocation, and attention reads the view (B, H, T, K), whose B and H axes merge into one batch axis.
Beam search reorders rows every step: ``reorder`` gathers the first T positions of every layer, keys
and values, in ONE ``index_select`` into a second storage (ping-pong), laid out with room for exactly one
more step, so the next step's keys are contiguous: on the CPU, batched matmul reads a strided view of a
longer buffer at about half the speed of a contiguous one.
Without a reorder (greedy decoding, a language model) the layout keeps all the room its storage has.
Storages start with room for 64 steps (fewer if fewer are reserved) and double when a batch runs
longer, up to the steps reserved, so a batch whose outputs end early never holds its whole step
limit. Cross-attention keys/values are projected once per source (per layer, (B, H, S, K)) and
selected only when rows leave the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Steps the storage first holds (fewer when fewer are reserved); it doubles when a batch runs longer, up
# to the reserved steps, so a batch whose outputs end early never holds room for its step limit.
INITIAL_STEPS = 64


class KVCache:
    """Keys and values of past decoder steps, for ``n_layers`` decoder layers.

    ``capacity``: the most decoding steps expected (the search passes its step limit): the storage starts
    with room for min(capacity, 64) steps and doubles, up to it, as the batch runs longer (past it too, if
    more come). ``length`` is the number of cached steps; ``append_self`` writes
    a layer's new steps and returns its keys/values so far (views, valid until the next ``reorder``);
    ``reorder(indices)`` keeps (and may repeat or drop) batch rows, as beam search needs; ``cross_k`` /
    ``cross_v`` hold each layer's encoder keys/values.
    """

    static = False  # positions counted on the host (StaticKVCache: on the device)

    def __init__(self, n_layers: int, capacity: int | None = None) -> None:
        self.n_layers = n_layers
        self.capacity = capacity
        self.cross_k: list[Tensor | None] = [None] * n_layers
        self.cross_v: list[Tensor | None] = [None] * n_layers
        self._buf: Tensor | None = None  # (L, 2, B, H, C, K): a view of the start of _store
        self._store: Tensor | None = None  # flat storage behind _buf
        self._spare: Tensor | None = None  # flat storage, the other half of the ping-pong
        self._lens = [0] * n_layers  # steps written per layer (all equal between decoder calls)
        self._widths: tuple[int, int] | None = None  # (d_k, d_v) where they differ, else None

    def reserve(self, steps: int) -> None:
        """Reserve room for ``steps`` decoding steps (before the first step; later the storage grows)."""
        self.capacity = max(self.capacity or 0, int(steps))

    @property
    def length(self) -> int:
        """Number of target positions already cached."""
        return self._lens[0]

    def self_kv(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """Views (B, H, T, K) of a layer's cached keys and values (None before the first step)."""
        if self._buf is None:
            return None
        n = self._lens[layer]
        if self._widths is not None:
            dk, dv = self._widths
            return self._buf[layer, 0, :, :, :n, :dk], self._buf[layer, 1, :, :, :n, :dv]
        return self._buf[layer, 0, :, :, :n], self._buf[layer, 1, :, :, :n]

    def append_self(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new steps' keys (B, H, t, d_k) and values (B, H, t, d_v) of ``layer`` after its cached
        ones; return views (B, H, T + t, d_k) and (B, H, T + t, d_v) of all its keys/values so far."""
        B, H, t, dk = k.shape
        dv = v.size(-1)
        K = max(dk, dv)
        pos = self._lens[layer]
        if self._buf is None:
            self._widths = (dk, dv) if dk != dv else None
            steps = max(min(self.capacity or INITIAL_STEPS, INITIAL_STEPS), t)
            self._store = k.new_empty(self.n_layers * 2 * B * H * steps * K)
            self._spare = torch.empty_like(self._store)
            self._buf = self._store.view(self.n_layers, 2, B, H, steps, K)
        elif B != self._buf.size(2):
            raise ValueError(f"the cache holds {self._buf.size(2)} rows, the new keys {B}; reorder it first")
        if pos + t > self._buf.size(4):
            self._move(None, pos + t)
        slot = self._buf[layer, :, :, :, pos: pos + t]  # (2, B, H, t, K)
        slot[0, ..., :dk].copy_(k)
        slot[1, ..., :dv].copy_(v)
        self._lens[layer] = pos + t
        return self.self_kv(layer)  # type: ignore[return-value]

    def reorder(self, indices: Tensor, cross: bool = True) -> None:
        """Keep batch rows ``indices`` (LongTensor (B',)) in that order, in every cached tensor.

        ``cross=False`` leaves the cross-attention keys/values alone: beam search reorders beams within a
        sentence every step, and all beams of a sentence share them, so they only need selecting (with
        ``reorder_cross``) when a sentence leaves the batch."""
        if self._buf is not None:
            self._move(indices, max(self._lens) + 1)
        if cross:
            self.reorder_cross(indices)

    def reorder_cross(self, indices: Tensor) -> None:
        """Keep rows ``indices`` of the cross-attention keys/values only."""
        for store in (self.cross_k, self.cross_v):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, indices)

    def _move(self, indices: Tensor | None, room: int) -> None:
        """Copy the cached steps (rows ``indices``, or all) into the spare storage, laid out with room
        for ``room`` steps (a reorder: exactly one more) or, to grow, for as many as the storage holds
        (at least ``room``); the two storages swap. A storage too small for ``room`` is replaced by one
        for twice the steps (up to the capacity), so growing costs O(log steps) allocations."""
        L, _, B, H, C, K = self._buf.shape
        n = max(self._lens)
        rows = B if indices is None else indices.numel()
        per_step = L * 2 * rows * H * K
        if self._spare.numel() < room * per_step:
            held = max(C, self._spare.numel() // per_step)
            doubled = min(2 * held, self.capacity) if self.capacity and self.capacity >= room else 2 * held
            self._spare = self._buf.new_empty(max(room, doubled) * per_step)
        if indices is None:  # growing: all the room the storage gives
            room = self._spare.numel() // per_step
        out = self._spare[: room * per_step].view(L, 2, rows, H, room, K)
        src = self._buf[..., :n, :]
        if indices is None:
            out[..., :n, :].copy_(src)
        elif self._buf.requires_grad and torch.is_grad_enabled():  # out= does not differentiate
            out[..., :n, :] = src.index_select(2, indices)
        else:  # every layer's keys and values in one gather; the rest is never read
            torch.index_select(src, 2, indices, out=out[..., :n, :])
        self._store, self._spare, self._buf = self._spare, self._store, out


class StaticKVCache:
    """A cache whose shapes never change, for a decoder step replayed as one CUDA graph: R rows and room for C
    steps, fixed for its life; the number of cached steps is a device tensor (``pos``, 0-dim long), so a step
    reads its position there instead of from a Python int.

    ``append_self`` writes a layer's new keys/values (R, H, 1, K) at position ``pos`` and returns views of all C
    positions (R, H, C, K); attention reads them with :meth:`visible` (keys 0 .. pos). ``reorder_rows``
    gathers rows in place (same storage); ``advance`` counts a step. Cross-attention keys/values are projected
    on the first step, as :class:`KVCache`'s, and then read from the same tensors by every later step.
    """

    static = True

    def __init__(self, n_layers: int, capacity: int, device: torch.device) -> None:
        self.n_layers = n_layers
        self.capacity = int(capacity)
        self.cross_k: list[Tensor | None] = [None] * n_layers
        self.cross_v: list[Tensor | None] = [None] * n_layers
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # steps cached so far
        self._keys = torch.arange(self.capacity, device=device)  # (C,) key positions
        self._buf: Tensor | None = None  # (L, 2, R, H, C, K), allocated by the first step
        self._widths = (0, 0)

    def visible(self) -> Tensor:
        """(1, 1, 1, C) bool: the keys a new step's query may see, those cached so far and its own."""
        return (self._keys <= self.pos)[None, None, None, :]

    def append_self(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one step's keys (R, H, 1, d_k) and values (R, H, 1, d_v) at ``pos``; views (R, H, C, d_k),
        (R, H, C, d_v) of every position (those after ``pos`` hold nothing yet: :meth:`visible` hides them)."""
        R, H, t, dk = k.shape
        if t != 1:
            raise ValueError(f"a fixed-shape cache takes one step at a time, not {t}")
        if self._buf is None:
            self._widths = (dk, v.size(-1))
            self._buf = k.new_zeros(self.n_layers, 2, R, H, self.capacity, max(self._widths))
        dk, dv = self._widths
        at = self.pos.view(1)
        self._buf[layer, 0, ..., :dk].index_copy_(2, at, k)
        self._buf[layer, 1, ..., :dv].index_copy_(2, at, v)
        return self._buf[layer, 0, ..., :dk], self._buf[layer, 1, ..., :dv]

    def reorder_rows(self, indices: Tensor) -> None:
        """Row r takes the keys/values of row ``indices[r]`` (R,), in place (beam search's reorder)."""
        if self._buf is not None:
            self._buf.copy_(self._buf.index_select(2, indices))

    def advance(self) -> None:
        """One more step cached."""
        self.pos.add_(1)
