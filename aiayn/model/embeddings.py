"""Token embeddings scaled by sqrt(d_model) (section 3.4) and the sinusoid table of section 3.5 (the schemes that
use it: :mod:`aiayn.model.positions`).

Shapes: B batch, T length, D model width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class TokenEmbedding(nn.Module):
    """Embedding lookup multiplied by sqrt(d_model) ("we multiply those weights by sqrt(d_model)").

    The weight may be shared with the other side's embedding and with the pre-softmax projection.
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int, scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.pad_id = pad_id
        self.scale = math.sqrt(d_model) if scale else 1.0
        # N(0, D^-1/2) so that, after the sqrt(D) scale, embeddings have unit variance like the
        # positional encodings (fairseq's and tensor2tensor's choice; the paper does not say).
        nn.init.normal_(self.weight, mean=0.0, std=d_model**-0.5)
        with torch.no_grad():
            self.weight[pad_id].zero_()

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) long -> (B, T, D)."""
        return nn.functional.embedding(tokens, self.weight, self.pad_id) * self.scale


def sinusoidal_table(n_positions: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D))  (section 3.5).

    ``interleaved``: sin on even and cos on odd dimensions, exactly as section 3.5 writes them.
    ``concat``: the same D/2 frequencies with all sines first, then all cosines, as tensor2tensor,
    fairseq and Marian lay them out (needed to load their weights). Returns (n_positions, D).
    """
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = pos * inv_freq  # (P, D/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = torch.sin(angles), torch.cos(angles)
    elif layout == "concat":
        half = d_model // 2
        table[:, :half], table[:, half:] = torch.sin(angles), torch.cos(angles)
    else:
        raise ValueError(f"unknown positional layout {layout!r}")
    return table.float()
