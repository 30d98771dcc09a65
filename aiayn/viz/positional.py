"""Positional encodings (section 3.5): the sinusoidal matrix, its similarity PE_i . PE_j, and the
alternatives that course material rejects, shown the same two ways.

Shapes: P positions, D model width (binary code: its own width, one column per bit).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from aiayn.config import ConfigError
from aiayn.model.embeddings import sinusoidal_table
from aiayn.viz.common import heatmap, new_figure, save_figure, suptitle

# Name -> (figure label, why it is (not) used), in the order the comparison shows them.
ENCODINGS: dict[str, tuple[str, str]] = {
    "sinusoidal": ("sinusoidal (section 3.5)", "bounded; PE_i \u00b7 PE_j depends on |i - j| only"),
    "index": ("raw index: PE[pos] = pos", "unbounded; PE_i \u00b7 PE_j grows with i \u00d7 j"),
    "normalized": ("index / length: pos / (P - 1)", "in [0, 1], but a position's code changes with the length"),
    "binary": ("binary code: bits of pos as \u00b11", "PE_i \u00b7 PE_j jumps at multiples of powers of two"),
}


MAX_DRAWN = 8192  # positions or dimensions a figure draws at most (a side of the figure has at most 16384 pixels)


def positional_matrix(kind: str, d_model: int, max_pos: int) -> np.ndarray:
    """The encoding of positions 0 .. max_pos-1: (P, D), or (P, ceil(log2 P)) for ``binary``.

    ``index`` and ``normalized`` put the same scalar in every dimension, which is what adding
    them to a D-wide embedding amounts to.
    """
    if max_pos < 2:
        raise ConfigError(f"viz positional: --max-pos must be at least 2, got {max_pos}")
    if d_model < 2 or d_model % 2:
        raise ConfigError(f"viz positional: --d-model must be even and positive, got {d_model}")
    if max_pos > MAX_DRAWN or d_model > MAX_DRAWN:  # the (P, P) similarity alone would not fit in memory
        raise ConfigError(f"viz positional: --max-pos {max_pos} and --d-model {d_model}: at most {MAX_DRAWN:,} "
                          "each (a figure has fewer pixels than that)")
    pos = np.arange(max_pos, dtype=np.float64)[:, None]  # (P, 1)
    if kind == "sinusoidal":
        return sinusoidal_table(max_pos, d_model).double().numpy()
    if kind == "index":
        return np.repeat(pos, d_model, axis=1)
    if kind == "normalized":
        return np.repeat(pos / (max_pos - 1), d_model, axis=1)
    if kind == "binary":
        bits = max(1, math.ceil(math.log2(max_pos)))
        codes = (np.arange(max_pos)[:, None] >> np.arange(bits)[None, :]) & 1  # (P, bits), bit 0 first
        return codes.astype(np.float64) * 2.0 - 1.0
    raise ConfigError(f"unknown positional encoding {kind!r} (expected one of {', '.join(ENCODINGS)})")


def positional_views(kind: str, d_model: int, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """(matrix (P, D), similarity (P, P) = matrix @ matrix.T): the data behind one row of the figure."""
    m = positional_matrix(kind, d_model, max_pos)
    return m, m @ m.T


def plot_positional(views: dict[str, tuple[np.ndarray, np.ndarray]], out: str | Path, d_model: int,
                    width: int | None = None, height: int | None = None, show: bool = False) -> Path:
    """One row per encoding: the matrix (positions on y, dimensions on x) and its similarity matrix."""
    n = len(views)
    P = next(iter(views.values()))[0].shape[0]
    fig = new_figure(width, height, (1200, 600 if n == 1 else 450 * n))
    axes = np.atleast_2d(fig.subplots(n, 2, squeeze=False))
    for row, (kind, (m, sim)) in zip(axes, views.items()):
        label, why = ENCODINGS[kind]
        signed = m.min() < 0
        heatmap(row[0], m, f"{label}: PE[pos, dim]", "bit" if kind == "binary" else "dimension",
                "position", cmap="RdBu_r" if signed else "viridis", symmetric=signed)
        heatmap(row[1], sim, f"{label}: PE_i \u00b7 PE_j\n{why}", "position j", "position i")
        if kind == "binary":
            row[0].set_xticks(range(m.shape[1]))
    if n == 1:
        title = f"Sinusoidal positional encoding, d_model={d_model}, positions 0-{P - 1}"
    else:
        title = (f"Positional encodings compared (d_model={d_model}, positions 0-{P - 1}): "
                 "encoding matrix (left) and dot-product similarity (right)")
    suptitle(fig, title)
    return save_figure(fig, out, show)
