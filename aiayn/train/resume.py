"""Resuming a training: what a checkpoint's JSON says of its run (:class:`CheckpointMeta`, read and checked once,
here), the loop's place it restores (:class:`TrainState`), the micro-batches of an update that every resume keeps
(:func:`aiayn.train.plan.micro_batches`), and the config a resume trains with (:func:`resume_config`).

The checkpoint files themselves (weights, optimizer, RNG, the JSON's schema) are :mod:`aiayn.train.checkpoint`'s;
this module is the one place that reads or writes the training's own keys of that JSON (``train_state``,
``world_size``, ``accum_steps``, ``cpu_threads``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import Config, ConfigError
from aiayn.errors import CheckpointError
from aiayn.run.weights import checkpoint_paths, list_checkpoints
from aiayn.train.checkpoint import load_checkpoint, read_checkpoint_state, save_checkpoint, set_rng_state
from aiayn.train.plan import micro_batches

log = logging.getLogger("aiayn.train")

EMPTY_WINDOW = {"loss": 0.0, "nll": 0.0, "tokens": 0, "updates": 0}


@dataclass(kw_only=True)
class TrainState:
    """Where training is: saved in every checkpoint's JSON and restored by --resume."""

    step: int = 0
    epoch: int = 0
    position: int = 0  # index of the next update within the current epoch
    best_valid: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    elapsed_s: float = 0.0
    tokens: int = 0
    # the logging window the run is in: loss and NLL sums, target tokens and updates since the last logged update,
    # so that a resume inside a window logs what the uninterrupted run logs
    window: dict[str, float] = field(default_factory=lambda: dict(EMPTY_WINDOW))

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("step", "epoch", "position", "best_valid", "best_step",
                                              "bad_evals", "elapsed_s", "tokens", "window")}

    def evaluated(self, valid_nll: float) -> bool:
        """Count a validation of update :attr:`step` for early stopping: whether its NLL beats the best so far (by
        more than 1e-6), which makes it the best and the bad evaluations 0; else one more bad evaluation."""
        improved = self.best_valid is None or valid_nll < self.best_valid - 1e-6
        if improved:
            self.best_valid, self.best_step, self.bad_evals = valid_nll, self.step, 0
        else:
            self.bad_evals += 1
        return improved

    @classmethod
    def from_json(cls, values: Any, step: int) -> TrainState:
        """The state a checkpoint of ``step`` saved, checked: exactly the keys of :meth:`to_json`, counts
        non-negative integers, ``step`` the checkpoint's. ValueError says what is wrong."""
        if not isinstance(values, dict):
            raise ValueError(f"train_state is {type(values).__name__}, expected an object")
        keys = cls().to_json()
        values = {"window": dict(EMPTY_WINDOW), **values}  # a checkpoint from before windows were saved
        missing, extra = sorted(set(keys) - set(values)), sorted(set(values) - set(keys))
        if missing or extra:
            raise ValueError(f"train_state: {'no key' if missing else 'unexpected key'} {(missing or extra)[0]!r}")
        for k in ("step", "epoch", "position", "bad_evals", "tokens"):
            if type(values[k]) is not int or values[k] < 0:
                raise ValueError(f"train_state.{k} is {values[k]!r}, expected a non-negative integer")
        if values["best_step"] is not None and (type(values["best_step"]) is not int or values["best_step"] < 0):
            raise ValueError(f"train_state.best_step is {values['best_step']!r}, expected an integer or null")
        best = values["best_valid"]  # NaN is possible: a diverged run still checkpoints
        if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float))):
            raise ValueError(f"train_state.best_valid is {best!r}, expected a number or null")
        elapsed = values["elapsed_s"]
        if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not elapsed >= 0:
            raise ValueError(f"train_state.elapsed_s is {elapsed!r}, expected seconds >= 0")
        window = values["window"]
        if not isinstance(window, dict) or set(window) != set(EMPTY_WINDOW) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) for v in window.values()):
            raise ValueError(f"train_state.window is {window!r}, expected numbers {', '.join(EMPTY_WINDOW)}")
        if values["step"] != step:
            raise ValueError(f"train_state.step is {values['step']}, the checkpoint's step is {step}")
        return cls(**values)


@dataclass(frozen=True)
class CheckpointMeta:
    """What checkpoint ``step``'s JSON says of its run, checked when read (:meth:`read`): the schema
    (:func:`aiayn.train.checkpoint.read_checkpoint_state`) and the training state (:meth:`TrainState.from_json`)."""

    path: Path  # the JSON file, named in messages
    step: int
    state: TrainState
    rng: dict[str, Any]  # torch's generator states (:func:`aiayn.train.checkpoint.rng_state`)
    world_size: int = 1  # processes of the run when it saved
    accum_steps: int | None = None  # None: a checkpoint from before it was saved (the run's config says it)
    cpu_threads: int | None = None  # the CPU threads it trained with (float sums depend on them)

    @classmethod
    def read(cls, run_dir: str | Path, step: int) -> CheckpointMeta:
        """Checkpoint ``step`` of ``run_dir``; anything wrong is one CheckpointError naming the file."""
        jpath = checkpoint_paths(run_dir, step)[2]
        meta = read_checkpoint_state(run_dir, step)
        try:
            state = TrainState.from_json(meta.get("train_state"), step)
        except ValueError as e:
            raise CheckpointError(f"{jpath}: not a valid checkpoint state ({e})") from None
        return cls(path=jpath, step=step, state=state, rng=meta["rng"], world_size=meta.get("world_size", 1),
                   accum_steps=meta.get("accum_steps"), cpu_threads=meta.get("cpu_threads"))

    @classmethod
    def newest(cls, run_dir: str | Path) -> CheckpointMeta | None:
        """The newest complete checkpoint of ``run_dir``, None when it has none."""
        steps = list_checkpoints(run_dir)
        return cls.read(run_dir, steps[-1]) if steps else None

    def micro_batches(self, accum_steps: int) -> int:
        """The micro-batches of each of the run's updates (``accum_steps``: the run's config, for a checkpoint
        that does not say)."""
        return micro_batches(self.world_size, self.accum_steps or accum_steps)


def save_state(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, *, world: int,
               accum_steps: int, keep_last: int | None) -> None:
    """Checkpoint ``state.step`` (:func:`aiayn.train.checkpoint.save_checkpoint`) with what :meth:`CheckpointMeta.read`
    reads back: the state, the micro-batches of an update as processes x accumulation steps, the CPU threads."""
    save_checkpoint(run_dir, state.step, model, optimizer,
                    {"train_state": state.to_json(), "world_size": world, "accum_steps": accum_steps,
                     "cpu_threads": torch.get_num_threads()}, keep_last=keep_last)


def restore_newest(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, world: int,
                   accum_steps: int) -> TrainState | None:
    """Load the newest checkpoint of ``run_dir`` into ``model`` and ``optimizer`` and set torch's generators; its
    state, None when there is none. Everything is checked before anything is loaded: a damaged checkpoint, or one
    whose updates took other micro-batches than ``world`` x ``accum_steps`` (:func:`resume_config` makes them equal,
    or refuses), leaves the model as it was."""
    meta = CheckpointMeta.newest(run_dir)
    if meta is None:
        return None
    saved, now = meta.micro_batches(accum_steps), micro_batches(world, accum_steps)
    if saved != now:
        raise CheckpointError(f"{meta.path}: each update took {saved} micro-batches, this resume would take "
                              f"{now}; other batches: refused")
    load_checkpoint(run_dir, meta.step, model, optimizer)
    set_rng_state(meta.rng)  # dropout is seeded again for every micro-batch (aiayn.train.update.seed_update)
    return meta.state


def weights_chosen(run_dir: Path) -> bool:
    """Whether a run's training chose its inference weights after its newest checkpoint: model.safetensors is
    there and newer (a training stopped while choosing them, by Ctrl-C or a kill, left none, or an older one)."""
    final, steps = run_dir / "model.safetensors", list_checkpoints(run_dir)
    if not final.is_file():
        return False
    return not steps or final.stat().st_mtime >= checkpoint_paths(run_dir, steps[-1])[2].stat().st_mtime


def resume_config(cfg: Config, run_dir: Path, world: int) -> Config:
    """The config a resume of ``run_dir`` on ``world`` processes trains with, checked against the run's newest
    checkpoint before any work: the run's micro-batches per update (processes x ``train.accum_steps``) shared out
    over ``world`` processes, so every update takes the batches it would have taken (:mod:`aiayn.train.plan`);
    refused with one line when ``world`` does not divide them, or when the run has spent its
    ``train.max_minutes`` (counted from its first start) and chose its inference weights (one stopped while it chose
    them is resumed to finish that: :func:`weights_chosen`)."""
    meta = CheckpointMeta.newest(run_dir)
    if meta is None:
        return cfg
    tc, elapsed = cfg.train, meta.state.elapsed_s
    spent = tc.max_minutes is not None and elapsed >= tc.max_minutes * 60 and meta.state.step < tc.max_updates
    if spent and not weights_chosen(run_dir):  # stopped while it chose its weights: the resume finishes that
        log.info("%s has spent its train.max_minutes=%g; its inference weights were not chosen yet: choosing them "
                 "now, without training more", run_dir, tc.max_minutes)
    elif spent:
        raise ConfigError(f"{run_dir} has trained {elapsed / 60:.1f} minutes, its train.max_minutes="
                          f"{tc.max_minutes:g} (counted from the run's first start): give it more to go on, e.g. "
                          f"--set train.max_minutes={_more_minutes(elapsed, tc.max_minutes)}")
    micro = meta.micro_batches(tc.accum_steps)
    if micro == micro_batches(world, tc.accum_steps):
        return cfg
    if micro % world:
        raise CheckpointError(
            f"{meta.path}: each update of this run takes {micro} micro-batches ({meta.world_size} process(es) x "
            f"train.accum_steps={meta.accum_steps or tc.accum_steps}), which {world} processes cannot share out "
            f"evenly; resume with a number of processes that divides {micro}", every_rank=True)
    accum = micro // world
    log.info("resumed by %d process(es) instead of %d: train.accum_steps=%d keeps the run's %d micro-batches per "
             "update (the same batches)", world, meta.world_size, accum, micro)
    return dataclasses.replace(cfg, train=dataclasses.replace(tc, accum_steps=accum))


def _more_minutes(elapsed_s: float, minutes: float) -> str:
    return f"{max(minutes * 2, elapsed_s / 60 + minutes):g}"
