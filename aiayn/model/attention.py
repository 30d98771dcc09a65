"""Scaled dot-product attention (eq. 1) and multi-head attention (eq. 2); the KV cache: aiayn.model.cache.

Shapes: B batch, H heads, Tq query length, Tk key length, D model width, K head width (D / H).
Masks are boolean and mean "may attend" (True = keep), broadcastable to (B, H, Tq, Tk).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.model.cache import KVCache


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  (eq. 1).

    q: (B, H, Tq, K), k: (B, H, Tk, K), v: (B, H, Tk, K); mask: bool, True = may attend,
    broadcastable to (B, H, Tq, Tk). Returns (output (B, H, Tq, K), probabilities (B, H, Tq, Tk) or None).
    ``is_causal`` (with ``mask=None`` and Tq == Tk): query i sees keys 0..i, without materializing a mask,
    so the fused kernels' causal path runs (on CUDA, flash attention, which takes no explicit mask).

    Two paths with the same result: PyTorch's fused ``torch.nn.functional.scaled_dot_product_attention``,
    and the explicit one (matmul, additive -inf mask, softmax, matmul), which also returns the
    probabilities (``need_weights``, for visualization). A query row whose keys are all masked gives a
    zero output on both (softmax over nothing is undefined, and NaN would poison the whole batch
    through the residual stream).
    """
    fused = not need_weights and _fused(q, k)
    if is_causal:
        if mask is not None or q.size(-2) != k.size(-2):
            raise ValueError("is_causal needs mask=None and as many queries as keys")
        if not fused:  # the explicit path needs the mask itself
            mask, is_causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril(), False
    empty_rows = None
    if mask is not None:
        # Let a query with no key to attend to attend everywhere (a finite softmax), then zero its output.
        # Always, without asking first whether such a row exists: that question (a Python bool of a device
        # tensor) made the host wait for the device in every attention call and broke torch.compile's graph.
        # The masks are small ((B, 1, 1, S) padding, (T, T) causal), and the zeroing is one elementwise op.
        empty_rows = ~mask.any(dim=-1, keepdim=True)  # (B|1, H|1, Tq|1, 1)
        mask = mask | empty_rows
    if fused:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        probs = None
    else:
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
        if mask is not None:
            # Additive 0 / -inf (a small (B|1, 1, Tq|1, Tk) tensor): exactly masked_fill's result, and
            # faster to differentiate than masked_fill with a broadcast boolean mask.
            scores = scores + torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device).masked_fill_(
                ~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(F.dropout(probs, dropout_p) if dropout_p > 0 else probs, v)
        if not need_weights:
            probs = None
        elif empty_rows is not None:
            probs = probs.masked_fill(empty_rows, 0.0)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out, probs


# On CPU, up to this many keys attention takes the explicit path (`python -m benchmarks.cpu_kernels`,
# forward + backward on the project's 2-core CPU, torch 2.13): after torch.set_num_threads (pytest's
# conftest and many programs call it) the fused kernel slows down and the explicit path is 1.2-3x faster
# up to 64 keys and even at 128; without that call the two are within 0.8-1.5x of each other there. At
# 512 keys the fused kernel wins 2x either way.
CPU_EXPLICIT_MAX_KEYS = 128


def _fused(q: Tensor, k: Tensor) -> bool:
    """Whether to call PyTorch's fused attention (always off the CPU; on it, for long key sequences)."""
    return q.device.type != "cpu" or k.size(-2) > CPU_EXPLICIT_MAX_KEYS


@contextmanager
def cpu_attention_path(path: str) -> Iterator[None]:
    """Inside the block, attention on CPU takes one path whatever the key length: ``"explicit"``
    (matmul + softmax, which ``FlopCounterMode`` counts) or ``"fused"`` (PyTorch's kernel); the length
    rule (``CPU_EXPLICIT_MAX_KEYS``) comes back afterwards, also on an exception. For benchmarks and tests."""
    global CPU_EXPLICIT_MAX_KEYS
    limits = {"explicit": 1 << 30, "fused": -1}
    if path not in limits:
        raise ValueError(f"unknown attention path {path!r}; expected 'explicit' or 'fused'")
    saved, CPU_EXPLICIT_MAX_KEYS = CPU_EXPLICIT_MAX_KEYS, limits[path]
    try:
        yield
    finally:
        CPU_EXPLICIT_MAX_KEYS = saved


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) (eq. 2).

    The h per-head projections are stored as one (3D, D) matrix ``in_proj`` (rows: Q | K | V), the
    layout of ``torch.nn.MultiheadAttention``. Self-attention does one matmul for Q, K and V;
    cross-attention uses the Q rows on the decoder states and the K|V rows on the encoder memory.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.dropout = dropout
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Xavier-uniform on each D x D block (as if Q, K, V were separate layers, like the references).
        for w in self.in_proj.weight.chunk(3, dim=0):
            nn.init.xavier_uniform_(w)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)

    def _split(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, K)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder memory (B, S, D) -> two (B, H, S, K)."""
        D = self.d_model
        kv = F.linear(memory, self.in_proj.weight[D:], self.in_proj.bias[D:])  # (B, S, 2D)
        k, v = kv.chunk(2, dim=-1)
        return self._split(k), self._split(v)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        need_weights: bool = False,
        causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, Tq, D) queries. ``memory`` None: self-attention over x (plus cached past steps);
        ``memory`` (B, S, D): cross-attention (keys/values cached once when a cache is given).
        mask: bool, True = may attend, broadcastable to (B, H, Tq, Tk); ``causal`` in place of a mask:
        self-attention over x alone (no cached steps), query i sees positions 0..i.
        Returns ((B, Tq, D), probabilities (B, H, Tq, Tk) if ``need_weights`` else None)."""
        D = self.d_model
        if memory is None:
            q, k, v = F.linear(x, self.in_proj.weight, self.in_proj.bias).chunk(3, dim=-1)
            q, k, v = self._split(q), self._split(k), self._split(v)
            if cache is not None:
                k, v = cache.append_self(layer, k, v)
        else:
            q = self._split(F.linear(x, self.in_proj.weight[:D], self.in_proj.bias[:D]))
            if cache is not None and cache.cross_k[layer] is not None:
                k, v = cache.cross_k[layer], cache.cross_v[layer]
            else:
                k, v = self.project_kv(memory)
                if cache is not None:
                    cache.cross_k[layer], cache.cross_v[layer] = k, v
        p = self.dropout if self.training else 0.0
        out, probs = scaled_dot_product_attention(q, k, v, mask, p, need_weights, is_causal=causal)
        B, _, Tq, _ = out.shape
        out = out.transpose(1, 2).reshape(B, Tq, D)  # concat heads: (B, Tq, D)
        return self.out_proj(out), probs
