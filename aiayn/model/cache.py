"""The decoder's key/value cache for step-by-step decoding, preallocated and written in place.

Shapes: B batch rows, L decoder layers, H heads, C capacity (decoding steps reserved), T steps cached,
K head width, S source length.

Self-attention keys and values of every layer live in one buffer (B, L, 2, H, C, K): a step writes its
(B, H, 1, K) keys/values at position T (no ``torch.cat`` per step, no new allocation), and attention reads
the view [..., :T, :]. Beam search reorders rows every step: ``reorder`` gathers the first T positions of
all layers in ONE ``index_select`` into a second buffer of the same size, and the two swap (ping-pong), so
a step costs one gather of what is cached, whatever the number of layers. Cross-attention keys/values are
projected once per source (per layer, (B, H, S, K)) and selected only when rows leave the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Steps reserved when nobody says how many (a language model's prompt, a caller without ``reserve``);
# past the capacity the buffers double (amortized O(1) copies per step).
DEFAULT_CAPACITY = 64


class KVCache:
    """Keys and values of past decoder steps, for ``n_layers`` decoder layers.

    ``capacity``: decoding steps to reserve when the first keys arrive (the search passes its step limit;
    the buffers double when more come). ``length`` is the number of cached steps; ``append_self`` writes
    a layer's new steps and returns its keys/values so far; ``reorder(indices)`` keeps (and may repeat or
    drop) batch rows, as beam search needs; ``cross_k`` / ``cross_v`` hold each layer's encoder keys/values.
    """

    def __init__(self, n_layers: int, capacity: int | None = None) -> None:
        self.n_layers = n_layers
        self.capacity = capacity
        self.cross_k: list[Tensor | None] = [None] * n_layers
        self.cross_v: list[Tensor | None] = [None] * n_layers
        self._buf: Tensor | None = None  # (B, L, 2, H, C, K), a view of the start of _store
        self._store: Tensor | None = None  # flat storage behind _buf
        self._spare: Tensor | None = None  # flat storage of the other half of the ping-pong
        self._lens = [0] * n_layers  # steps written per layer (all equal between decoder calls)

    def reserve(self, steps: int) -> None:
        """Reserve room for ``steps`` decoding steps (before the first step; later it only grows)."""
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
        return self._buf[:, layer, 0, :, :n], self._buf[:, layer, 1, :, :n]

    def append_self(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new steps' (B, H, t, K) keys/values of ``layer`` after its cached ones; return views
        (B, H, T + t, K) of all its keys/values so far."""
        B, H, t, K = k.shape
        pos = self._lens[layer]
        if self._buf is None:
            self._allocate(B, H, max(self.capacity or DEFAULT_CAPACITY, t), K, k.dtype, k.device)
        elif B != self._buf.size(0):
            raise ValueError(f"the cache holds {self._buf.size(0)} rows, the new keys {B}; reorder it first")
        if pos + t > self._buf.size(4):
            self._grow(pos + t)
        slot = self._buf[:, layer, :, :, pos: pos + t]  # (B, 2, H, t, K)
        slot[:, 0].copy_(k)
        slot[:, 1].copy_(v)
        self._lens[layer] = pos + t
        return self.self_kv(layer)  # type: ignore[return-value]

    def reorder(self, indices: Tensor, cross: bool = True) -> None:
        """Keep batch rows ``indices`` (LongTensor (B',)) in that order, in every cached tensor.

        ``cross=False`` leaves the cross-attention keys/values alone: beam search reorders beams within a
        sentence every step, and all beams of a sentence share them, so they only need selecting (with
        ``reorder_cross``) when a sentence leaves the batch."""
        if self._buf is not None:
            n, rows, per_row = max(self._lens), indices.numel(), self._buf[0].numel()
            if self._spare.numel() < rows * per_row:  # more rows than ever (rows repeated)
                self._spare = self._buf.new_empty(rows * per_row)
            out = self._spare[: rows * per_row].view(rows, *self._buf.shape[1:])
            # The cached steps of every layer, keys and values, in one gather; the rest is never read.
            if self._buf.requires_grad and torch.is_grad_enabled():  # out= does not differentiate
                out[..., :n, :] = self._buf[..., :n, :].index_select(0, indices)
            else:
                torch.index_select(self._buf[..., :n, :], 0, indices, out=out[..., :n, :])
            self._store, self._spare, self._buf = self._spare, self._store, out
        if cross:
            self.reorder_cross(indices)

    def reorder_cross(self, indices: Tensor) -> None:
        """Keep rows ``indices`` of the cross-attention keys/values only."""
        for store in (self.cross_k, self.cross_v):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, indices)

    def _allocate(self, rows: int, heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> None:
        shape = (rows, self.n_layers, 2, heads, capacity, head_dim)
        self._store = torch.empty(rows * self.n_layers * 2 * heads * capacity * head_dim, dtype=dtype, device=device)
        self._spare = torch.empty_like(self._store)
        self._buf = self._store.view(shape)

    def _grow(self, steps: int) -> None:
        """Double the capacity (at least to ``steps``), keeping what is cached."""
        old = self._buf
        B, _, _, H, C, K = old.shape
        self._allocate(B, H, max(steps, 2 * C), K, old.dtype, old.device)
        n = max(self._lens)
        self._buf[..., :n, :].copy_(old[..., :n, :])
