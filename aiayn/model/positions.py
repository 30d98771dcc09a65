"""Where each token sits (section 3.5): the :class:`PositionScheme` hook and its schemes, one entry each in
:data:`SCHEMES`.

A scheme has two capabilities: ``add`` its encodings to the token embeddings (the paper's sinusoids, Table 3 row
E's learned vectors), and ``rotate`` the queries and keys of self-attention (a scheme that encodes positions in the
attention scores; none of the paper's does). A stack finds its tokens' :class:`Positions` ONCE per forward
(:meth:`PositionScheme.at`, left padding included) and hands them to both.

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


# model.positional -> the scheme a stack is built with (config/schema.py names the same keys).
SCHEMES: dict[str, Callable[[ModelConfig], PositionScheme]] = {
    "sinusoidal": lambda c: SinusoidalPositionalEncoding(c.max_positions, c.d_model, c.positional_layout),
    "learned": lambda c: LearnedPositionalEmbedding(c.max_positions, c.d_model),
}


def position_scheme(cfg: ModelConfig) -> PositionScheme:
    """The :class:`PositionScheme` of ``model.positional``."""
    return SCHEMES[cfg.positional](cfg)
