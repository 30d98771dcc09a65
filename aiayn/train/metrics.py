"""Reading a run's metrics log (RUN/metrics.jsonl, written by the trainer) as series against the update step.

:func:`curves_data` serves ``aiayn report`` and ``aiayn viz curves``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aiayn.errors import DataError

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
