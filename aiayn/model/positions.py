"""Where each token sits (section 3.5): the :class:`PositionScheme` hook and its schemes, one entry each in
:data:`SCHEMES`.

A scheme has two capabilities: ``add`` its encodings to the token embeddings (the paper's sinusoids, Table 3 row
E's learned vectors), and ``rotate`` the queries and keys of self-attention (a scheme that encodes positions in the
attention scores, as rotary positions do; none of the paper's does). A stack finds its tokens' :class:`Positions`
ONCE per forward (:meth:`PositionScheme.at`, left padding included) and hands them to both.

Shapes: B batch, T new tokens, D model width, H heads, K query/key width per head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.model.embeddings import sinusoidal_table

# A rotation of self-attention's queries (B, H, T, K) and new keys (B, H, T, K) at one forward's positions.
Rotation = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class Positions(NamedTuple):
    """The positions of one forward's new tokens.

    Every row's tokens sit at ``start .. end - 1`` when ``index`` is None; ``index`` (B, T) long gives each row its
    own positions when the rows are left-padded (a row's text starts at position 0; its padding columns sit at 0
    too and are masked). ``end`` is one past the largest position (checked against the table without another
    read from the device)."""

    start: int
    end: int
    index: Tensor | None = None


def token_positions(length: int, past: int = 0, left_pad: Tensor | None = None,
                    device: torch.device | None = None) -> Positions:
    """The positions of ``length`` new tokens after ``past`` cached ones; ``left_pad`` (B,) long: row b's first
    left_pad[b] columns (counted from the first step) are padding, so its text starts at position 0."""
    if left_pad is None:
        return Positions(past, past + length)
    cols = torch.arange(past, past + length, device=device)
    index = (cols[None, :] - left_pad[:, None]).clamp(min=0)  # (B, T)
    return Positions(past, int(index.max()) + 1, index)


class PositionScheme(nn.Module):
    """The hook: how a stack tells its layers where tokens are. The base adds nothing and rotates nothing; a
    scheme overrides :meth:`encodings` (added to the embeddings) and/or :meth:`rotation` (applied to queries and
    keys in every self-attention)."""

    def __init__(self, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions

    def at(self, length: int, past: int = 0, left_pad: Tensor | None = None,
           device: torch.device | None = None) -> Positions:
        """This forward's :class:`Positions` (:func:`token_positions`), refused past ``max_positions``."""
        pos = token_positions(length, past, left_pad, device)
        if pos.end > self.max_positions:
            raise ValueError(
                f"sequence needs position {pos.end - 1} but the model has max_positions={self.max_positions}"
            )
        return pos

    def encodings(self, positions: Positions) -> Tensor | None:
        """What is added to the embeddings: (T, D), or (B, T, D) with an index; None: nothing."""
        return None

    def add(self, x: Tensor, positions: Positions) -> Tensor:
        """Token embeddings x (B, T, D) with the encodings of ``positions`` added (x itself when there are none)."""
        enc = self.encodings(positions)
        return x if enc is None else x + enc

    def rotation(self, positions: Positions) -> Rotation | None:
        """The rotation every self-attention of this forward applies to its queries and new keys, made once per
        forward; None: this scheme does not rotate."""
        return None

    def rotate(self, q: Tensor, k: Tensor, positions: Positions) -> tuple[Tensor, Tensor]:
        """q (B, H, T, K), k (B, H, T, K) rotated to ``positions`` (unchanged when the scheme does not rotate)."""
        rot = self.rotation(positions)
        return (q, k) if rot is None else rot(q, k)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """The encodings of positions offset .. offset+length-1, (length, D) (for inspection)."""
        return self.encodings(self.at(length, offset))


def _rows(table: Tensor, positions: Positions) -> Tensor:
    """Rows of ``table`` (P, W) at ``positions``: (T, W), or (B, T, W) with an index."""
    if positions.index is None:
        return table[positions.start : positions.end]
    return table[positions.index]


class SinusoidalPositionalEncoding(PositionScheme):
    """Fixed sinusoids added to the embeddings (section 3.5); not a parameter and not saved in checkpoints."""

    def __init__(self, max_positions: int, d_model: int, layout: str = "interleaved") -> None:
        super().__init__(max_positions)
        self.register_buffer("table", sinusoidal_table(max_positions, d_model, layout), persistent=False)

    def encodings(self, positions: Positions) -> Tensor:
        return _rows(self.table, positions)


class LearnedPositionalEmbedding(PositionScheme):
    """A learned vector per position added to the embeddings (Table 3 row E: "nearly identical results")."""

    def __init__(self, max_positions: int, d_model: int) -> None:
        super().__init__(max_positions)
        self.weight = nn.Parameter(torch.empty(max_positions, d_model))
        nn.init.normal_(self.weight, mean=0.0, std=d_model**-0.5)

    def encodings(self, positions: Positions) -> Tensor:
        return _rows(self.weight, positions)


def rotary_tables(n_positions: int, width: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles pos * base^(-2i/K), i < K/2 (section 3.5's frequencies over a head's width K),
    each (n_positions, K/2); computed in float64 and rounded once, like :func:`sinusoidal_table`."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inv_freq = torch.pow(base, -torch.arange(0, width, 2, dtype=torch.float64) / width)  # (K/2,)
    angles = pos * inv_freq  # (P, K/2)
    return torch.cos(angles).float(), torch.sin(angles).float()


class RotaryRotation(NamedTuple):
    """One forward's rotation: cos and sin at its positions, (T, K/2) or (B, 1, T, K/2) with left padding."""

    cos: Tensor
    sin: Tensor

    def __call__(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, H, T, K), k (B, H, T, K) -> both rotated: each head's pair (x_i, x_{i+K/2}) turned by its angle."""
        return self.turn(q), self.turn(k)

    def turn(self, x: Tensor) -> Tensor:
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)  # a half-precision q stays in its precision
        x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, K/2) each: GPT-NeoX's "rotate half" pairing
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryPositions(PositionScheme):
    """Rotary positions (RoFormer, Su et al. 2021; not in the paper): nothing is added to the embeddings; every
    self-attention turns each head's query and key, pair of dimensions by pair, by angles proportional to its
    position, so that q.k depends on the two positions only through their distance. The pairs are GPT-NeoX's and
    Llama's "rotate half" (dimension i with i + K/2), over the whole head width K, at section 3.5's frequencies
    (base 10000). Keys are turned before the KV cache stores them, so a cached key keeps its position.
    Cross-attention is not rotated: a target position and a source position count in different sequences, so
    their distance means nothing there."""

    def __init__(self, max_positions: int, head_width: int) -> None:
        super().__init__(max_positions)
        cos, sin = rotary_tables(max_positions, head_width)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rotation(self, positions: Positions) -> RotaryRotation:
        cos, sin = _rows(self.cos, positions), _rows(self.sin, positions)
        if positions.index is not None:  # (B, T, K/2) -> (B, 1, T, K/2): one row's angles for all its heads
            cos, sin = cos[:, None], sin[:, None]
        return RotaryRotation(cos, sin)


# model.positional -> the scheme a stack is built with (config/schema.py names the same keys).
SCHEMES: dict[str, Callable[[ModelConfig], PositionScheme]] = {
    "sinusoidal": lambda c: SinusoidalPositionalEncoding(c.max_positions, c.d_model, c.positional_layout),
    "learned": lambda c: LearnedPositionalEmbedding(c.max_positions, c.d_model),
    "rotary": lambda c: RotaryPositions(c.max_positions, c.key_width),
}


def position_scheme(cfg: ModelConfig) -> PositionScheme:
    """The :class:`PositionScheme` of ``model.positional``."""
    return SCHEMES[cfg.positional](cfg)
