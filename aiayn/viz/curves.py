"""Training curves from RUN/metrics.jsonl: loss (label-smoothed and NLL, training and validation),
learning rate, and validation BLEU when the run measured it (train.eval_bleu)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aiayn.data.corpus import DataError

METRICS_FILE = "metrics.jsonl"


@dataclass
class Series:
    """One metric against the update step (steps ascending, one value per step)."""

    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    values: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __len__(self) -> int:
        return len(self.steps)


# Keys of metrics.jsonl that the figure draws.
CURVE_KEYS = ("train_loss", "train_nll", "valid_loss", "valid_nll", "lr", "valid_bleu")


def metrics_path(run_or_file: str | Path) -> Path:
    """RUN/metrics.jsonl for a run directory, or the file itself."""
    p = Path(run_or_file)
    if not p.exists():
        raise FileNotFoundError(2, "no such run directory or metrics file", str(p))
    p = p / METRICS_FILE if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(2, "No such file (no metrics.jsonl: has the run logged anything yet?)", str(p))
    return p


def curves_data(run_or_file: str | Path, keys: tuple[str, ...] = CURVE_KEYS) -> dict[str, Series]:
    """{key: Series} for each of ``keys`` that occurs. A step logged twice (a resumed run repeats
    the steps after its last checkpoint) keeps its last value; a torn last line (training still
    writing) is skipped; any other unreadable line is an error."""
    path = metrics_path(run_or_file)
    lines = path.read_text(encoding="utf-8").splitlines()
    points: dict[str, dict[int, float]] = {k: {} for k in keys}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if n == len(lines):
                continue
            raise DataError(f"{path}:{n}: not a JSON object") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise DataError(f"{path}:{n}: expected a JSON object with a 'step'")
        for k in keys:
            if isinstance(rec.get(k), (int, float)):
                points[k][int(rec["step"])] = float(rec[k])
    out = {}
    for k, pts in points.items():
        if pts:
            steps = np.array(sorted(pts), dtype=int)
            out[k] = Series(steps, np.array([pts[s] for s in steps], dtype=np.float64))
    if not out:
        raise DataError(f"{path}: no training or validation metrics in it yet")
    return out


def plot_curves(curves: dict[str, Series], out: str | Path, title: str = "", width: int | None = None,
                height: int | None = None, show: bool = False) -> Path:
    """Panels: loss (train/valid x label-smoothed/NLL), learning rate, and BLEU if measured."""
    from aiayn.viz.common import new_figure, save_figure, suptitle

    has_bleu = "valid_bleu" in curves
    n = 3 if has_bleu else 2
    fig = new_figure(width, height, (1500 if has_bleu else 1200, 500))
    axes = fig.subplots(1, n)
    ax = axes[0]
    styles = {  # colour = split, line style = which loss
        "train_loss": ("C0", "-", "", "train, label-smoothed"),
        "train_nll": ("C0", "--", "", "train, NLL"),
        "valid_loss": ("C1", "-", "o", "valid, label-smoothed"),
        "valid_nll": ("C1", "--", "o", "valid, NLL"),
    }
    for k, (color, ls, marker, label) in styles.items():
        if k in curves:
            s = curves[k]
            ax.plot(s.steps, s.values, color=color, linestyle=ls, marker=marker, markersize=4, label=label)
    ax.set_title("Loss per target token (nats)", fontsize=10)
    ax.set_xlabel("update step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    ax = axes[1]
    if "lr" in curves:
        ax.plot(curves["lr"].steps, curves["lr"].values, color="C2")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.set_title("Learning rate", fontsize=10)
    ax.set_xlabel("update step")
    ax.set_ylabel("learning rate")
    ax.grid(alpha=0.3)
    if has_bleu:
        ax = axes[2]
        s = curves["valid_bleu"]
        ax.plot(s.steps, s.values, color="C3", marker="o", markersize=4)
        ax.set_title("Validation BLEU", fontsize=10)
        ax.set_xlabel("update step")
        ax.set_ylabel("BLEU")
        ax.grid(alpha=0.3)
    note = "" if has_bleu else " (no BLEU logged: train.eval_bleu is off)"
    suptitle(fig, f"Training curves{': ' + title if title else ''}{note}")
    return save_figure(fig, out, show)
