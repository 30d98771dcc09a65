"""Scaled dot-product attention (eq. 1) and multi-head attention (section 3.2.2); the KV cache: aiayn.model.cache.

Shapes: B batch, H heads, Tq query length, Tk key length, D model width, K query/key width per head (the
paper's d_k), V value width per head (d_v); both are D / H unless the model says otherwise (Table 3 row B).
Masks are boolean and mean "may attend" (True = keep), broadcastable to (B, H, Tq, Tk).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.engine import AttentionKernel
from aiayn.linear import LinearKernel
from aiayn.model.cache import KVCache


class AttentionMask(NamedTuple):
    """A "may attend" mask with its rows that have no key at all, found once per batch (not per attention call).

    ``allowed`` (bool, broadcastable to (B, H, Tq, Tk)) already lets such a row attend to every key, so its
    softmax is finite; ``empty`` (broadcastable to (B, H, Tq, 1), or None when no row can be empty, e.g. a causal
    mask) marks the rows whose output is then set to zero. An all-padding row of a fixed-shape training batch is
    such a row: NaN from it would poison the whole batch through the residual stream."""

    allowed: Tensor
    empty: Tensor | None


def padding_mask(keep: Tensor) -> AttentionMask:
    """Key padding: keep (B, S) bool, True for real tokens -> the mask every query of a row shares,
    (B, 1, 1, S), with the rows that have no real token (B, 1, 1, 1)."""
    empty = ~keep.any(dim=-1)[:, None, None, None]  # (B, 1, 1, 1)
    return AttentionMask(keep[:, None, None, :] | empty, empty)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | AttentionMask | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    is_causal: bool = False,
    fused: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  (eq. 1).

    q: (B, H, Tq, K), k: (B, H, Tk, K), v: (B, H, Tk, V); mask: bool, True = may attend, broadcastable to
    (B, H, Tq, Tk), or an :class:`AttentionMask` whose empty rows were found already. Returns (output
    (B, H, Tq, V), probabilities (B, H, Tq, Tk) or None). ``is_causal`` (with ``mask=None`` and Tq == Tk):
    query i sees keys 0..i, without materializing a mask, so the fused kernels' causal path runs.

    Two computations with the same result: PyTorch's fused ``F.scaled_dot_product_attention`` (``fused``), and
    the explicit one (matmul, additive -inf mask, softmax, matmul), which also returns the probabilities
    (``need_weights`` takes it). A query row whose keys are all masked gives a zero output on both (softmax
    over nothing is undefined).
    """
    fused = fused and not need_weights
    if is_causal:
        if mask is not None or q.size(-2) != k.size(-2):
            raise ValueError("is_causal needs mask=None and as many queries as keys")
        if not fused:  # the explicit path needs the mask itself
            mask, is_causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril(), False
    if isinstance(mask, Tensor):  # called on its own: find the empty rows here
        empty = ~mask.any(dim=-1, keepdim=True)  # (B|1, H|1, Tq|1, 1)
        mask = AttentionMask(mask | empty, empty)
    allowed, empty = mask if mask is not None else (None, None)
    if fused:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal)
        probs = None
    else:
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
        if allowed is not None:
            # Additive 0 / -inf (a small (B|1, 1, Tq|1, Tk) tensor): exactly masked_fill's result, and
            # faster to differentiate than masked_fill with a broadcast boolean mask.
            scores = scores + torch.zeros(allowed.shape, dtype=scores.dtype, device=scores.device).masked_fill_(
                ~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(F.dropout(probs, dropout_p) if dropout_p > 0 else probs, v)
        if not need_weights:
            probs = None
        elif empty is not None:
            probs = probs.masked_fill(empty, 0.0)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out, probs


class MultiHeadAttention(AttentionKernel, LinearKernel, nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)
    (section 3.2.2), with W_i^Q, W_i^K in R^{D x d_k}, W_i^V in R^{D x d_v}, W^O in R^{h d_v x D}.

    ``d_k`` and ``d_v`` default to D / h, the paper's choice everywhere but Table 3 row (B). The h per-head
    projections are stored as one (h d_k + h d_k + h d_v, D) matrix ``in_proj`` (rows: Q | K | V), the
    layout of ``torch.nn.MultiheadAttention`` (3D, D) when d_k = d_v = D / h. Self-attention does one matmul
    for Q, K and V; cross-attention uses the Q rows on the decoder states and the K|V rows on the encoder
    memory. ``explicit_max_keys`` (:class:`aiayn.engine.AttentionKernel`) says which computation of eq. (1) runs:
    per device type, key lengths up to it take the explicit path, longer ones PyTorch's fused kernel (empty:
    always fused); :mod:`aiayn.engine` sets it, and how the projections are multiplied (``linear``,
    :class:`aiayn.linear.LinearKernel`).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, d_k: int | None = None,
                 d_v: int | None = None) -> None:
        super().__init__()
        if (d_k is None or d_v is None) and d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model, self.n_heads = d_model, n_heads
        self.d_k = d_k if d_k is not None else d_model // n_heads
        self.d_v = d_v if d_v is not None else d_model // n_heads
        self.dropout = dropout
        self.explicit_max_keys: dict[str, int] = {}
        qk, vw = n_heads * self.d_k, n_heads * self.d_v
        self._rows = (qk, qk, vw)  # rows of Q | K | V in in_proj
        self.in_proj = nn.Linear(d_model, 2 * qk + vw)
        self.out_proj = nn.Linear(vw, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Xavier-uniform on each of the Q, K, V blocks (as if they were separate layers, like the references).
        for w in self.in_proj.weight.split(self._rows, dim=0):
            nn.init.xavier_uniform_(w)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    def _split(self, x: Tensor) -> Tensor:
        """(B, T, H * W) -> (B, H, T, W): one slice of width W per head."""
        B, T, HW = x.shape
        return x.view(B, T, self.n_heads, HW // self.n_heads).transpose(1, 2)

    def _heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's projections (B, T, h d_k + h d_k + h d_v) -> Q, K (B, H, T, d_k) and V (B, H, T, d_v):
        views. Equal widths (the paper's): one view and one permute for all three, not a split and three."""
        if self.d_k != self.d_v:
            q, k, v = qkv.split(self._rows, dim=-1)
            return self._split(q), self._split(k), self._split(v)
        B, T, _ = qkv.shape
        return qkv.view(B, T, 3, self.n_heads, self.d_k).permute(2, 0, 3, 1, 4).unbind(0)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder memory (B, S, D) -> (B, H, S, d_k) and (B, H, S, d_v)."""
        qk = self._rows[0]
        kv = self.linear(memory, self.in_proj.weight[qk:], self.in_proj.bias[qk:])  # (B, S, h d_k + h d_v)
        k, v = kv.split(self._rows[1:], dim=-1)
        return self._split(k), self._split(v)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | AttentionMask | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        need_weights: bool = False,
        causal: bool = False,
        rotate: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, Tq, D) queries. ``memory`` None: self-attention over x (plus cached past steps);
        ``memory`` (B, S, D): cross-attention (keys/values cached once when a cache is given); or (B / G, S, D), one
        row for each G consecutive rows of x (beam search: a sentence's beams share its memory, which is then
        neither copied per beam nor read once per beam), its mask (B / G, 1, 1, S) likewise.
        mask: bool, True = may attend, broadcastable to (B, H, Tq, Tk), or an :class:`AttentionMask`;
        ``causal`` in place of a mask: self-attention over x alone (no cached steps), query i sees 0..i.
        ``rotate`` (self-attention): the position scheme's rotation of the queries and new keys (B, H, Tq, K),
        applied before the keys are cached, so cached keys keep the positions they were made at.
        Returns ((B, Tq, D), probabilities (B, H, Tq, Tk) if ``need_weights`` else None)."""
        qk = self._rows[0]
        if memory is None:
            q, k, v = self._heads(self.linear(x, self.in_proj.weight, self.in_proj.bias))
            if rotate is not None:
                q, k = rotate(q, k)
            if cache is not None:
                k, v = cache.append_self(layer, k, v)
        else:
            q = self.linear(x, self.in_proj.weight[:qk], self.in_proj.bias[:qk])  # (B, Tq, h d_k)
            if cache is not None and cache.cross_k[layer] is not None:
                k, v = cache.cross_k[layer], cache.cross_v[layer]
            else:
                k, v = self.project_kv(memory)
                if cache is not None:  # contiguous (B, H, S, K): every later step's matmul reads them without a copy
                    k, v = k.contiguous(), v.contiguous()
                    cache.cross_k[layer], cache.cross_v[layer] = k, v
            q = self._grouped(q, k.size(0))
        p = self.dropout if self.training else 0.0
        fused = k.size(-2) > self.explicit_max_keys.get(q.device.type, 0)
        out, probs = scaled_dot_product_attention(q, k, v, mask, p, need_weights, causal, fused)
        (B, Tq, _), H, G = x.shape, self.n_heads, x.size(0) // q.size(0)
        if G > 1:  # (B / G, H, G Tq, V) -> concat heads (B, Tq, h d_v); the probabilities to (B, H, Tq, S)
            out = out.view(B // G, H, G, Tq, -1).permute(0, 2, 3, 1, 4).reshape(B, Tq, -1)
            if probs is not None:
                probs = probs.view(B // G, H, G, Tq, -1).transpose(1, 2).reshape(B, H, Tq, -1)
        else:
            out = out.transpose(1, 2).reshape(B, Tq, -1)  # concat heads: (B, Tq, h d_v)
        return self.linear(out, self.out_proj.weight, self.out_proj.bias), probs

    def _grouped(self, q: Tensor, rows: int) -> Tensor:
        """Cross-attention's queries (B, Tq, h d_k) against ``rows`` memory rows: (B, H, Tq, K), or (B / G, H, G Tq,
        K) when each memory row serves G consecutive query rows (one product per memory row, its keys read once)."""
        (B, Tq, _), H = q.shape, self.n_heads
        if not 0 < rows < B:
            return self._split(q)
        G = B // rows
        return q.view(rows, G, Tq, H, -1).permute(0, 3, 1, 2, 4).reshape(rows, H, G * Tq, -1)
