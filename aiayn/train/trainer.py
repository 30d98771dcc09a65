"""The training loop: the paper's schedule over planned updates (:mod:`aiayn.train.plan`, :mod:`aiayn.train.update`),
evaluation and early stopping, resumable checkpoints (:mod:`aiayn.train.resume`), progress and metrics, and at the
end the weights inference uses (:mod:`aiayn.run.inference_weights`). Several processes (torchrun):
:mod:`aiayn.train.parallel`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import aiayn.engine as engine
from aiayn.config import Config, ConfigError, TrainConfig
from aiayn.data.batching import Batch
from aiayn.data.loader import UpdateLoader, loader_workers
from aiayn.device import Precision, autocast_context, inference_precision
from aiayn.run.inference_weights import WeightsChoice, keep_best
from aiayn.train.console import Console
from aiayn.train.metrics_log import MetricsLog
from aiayn.train.parallel import Dist, check_agreement
from aiayn.train.plan import EpochPlanner, TrainData
from aiayn.train.resume import EMPTY_WINDOW, TrainState, restore_newest, save_state
from aiayn.train.schedule import build_optimizer, learning_rate
from aiayn.train.update import Levers, Update, UpdateSums, batch_to_device, training_module
from aiayn.train.validation import WeightsScores, evaluate_loss

log = logging.getLogger("aiayn.train")

# With several processes, the time budget (train.max_minutes) is checked every this many updates (and at every
# logged one): the check is a broadcast from rank 0 that the host waits for.
CLOCK_EVERY = 10

class Trainer:
    """Runs a :class:`Config` on a model and :class:`TrainData`, writing into ``run_dir``."""

    def __init__(self, cfg: Config, model: nn.Module, data: TrainData, run_dir: str | Path,
                 dist_info: Dist | None = None, precision: str | Precision = "fp32", progress: bool = True,
                 evaluate_extra: Callable[[nn.Module, Dist], dict[str, float]] | None = None) -> None:
        """``dist_info``: the process and its device (:func:`aiayn.train.parallel.init_distributed`);
        ``precision``: the resolved ``train.precision`` (fp32, bf16 or fp16), with its reason where it is a
        :class:`~aiayn.device.Precision` (:func:`aiayn.device.choose_precision`; both go into the first training line
        of metrics.jsonl after each start, which ``aiayn report`` reads);
        ``evaluate_extra``: more validation scores (validation BLEU)."""
        self.cfg, self.data, self.run_dir = cfg, data, Path(run_dir)
        self.d = dist_info or Dist()
        self.device = self.d.device
        self.model = engine.prepare_model(model, self.device, training=True)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.progress = progress
        self.evaluate_extra = evaluate_extra
        self.state = TrainState()
        self.precision, self.precision_why = (precision, "") if isinstance(precision, str) else precision
        self.autocast = autocast_context(self.precision, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        self.pad_id = cfg.model.pad_id
        self.stop_reason = ""

    # --- resume and save -------------------------------------------------------------------------

    def resume(self) -> bool:
        """Restore the newest complete checkpoint (:func:`~aiayn.train.resume.restore_newest`); False if none."""
        state = restore_newest(self.run_dir, self.model, self.optimizer, world=self.d.world,
                               accum_steps=self.cfg.train.accum_steps)
        self.state = state or self.state
        return state is not None

    def _save(self, keep_last: int, window: Window) -> None:
        self.state.window = window.to_json()  # a synchronization, at saves only
        if self.d.main:
            save_state(self.run_dir, self.model, self.optimizer, self.state, world=self.d.world,
                       accum_steps=self.cfg.train.accum_steps, keep_last=keep_last)
        self.d.barrier()

    # --- evaluate --------------------------------------------------------------------------------

    def _evaluate(self, metrics: MetricsLog) -> bool:
        """Validation; returns True when early stopping says stop."""
        tc, st = self.cfg.train, self.state
        result = self._validation(self.model, self.d)
        if self.evaluate_extra is not None:  # every process decodes its share (validation BLEU)
            # in the inference precision (what `aiayn translate` decodes in), not the training autocast: the
            # BLEU a training reports is the BLEU of its run's translations (fp32 weights, fp32 math).
            with engine.kernels(self.device, inference_precision(self.device)):
                result.update(self.evaluate_extra(self.model, self.d))
        if st.evaluated(result["valid_nll"]) and self.d.main:
            keep_best(self.model, self.run_dir, st.step, result["valid_nll"])
        record = {"step": st.step, "epoch": st.epoch, **{k: round(v, 6) for k, v in result.items()},
                  "best_step": st.best_step}
        metrics.write(record)
        if self.d.main:
            log.info("eval %s", " ".join(f"{k}={v}" for k, v in record.items()))
        stop = tc.patience is not None and st.bad_evals >= tc.patience
        if stop:
            self.stop_reason = (f"early stopping: validation NLL did not improve in train.patience={tc.patience} "
                                f"evaluations (best at step {st.best_step})")
        return stop

    def _validation(self, model: nn.Module, d: Dist) -> dict[str, float]:
        tc = self.cfg.train
        return evaluate_loss(model, self.data.valid_batches, tc.label_smoothing, self.pad_id, d, self.autocast)

    # --- the loop --------------------------------------------------------------------------------

    def train(self) -> TrainState:
        """Train until max_updates / max_epochs / max_minutes / early stop; returns the final state. The loop
        runs inside the engine's kernel choice for the device (:func:`aiayn.engine.kernels`)."""
        tc = self.cfg.train
        with engine.kernels(self.device, self.precision, tc.attention_backends), \
                EpochPlanner(self.data, tc.accum_steps, self.d) as planner, \
                update_loader(self.cfg, self.data, self.d) as loader:
            return self._train(planner, loader)

    def _train(self, planner: EpochPlanner, loader: UpdateLoader) -> TrainState:
        tc, st, d = self.cfg.train, self.state, self.d
        loop = self._begin(planner)
        # A resumed run that reached a limit already (its weight choice was interrupted): only that is done
        self.stop_reason = limit_reached(tc, st, d, log_step=True) if st.step else ""
        stop = bool(self.stop_reason)
        while not stop and (tc.max_epochs is None or st.epoch < tc.max_epochs):
            updates, totals = planner.updates(st.epoch)
            if not updates:
                raise ConfigError("the training data gives no full update: lower data.max_tokens "
                                  "or train.accum_steps, or add data")
            epoch = EpochTimer(st.epoch, st.position, st.step)
            batches = loader.epoch(updates, st.position)
            while st.position < len(updates) and not stop:
                micro = [batch_to_device(b, self.device) for b in epoch.wait(batches)]
                stop = self._step(loop, micro, totals[st.position])
            if d.main:
                epoch.log(st.position)
            if st.position >= len(updates):
                st.epoch, st.position = st.epoch + 1, 0
        if not self.stop_reason:
            self.stop_reason = f"train.max_epochs={tc.max_epochs} reached"
        if loop.last_saved != st.step:  # max_epochs reached between saves
            self._evaluate(loop.metrics)
            self._save(tc.keep_last, loop.window)
        loop.progress.close(st.step)
        loop.metrics.close()
        if d.main:
            log.info("stopped at step %d: %s", st.step, self.stop_reason)
        self.write_inference_weights()
        d.barrier()
        return st

    def _begin(self, planner: EpochPlanner) -> Loop:
        """What the loop keeps from update to update: the :class:`Update` (its module in train mode), the logs."""
        tc, st, d = self.cfg.train, self.state, self.d
        levers = Levers.from_config(self.cfg, self.device, self.precision)
        module, fields = training_module(self.model, self.cfg, d, levers)
        module.train()
        update = Update(module=module, optimizer=self.optimizer, label_smoothing=tc.label_smoothing,
                        pad_id=self.pad_id, clip_norm=tc.clip_norm, dist=d, autocast=self.autocast,
                        scaler=self.scaler, seed=tc.seed, **fields)
        return Loop(planner=planner, update=update, compiles=CompileLog(levers, d.main),
                    metrics=MetricsLog(self.run_dir, d.main, st.step if st.step else None, tc.log_to, self.cfg),
                    progress=Console(tc, self.cfg.expect, st.step, st.elapsed_s, show=d.main, bar=self.progress),
                    window=Window(self.device, st.window), start=time.perf_counter() - st.elapsed_s,
                    last_saved=st.step)

    def _step(self, loop: Loop, micro: list[Batch], total_tokens: int) -> bool:
        """One update, then what follows it: log, evaluate, save. Whether to stop."""
        tc, st, d = self.cfg.train, self.state, self.d
        step = st.step + 1
        lr = learning_rate(tc, self.cfg.model.d_model, step)
        log_step = step % tc.log_every == 0 or step == tc.max_updates
        sums = loop.update.run(micro, lr, step, total_tokens, measure_norms=log_step and d.world > 1)
        loop.compiles.updated()
        st.step, st.position = step, st.position + 1
        loop.planner.plan_ahead(st.epoch + 1)
        st.tokens += sums.ntokens
        loop.window.add(sums)
        if log_step:
            if sums.norms is not None:  # the processes still train one model, or stop here
                check_agreement(sums.norms, d, step)
            st.elapsed_s = time.perf_counter() - loop.start
            rec = loop.compiles.add_to(loop.window.record(st, lr))  # the loop's one host-device synchronization
            if not loop.said_precision:  # once per start: what it runs in, and why
                rec.update(precision=self.precision, precision_why=self.precision_why)
                loop.said_precision = True
            loop.metrics.write(rec)
            loop.progress.record(rec)
            loop.window = Window(self.device)
        else:  # the host's clock: it may be ahead of the device by the updates queued
            st.elapsed_s = time.perf_counter() - loop.start
        loop.progress.update(st.step, st.elapsed_s)
        reason = limit_reached(tc, st, d, log_step)
        self.stop_reason, stop = reason or self.stop_reason, bool(reason)
        if st.step % tc.eval_every == 0 or stop:
            stop = self._evaluate(loop.metrics) or stop
        if st.step % tc.save_every == 0 or stop:
            self._save(tc.keep_last, loop.window)
            loop.last_saved = st.step
        return stop

    # --- the end ----------------------------------------------------------------------------------

    def write_inference_weights(self) -> Path:
        """model.safetensors: the last, best or averaged weights (:mod:`aiayn.run.inference_weights`), chosen on
        this training's validation (:class:`~aiayn.train.validation.WeightsScores`)."""
        scores = WeightsScores(self.cfg, self.run_dir, self.data, self.d, self._validation)
        choice = WeightsChoice(self.cfg, self.run_dir, self.d.main, scores)
        return choice.write(self.model, self.state.step, self.state.best_step)


@dataclass(kw_only=True)
class Loop:
    """What :meth:`Trainer._train` carries from update to update."""

    planner: EpochPlanner
    update: Update
    compiles: CompileLog
    metrics: MetricsLog
    progress: Console
    window: Window  # the updates since the last logged one
    start: float  # perf_counter() when the run began, its earlier sessions' time included
    last_saved: int  # the step of the last checkpoint
    said_precision: bool = False  # whether a metrics line of this start has named the precision


def update_loader(cfg: Config, data: TrainData, d: Dist) -> UpdateLoader:
    """The planned updates' batches, built by DataLoader workers (:class:`aiayn.data.loader.UpdateLoader`)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if d.world > 1 else 1
    workers = loader_workers(cfg.data.loader_workers, d.device, torch.get_num_threads(), local_world)
    if d.main:
        log.info("batches built by %d DataLoader worker process(es) per training process%s", workers,
                 "" if cfg.data.loader_workers is not None else " (data.loader_workers: the free cores)")
    return UpdateLoader(data, workers, pin_memory=d.device.type == "cuda")


def limit_reached(tc: TrainConfig, st: TrainState, d: Dist, log_step: bool) -> str:
    """Why to stop after update ``st.step`` (``""``: go on): train.max_updates or train.max_minutes reached. Rank 0's
    clock decides for all processes: a collective (and a synchronization) with several, so then only every few
    updates; nothing at all with one."""
    if st.step >= tc.max_updates:
        return f"train.max_updates={tc.max_updates} reached"
    clock = tc.max_minutes is not None and (d.world == 1 or log_step or st.step % CLOCK_EVERY == 0)
    if clock and d.broadcast_flag(st.elapsed_s >= tc.max_minutes * 60, d.device):
        return (f"train.max_minutes={tc.max_minutes:g} reached ({st.elapsed_s / 60:.1f} minutes of training, "
                "counted from the run's first start)")
    return ""


class CompileLog:
    """What torch.compile did in a training that compiles (:class:`aiayn.engine.CompileCounter`): the graphs built in
    its first update (the warm-up: the shape policy compiles everything there), and every graph after it (a
    recompile, which stalls an update), in each logged metrics line (``graphs``, ``recompiles``) and as a warning."""

    def __init__(self, levers: Levers, main: bool) -> None:
        self.counter = engine.CompileCounter() if levers.compile or levers.fuse_norms else None
        self.main, self.reported = main, 0
        if main:
            log.info("speed levers: %s", levers.describe())

    def updated(self) -> None:
        """After each update: the first one ends the warm-up."""
        if self.counter is not None and self.counter.warm is None:
            self.counter.warmed_up()
            if self.main:
                log.info("torch.compile: %d graph(s) built in the first update", self.counter.graphs)

    def add_to(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with the graph counts (when compiling); warns of recompiles since the last logged line."""
        if self.counter is None:
            return record
        graphs, recompiles = self.counter.graphs, self.counter.recompiles
        if recompiles > self.reported and self.main:
            log.warning("torch.compile built %d more graph(s) after the first update (recompiles, each an update that "
                        "stalls; TORCH_LOGS=recompiles says why)", recompiles - self.reported)
        self.reported = recompiles
        return {**record, "graphs": graphs, "recompiles": recompiles}


class EpochTimer:
    """How long the training step waited for its batches in one epoch (from its first update to its last, or to the
    stop), against the epoch's whole time: the loader keeps up when the wait is a small share. Its line counts
    updates as the run does (``step``: the run's updates before this epoch's first here), not from 1 each epoch."""

    def __init__(self, epoch: int, position: int, step: int) -> None:
        self.epoch, self.first, self.step, self.waited, self.t0 = epoch, position, step, 0.0, time.perf_counter()

    def wait(self, batches: Iterator[list[Batch]]) -> list[Batch]:
        """The next update's batches, timing the wait for them."""
        t = time.perf_counter()
        out = next(batches)
        self.waited += time.perf_counter() - t
        return out

    def log(self, position: int) -> None:
        total = time.perf_counter() - self.t0
        updates = f"{self.step + 1}-{self.step + position - self.first} (the epoch's {self.first + 1}-{position})"
        log.info("epoch %d: updates %s in %.1f s, of which %.2f s (%.2f%%) waiting for batches", self.epoch, updates,
                 total, self.waited, 100 * self.waited / max(total, 1e-9))


class Window:
    """The updates since the last logged one: loss and NLL sums kept on the device (read once, at the log step or
    a save), target tokens and updates counted on the host, and the time of the tokens trained since it (re)began
    (a resumed window counts its earlier updates in the loss but not in the speed)."""

    def __init__(self, device: torch.device, saved: dict[str, float] | None = None) -> None:
        saved = saved or EMPTY_WINDOW
        self.updates, self.tokens = int(saved["updates"]), int(saved["tokens"])
        self.sums = (torch.tensor([saved["loss"], saved["nll"]], dtype=torch.float32, device=device)
                     if self.updates else None)
        self.timed_tokens, self.t0 = 0, time.perf_counter()

    def add(self, update: UpdateSums) -> None:
        sums = update.sums[:2]
        self.sums = sums if self.sums is None else self.sums + sums
        self.tokens += update.ntokens
        self.timed_tokens += update.ntokens
        self.updates += 1

    def to_json(self) -> dict[str, float]:
        loss, nll = self.sums.tolist() if self.sums is not None else (0.0, 0.0)
        return {"loss": loss, "nll": nll, "tokens": self.tokens, "updates": self.updates}

    def record(self, st: TrainState, lr: float) -> dict[str, Any]:
        """The metrics line of logged update ``st.step``."""
        loss, nll = self.sums.tolist()  # waits for the device
        now, tokens = time.perf_counter(), max(self.tokens, 1)
        return {"step": st.step, "epoch": st.epoch, "lr": lr,
                "train_loss": round(loss / tokens, 5), "train_nll": round(nll / tokens, 5),
                "tokens_per_s": round(self.timed_tokens / max(now - self.t0, 1e-9), 1),
                "tokens_per_update": round(self.tokens / max(self.updates, 1)),
                "elapsed_s": round(st.elapsed_s, 2)}
