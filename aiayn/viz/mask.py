"""The causal (look-ahead) mask of the decoder's self-attention, as course material draws it:
0 where query i may attend to key j (j <= i), -inf above the diagonal, added to the scores
before the softmax (section 3.2.3: "setting to -inf all values ... which correspond to illegal connections").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from aiayn.config import ConfigError
from aiayn.model.transformer import causal_mask
from aiayn.viz.common import new_figure, save_figure, suptitle

ANNOTATE_UP_TO = 16  # write "0" / "-inf" in the cells of masks at most this long


MAX_LEN = 4096  # a figure's n x n cells: more than its pixels past this


def causal_mask_matrix(n: int) -> np.ndarray:
    """(n, n) additive mask: 0 on and below the diagonal, -inf above. Built from the model's own
    boolean ``causal_mask`` so the picture is what the decoder uses."""
    if not 1 <= n <= MAX_LEN:
        raise ConfigError(f"viz mask: --len must be 1 to {MAX_LEN:,} (a figure of n x n cells), got {n}")
    allowed = causal_mask(n)
    allowed = torch.ones(1, 1, dtype=torch.bool) if allowed is None else allowed  # n == 1
    return np.where(allowed.numpy(), 0.0, -np.inf)


def masked_softmax(mask: np.ndarray, scores: np.ndarray | None = None) -> np.ndarray:
    """softmax(scores + mask) over each row (uniform scores by default): row i spreads over keys 0..i."""
    scores = np.zeros_like(mask) if scores is None else scores
    z = scores + mask
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def plot_mask(mask: np.ndarray, out: str | Path, width: int | None = None, height: int | None = None,
              show: bool = False) -> Path:
    """Left: the mask (0 / -inf in two colours); right: softmax(0 + mask), the weights it leaves."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    n = mask.shape[0]
    fig = new_figure(width, height, (1200, 600))
    ax_mask, ax_w = fig.subplots(1, 2)
    blocked = np.isneginf(mask)
    ax_mask.imshow(blocked, cmap=ListedColormap(["#f2f2f2", "#b2182b"]), vmin=0, vmax=1,
                   interpolation="nearest")
    weights = masked_softmax(mask)
    im = ax_w.imshow(weights, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(im, ax=ax_w, fraction=0.05, pad=0.02)
    if n <= ANNOTATE_UP_TO:
        for i in range(n):
            for j in range(n):
                ax_mask.text(j, i, "-inf" if blocked[i, j] else "0", ha="center", va="center",
                             fontsize=9, color="white" if blocked[i, j] else "black")
                if not blocked[i, j]:
                    ax_w.text(j, i, f"{weights[i, j]:.2f}".lstrip("0"), ha="center", va="center", fontsize=8,
                              color="white" if weights[i, j] > 0.6 else "black")
    ax_mask.legend(handles=[Patch(color="#f2f2f2", label="0: may attend"),
                            Patch(color="#b2182b", label="-inf: masked")],
                   loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=9)
    ax_mask.set_title(f"Causal mask M ({n} x {n}), added to QK^T / sqrt(d_k)", fontsize=10)
    ax_w.set_title("softmax(0 + M): the attention weights left for equal scores", fontsize=10)
    for ax in (ax_mask, ax_w):
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
        if n <= 32:
            ax.set_xticks(range(n))
            ax.set_yticks(range(n))
    suptitle(fig, "Decoder self-attention mask: position i sees positions 0..i only")
    return save_figure(fig, out, show)
