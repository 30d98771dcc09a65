"""The learning-rate schedule (section 5.3) of the paper and of a config or run, with the warm-up peak.

lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5): a linear rise for ``warmup`` updates,
then decay with the inverse square root of the step; the peak is d_model^-0.5 * warmup^-0.5.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from aiayn.config import ConfigError, TrainConfig
from aiayn.train.schedule import learning_rate
from aiayn.viz.common import config_of

PAPER_D_MODEL, PAPER_WARMUP = 512, 4000
MIN_HORIZON = 20_000  # updates shown at least (unless a config trains for fewer)
N_POINTS = 2000


@dataclass
class ScheduleCurve:
    """One schedule sampled at ``steps`` (1-based updates); ``peak_*`` is its largest learning rate."""

    label: str
    steps: np.ndarray
    lr: np.ndarray
    peak_step: int
    peak_lr: float
    schedule: str = "noam"


def schedule_curve(label: str, train_cfg: TrainConfig, d_model: int, max_step: int) -> ScheduleCurve:
    """Sample ``learning_rate(train_cfg, d_model, step)`` (what the trainer uses) on 1 .. max_step,
    always including the warm-up step so the peak is exact."""
    if max_step < 1:
        raise ConfigError(f"viz schedule: need at least one update, got {max_step}")
    grid = np.linspace(1, max_step, min(N_POINTS, max_step)).round().astype(int)
    extra = [s for s in (train_cfg.warmup, train_cfg.warmup + 1) if 1 <= s <= max_step]
    steps = np.unique(np.concatenate([grid, np.array(extra, dtype=int)]))
    lr = np.array([learning_rate(train_cfg, d_model, int(s)) for s in steps])
    i = int(lr.argmax())
    return ScheduleCurve(label, steps, lr, int(steps[i]), float(lr[i]), train_cfg.schedule)


def _describe(cfg: TrainConfig, d_model: int) -> str:
    if cfg.schedule == "noam":
        scale = "" if cfg.lr_scale == 1.0 else f", scale={cfg.lr_scale:g}"
        return f"d_model={d_model}, warmup={cfg.warmup}{scale}"
    if cfg.schedule == "inverse_sqrt":
        return f"inverse_sqrt, peak {cfg.lr:g}, warmup={cfg.warmup}"
    return f"constant {cfg.lr:g}"


def schedule_data(source: str | Path | None = None, d_model: int | None = None, warmup: int | None = None,
                  max_step: int | None = None) -> list[ScheduleCurve]:
    """The curves of one figure.

    Without ``source``: the paper's (d_model 512, warmup 4000) and, if ``d_model``/``warmup`` differ,
    that noam schedule too. With ``source`` (run directory, YAML file or preset name): its schedule
    (``d_model``/``warmup`` override the config's) and the paper's for reference.
    The horizon is ``max_step``, else max(20000, 5 x warmup), cut to the config's ``max_updates``.
    """
    if d_model is not None and d_model < 1:  # 0 or less: no d_model^-0.5
        raise ConfigError(f"viz schedule: --d-model must be at least 1, got {d_model}")
    paper = TrainConfig(schedule="noam", lr_scale=1.0, warmup=PAPER_WARMUP)
    specs: list[tuple[str, TrainConfig, int]] = []
    limit = None
    if source is not None:
        cfg, name = config_of(source)
        tc = cfg.train
        if warmup is not None:
            tc = replace(tc, warmup=warmup)
        dm = cfg.model.d_model if d_model is None else d_model
        specs.append((f"{name} ({_describe(tc, dm)})", tc, dm))
        limit = tc.max_updates
    elif d_model is not None or warmup is not None:
        # `is None`, not `or`: --warmup 0 is refused by the config (noam divides by it), never the paper's 4000
        tc = TrainConfig(schedule="noam", lr_scale=1.0, warmup=PAPER_WARMUP if warmup is None else warmup)
        dm = PAPER_D_MODEL if d_model is None else d_model
        specs.append((_describe(tc, dm), tc, dm))
    paper_label = f"paper, base model ({_describe(paper, PAPER_D_MODEL)})"
    if not any(_describe(tc, dm) == _describe(paper, PAPER_D_MODEL) for _, tc, dm in specs):
        specs.append((paper_label, paper, PAPER_D_MODEL))
    if any(tc.warmup < 0 for _, tc, _ in specs):
        raise ConfigError("viz schedule: warmup must be >= 0")
    if max_step is None:
        max_step = max(MIN_HORIZON, 5 * max(s[1].warmup for s in specs))
        if limit is not None:
            max_step = min(max_step, limit)
    return [schedule_curve(label, tc, dm, max_step) for label, tc, dm in specs]


def plot_schedule(curves: list[ScheduleCurve], out: str | Path, width: int | None = None,
                  height: int | None = None, show: bool = False) -> Path:
    """Learning rate against update step, one line per curve, each warm-up peak marked."""
    from aiayn.viz.common import new_figure, save_figure, suptitle

    fig = new_figure(width, height, (1200, 600))
    ax = fig.add_subplot()
    for c in curves:
        (line,) = ax.plot(c.steps, c.lr, label=c.label, linewidth=2)
        ax.plot([c.peak_step], [c.peak_lr], "o", color=line.get_color())
        ax.annotate(f"peak {c.peak_lr:.2e} at step {c.peak_step}", (c.peak_step, c.peak_lr),
                    xytext=(12, 4), textcoords="offset points", color=line.get_color(), fontsize=9)
    ax.set_xlabel("update step")
    ax.set_ylabel("learning rate")
    ax.set_xlim(0, max(int(c.steps[-1]) for c in curves))
    ax.set_ylim(0, max(c.peak_lr for c in curves) * 1.15)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    title = "Learning-rate schedule (section 5.3)"
    if all(c.schedule == "noam" for c in curves):
        title += ": lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)"
    suptitle(fig, title)
    return save_figure(fig, out, show)
