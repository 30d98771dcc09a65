"""A run's metrics: written by the trainer (:class:`MetricsLog`), read back as series (:func:`curves_data`).

``RUN/metrics.jsonl`` holds one JSON object per logged step and per evaluation; ``aiayn report``,
``aiayn viz curves`` and ``--resume`` read it, so it is always written. ``train.log_to`` adds trackers:

* ``tensorboard``: event files in ``RUN/tensorboard`` (``pip install 'aiayn[tensorboard]'``);
  ``tensorboard --logdir RUN/tensorboard``.
* ``wandb``: a Weights & Biases run in ``RUN/wandb`` (``pip install 'aiayn[wandb]'``). It runs offline
  unless ``WANDB_MODE`` says otherwise (``WANDB_MODE=online`` after ``wandb login``); an offline run is
  uploaded later with ``wandb sync RUN/wandb/offline-run-*``. A resumed training continues the same run.

A tracker named in ``log_to`` whose package is missing is an error before training starts, never a
silent no-op (:func:`check_log_backends`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import LOG_BACKENDS
from aiayn.errors import ConfigError, DataError
from aiayn.files import atomic_write_text


def check_log_backends(names: tuple[str, ...] | list[str]) -> None:
    """Raise ConfigError naming the extra to install when a tracker's package is missing."""
    import importlib.util

    for name in names:  # a tracker's package has its name
        if name in LOG_BACKENDS and name != "jsonl" and importlib.util.find_spec(name) is None:
            raise ConfigError(f"train.log_to includes {name} but the {name} package is not installed: "
                              f"pip install 'aiayn[{name}]'")


class MetricsLog:
    """metrics.jsonl, plus the trackers of ``backends`` (see the module docstring); only ``enabled``
    (the main process) writes. ``resume_step``: drop what a killed run logged after that checkpoint.
    The trackers' packages are checked before training starts (:func:`check_log_backends`)."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None,
                 backends: tuple[str, ...] | list[str] = ("jsonl",), cfg: Any = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        if resume_step is not None and self.path.exists():
            keep = [ln for ln in self.path.read_text(encoding="utf-8", errors="replace").splitlines()
                    if ln.strip() and _step(ln) <= resume_step]
            atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))
        elif self.path.exists():
            self.path.unlink()
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if "wandb" in backends:
            import wandb

            run_dir = Path(run_dir).resolve()
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "aiayn"), name=run_dir.name, dir=str(run_dir),
                id=hashlib.sha1(str(run_dir).encode()).hexdigest()[:16], resume="allow",
                mode=os.environ.get("WANDB_MODE", "offline"), config=cfg.to_dict() if cfg is not None else None)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 1 << 62  # a torn or foreign line after the checkpoint: dropped with the rest

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
