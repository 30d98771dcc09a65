"""Position-wise feed-forward network (eq. 2) and the encoder / decoder layers (section 3.1).

Each sub-layer is wrapped as LayerNorm(x + Dropout(Sublayer(x))) (post-LN, the paper), or, with
``norm_first``, x + Dropout(Sublayer(LayerNorm(x))) (pre-LN, the common later variant).
Shapes: B batch, S source length, T target length, D model width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.linear import LinearKernel
from aiayn.model.attention import AttentionMask, KVCache, MultiHeadAttention
from aiayn.model.positions import Rotation

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}


class PositionwiseFeedForward(LinearKernel, nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2  (eq. 2); gelu or swish in place of ReLU as options."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)  # activation dropout: not in the paper, default 0
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, D)."""
        h = self.activation(self.linear(x, self.fc1.weight, self.fc1.bias))
        return self.linear(self.dropout(h) if self.training else h, self.fc2.weight, self.fc2.bias)


class SublayerConnection(nn.Module):
    """Residual connection and LayerNorm around one sub-layer: LayerNorm(x + Dropout(Sublayer(x))) post-LN (the
    paper), x + Dropout(Sublayer(LayerNorm(x))) pre-LN. ``self.sub(x, self.ffn)`` wraps a sub-layer that returns a
    tensor; attention, which also returns its probabilities, is wrapped in two halves: it reads
    :meth:`sublayer_input` and its output goes through :meth:`residual`."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def sublayer_input(self, x: Tensor) -> Tensor:
        """What the sub-layer reads: LayerNorm(x) pre-LN, x itself post-LN."""
        return self.norm(x) if self.norm_first else x

    def residual(self, x: Tensor, out: Tensor) -> Tensor:
        """x + Dropout(out), then LayerNorm post-LN. (Dropout is the identity at inference: not even called, a
        decoding step has a dozen of them.)"""
        y = x + (self.dropout(out) if self.training else out)
        return y if self.norm_first else self.norm(y)

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """(B, T, D) -> (B, T, D) around ``sublayer`` (B, T, D) -> (B, T, D)."""
        return self.residual(x, sublayer(self.sublayer_input(x)))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual + LayerNorm wrapper."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cfg.d_k, cfg.d_v)
        self.ffn = PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.activation, cfg.activation_dropout)
        self.sub_attn = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm_first, cfg.layer_norm_eps)
        self.sub_ffn = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm_first, cfg.layer_norm_eps)

    def forward(self, x: Tensor, mask: AttentionMask | None = None, need_weights: bool = False,
                rotate: Rotation | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, S, D); mask: the key padding, (B, 1, 1, S); ``rotate``: the position scheme's rotation of queries
        and keys, if it has one. Returns (B, S, D) and the attention probabilities (B, H, S, S) when
        ``need_weights``."""
        h, probs = self.self_attn(self.sub_attn.sublayer_input(x), mask=mask, need_weights=need_weights,
                                  rotate=rotate)
        x = self.sub_attn.residual(x, h)
        return self.sub_ffn(x, self.ffn), probs


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention (omitted in a decoder-only LM), feed-forward. ``index``: the
    layer's place in the stack, which is its slot in a :class:`KVCache`."""

    def __init__(self, cfg: ModelConfig, cross_attention: bool = True, index: int = 0) -> None:
        super().__init__()
        self.index = index
        d, p, nf, eps = cfg.d_model, cfg.dropout, cfg.norm_first, cfg.layer_norm_eps
        self.self_attn = MultiHeadAttention(d, cfg.n_heads, cfg.attention_dropout, cfg.d_k, cfg.d_v)
        self.sub_self = SublayerConnection(d, p, nf, eps)
        self.cross_attn = (MultiHeadAttention(d, cfg.n_heads, cfg.attention_dropout, cfg.d_k, cfg.d_v)
                           if cross_attention else None)
        self.sub_cross = SublayerConnection(d, p, nf, eps) if cross_attention else None
        self.ffn = PositionwiseFeedForward(d, cfg.d_ff, cfg.activation, cfg.activation_dropout)
        self.sub_ffn = SublayerConnection(d, p, nf, eps)

    def forward(
        self,
        x: Tensor,
        self_mask: AttentionMask | None = None,
        memory: Tensor | None = None,
        memory_mask: AttentionMask | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
        causal: bool = False,
        rotate: Rotation | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (B, T, D); self_mask (T, T_total) causal, or None with ``causal`` (nothing cached yet: the
        attention kernel applies the causal mask itself); memory (B, S, D); memory_mask (B, 1, 1, S); ``rotate``:
        the position scheme's rotation of the self-attention's queries and keys, if it has one (cross-attention
        is not rotated). Returns (B, T, D), self-attention probs, cross-attention probs."""
        layer = self.index
        h, self_probs = self.self_attn(self.sub_self.sublayer_input(x), mask=self_mask, cache=cache, layer=layer,
                                       need_weights=need_weights, causal=causal, rotate=rotate)
        x = self.sub_self.residual(x, h)
        cross_probs = None
        if self.cross_attn is not None:
            h, cross_probs = self.cross_attn(self.sub_cross.sublayer_input(x), memory, mask=memory_mask, cache=cache,
                                             layer=layer, need_weights=need_weights)
            x = self.sub_cross.residual(x, h)
        return self.sub_ffn(x, self.ffn), self_probs, cross_probs
