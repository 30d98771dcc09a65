"""The training loop: the paper's schedule over planned updates (:mod:`aiayn.train.plan`, :mod:`aiayn.train.update`),
evaluation and early stopping, atomic resumable checkpoints, progress and metrics, and the weights inference
uses. Several processes (torchrun): :mod:`aiayn.train.parallel`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import aiayn.engine as engine
from aiayn.config import Config, ConfigError, DecodeOptions
from aiayn.data.batching import Batch
from aiayn.data.loader import UpdateLoader, loader_workers
from aiayn.device import autocast_context, inference_precision
from aiayn.errors import CheckpointError
from aiayn.train.checkpoint import load_checkpoint, read_checkpoint_state, save_checkpoint, set_rng_state
from aiayn.train.console import Console
from aiayn.train.metrics import MetricsLog
from aiayn.train.parallel import Dist, check_agreement
from aiayn.train.plan import EpochPlanner, TrainData
from aiayn.train.schedule import build_optimizer, learning_rate
from aiayn.train.update import Levers, Update, UpdateSums, batch_to_device, training_module
from aiayn.train.validation import evaluate_loss
from aiayn.weights import average_weights, checkpoint_paths, list_checkpoints, read_weights, save_weights

log = logging.getLogger("aiayn.train")

# With several processes, the time budget (train.max_minutes) is checked every this many updates (and at every
# logged one): the check is a broadcast from rank 0 that the host waits for.
CLOCK_EVERY = 10

EMPTY_WINDOW = {"loss": 0.0, "nll": 0.0, "tokens": 0, "updates": 0}


@dataclass
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


def resume_config(cfg: Config, run_dir: Path, world: int) -> Config:
    """The config a resume of ``run_dir`` on ``world`` processes trains with, checked against the run's newest
    checkpoint before any work: the run's micro-batches per update (processes x ``train.accum_steps``) shared out
    over ``world`` processes, so every update takes the batches it would have taken (:mod:`aiayn.train.plan`);
    refused with one line when ``world`` does not divide them, or when the run has spent its
    ``train.max_minutes`` (counted from its first start)."""
    steps = list_checkpoints(run_dir)
    if not steps:
        return cfg
    _, _, jpath = checkpoint_paths(run_dir, steps[-1])
    meta = read_checkpoint_state(run_dir, steps[-1])
    elapsed = (meta.get("train_state") or {}).get("elapsed_s")
    step = (meta.get("train_state") or {}).get("step", 0)
    tc = cfg.train
    if isinstance(elapsed, (int, float)) and tc.max_minutes is not None and elapsed >= tc.max_minutes * 60 \
            and isinstance(step, int) and step < tc.max_updates:
        raise ConfigError(f"{run_dir} has trained {elapsed / 60:.1f} minutes, its train.max_minutes="
                          f"{tc.max_minutes:g} (counted from the run's first start): give it more to go on, e.g. "
                          f"--set train.max_minutes={_more_minutes(elapsed, tc.max_minutes)}")
    saved_world = meta.get("world_size") or 1
    saved_accum = meta.get("accum_steps") or tc.accum_steps  # older checkpoints: the run's config says it
    micro = saved_world * saved_accum
    if micro == world * tc.accum_steps:
        return cfg
    if micro % world:
        raise CheckpointError(
            f"{jpath}: each update of this run takes {micro} micro-batches ({saved_world} process(es) x "
            f"train.accum_steps={saved_accum}), which {world} processes cannot share out evenly; resume with a "
            f"number of processes that divides {micro}")
    accum = micro // world
    log.info("resumed by %d process(es) instead of %d: train.accum_steps=%d keeps the run's %d micro-batches per "
             "update (the same batches)", world, saved_world, accum, micro)
    return dataclasses.replace(cfg, train=dataclasses.replace(tc, accum_steps=accum))


class Trainer:
    """Runs a :class:`Config` on a model and :class:`TrainData`, writing into ``run_dir``."""

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        data: TrainData,
        run_dir: str | Path,
        dist_info: Dist | None = None,
        precision: str = "fp32",
        progress: bool = True,
        evaluate_extra: Callable[[nn.Module, Dist], dict[str, float]] | None = None,
    ) -> None:
        """``dist_info``: the process and its device (:func:`aiayn.train.parallel.init_distributed`);
        ``precision``: the resolved ``train.precision`` (fp32, bf16 or fp16; :func:`aiayn.device.resolve_precision`);
        ``evaluate_extra``: more validation scores (validation BLEU)."""
        self.cfg, self.data, self.run_dir = cfg, data, Path(run_dir)
        self.d = dist_info or Dist()
        self.device = self.d.device
        self.model = engine.prepare_model(model, self.device, training=True)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.progress = progress
        self.evaluate_extra = evaluate_extra
        self.state = TrainState()
        self.precision = precision
        self.autocast = autocast_context(self.precision, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        self.pad_id = cfg.model.pad_id
        self.stop_reason = ""
        self._valid_bleu: Callable[..., dict[str, float]] | None = None  # the averaging choice's (built when needed)

    @property
    def best_path(self) -> Path:
        return self.run_dir / "checkpoints" / "best.safetensors"

    def planner(self) -> EpochPlanner:
        """This process's updates, epoch by epoch (:class:`aiayn.train.plan.EpochPlanner`)."""
        return EpochPlanner(self.data, self.cfg.train.accum_steps, self.d)

    def loader(self) -> UpdateLoader:
        """The planned updates' batches, built by DataLoader workers (:class:`aiayn.data.loader.UpdateLoader`)."""
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.d.world > 1 else 1
        workers = loader_workers(self.cfg.data.loader_workers, self.device, torch.get_num_threads(), local_world)
        if self.d.main:
            log.info("batches built by %d DataLoader worker process(es) per training process%s", workers,
                     "" if self.cfg.data.loader_workers is not None else " (data.loader_workers: the free cores)")
        return UpdateLoader(self.data, workers, pin_memory=self.device.type == "cuda")

    # --- resume and save -------------------------------------------------------------------------

    def resume(self) -> bool:
        """Restore the newest complete checkpoint; False when there is none."""
        steps = list_checkpoints(self.run_dir)
        if not steps:
            return False
        _, _, jpath = checkpoint_paths(self.run_dir, steps[-1])
        meta = read_checkpoint_state(self.run_dir, steps[-1])
        try:  # checked before the weights are loaded: a damaged state leaves the model as it was
            state = TrainState.from_json(meta.get("train_state"), steps[-1])
        except ValueError as e:
            raise CheckpointError(f"{jpath}: not a valid checkpoint state ({e})") from None
        saved = (meta.get("world_size") or 1) * (meta.get("accum_steps") or self.cfg.train.accum_steps)
        if saved != self.d.world * self.cfg.train.accum_steps:  # resume_config makes them equal, or refuses
            raise CheckpointError(f"{jpath}: each update took {saved} micro-batches, this resume would take "
                                  f"{self.d.world * self.cfg.train.accum_steps}; other batches: refused")
        load_checkpoint(self.run_dir, steps[-1], self.model, self.optimizer)
        self.state = state
        set_rng_state(meta["rng"])  # Python's and NumPy's; torch's is seeded again for every micro-batch
        return True

    def _save(self, keep_last: int, window: Window) -> None:
        self.state.window = window.to_json()  # a synchronization, at saves only
        if self.d.main:
            save_checkpoint(self.run_dir, self.state.step, self.model, self.optimizer,
                            {"train_state": self.state.to_json(), "world_size": self.d.world,
                             "accum_steps": self.cfg.train.accum_steps, "cpu_threads": torch.get_num_threads()},
                            keep_last=keep_last)
        self.d.barrier()

    # --- evaluate --------------------------------------------------------------------------------

    def _evaluate(self, metrics: MetricsLog) -> bool:
        """Validation; returns True when early stopping says stop."""
        tc = self.cfg.train
        result = self._validation(self.model, self.d)
        if self.evaluate_extra is not None:  # every process decodes its share (validation BLEU)
            # in the inference precision (what `aiayn translate` decodes in), not the training autocast: the
            # BLEU a training reports is the BLEU of its run's translations (fp32 weights, fp32 math).
            with engine.kernels(self.device, inference_precision(self.device)):
                extra = self.evaluate_extra(self.model, self.d)
            result.update(extra)
        st = self.state
        improved = st.best_valid is None or result["valid_nll"] < st.best_valid - 1e-6
        if improved:
            st.best_valid, st.best_step, st.bad_evals = result["valid_nll"], st.step, 0
            if self.d.main:  # kept apart from the rotating checkpoints, so 'best' is always on disk
                save_weights(self.model, self.best_path, {"source": f"best step {st.step}",
                                                          "valid_nll": str(result["valid_nll"])})
        else:
            st.bad_evals += 1
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
        backends = self.cfg.train.attention_backends
        with engine.kernels(self.device, self.precision, backends), self.planner() as planner, self.loader() as loader:
            return self._train(planner, loader)

    def _train(self, planner: EpochPlanner, loader: UpdateLoader) -> TrainState:
        tc, st, d = self.cfg.train, self.state, self.d
        metrics = MetricsLog(self.run_dir, d.main, st.step if st.step else None, tc.log_to, self.cfg)
        levers = Levers.from_config(self.cfg, self.device, self.precision)
        module, fields = training_module(self.model, self.cfg, d, levers)
        module.train()
        update = Update(module, self.optimizer, tc.label_smoothing, self.pad_id, tc.clip_norm, d, self.autocast,
                        self.scaler, seed=tc.seed, **fields)
        compiles = CompileLog(levers, d.main)
        progress = Console(tc, self.cfg.expect, st.step, st.elapsed_s, show=d.main, bar=self.progress)
        window = Window(self.device, st.window)
        start = time.perf_counter() - st.elapsed_s
        stop = st.step >= tc.max_updates
        if stop:
            self.stop_reason = f"train.max_updates={tc.max_updates} reached"
        last_saved = st.step
        while not stop and (tc.max_epochs is None or st.epoch < tc.max_epochs):
            updates, totals = planner.updates(st.epoch)
            if not updates:
                raise ConfigError("the training data gives no full update: lower data.max_tokens "
                                  "or train.accum_steps, or add data")
            epoch = EpochTimer(st.epoch, st.position, st.step)
            batches = loader.epoch(updates, st.position)
            while st.position < len(updates) and not stop:
                micro = [batch_to_device(b, self.device) for b in epoch.wait(batches)]
                step = st.step + 1
                lr = learning_rate(tc, self.cfg.model.d_model, step)
                log_step = step % tc.log_every == 0 or step == tc.max_updates
                sums = update.run(micro, lr, step, totals[st.position], measure_norms=log_step and d.world > 1)
                compiles.updated()
                st.step, st.position = step, st.position + 1
                planner.plan_ahead(st.epoch + 1)
                st.tokens += sums.ntokens
                window.add(sums)
                if log_step:
                    if sums.norms is not None:  # the processes still train one model, or stop here
                        check_agreement(sums.norms, d, step)
                    st.elapsed_s = time.perf_counter() - start
                    rec = compiles.add_to(window.record(st, lr))  # the loop's one host-device synchronization
                    metrics.write(rec)
                    progress.record(rec)
                    window = Window(self.device)
                else:  # the host's clock: it may be ahead of the device by the updates queued
                    st.elapsed_s = time.perf_counter() - start
                progress.update(st.step, st.elapsed_s)
                stop = self._should_stop(log_step)
                if st.step % tc.eval_every == 0 or stop:
                    stop = self._evaluate(metrics) or stop
                if st.step % tc.save_every == 0 or stop:
                    self._save(tc.keep_last, window)
                    last_saved = st.step
            if d.main:
                epoch.log(st.position)
            if st.position >= len(updates):
                st.epoch, st.position = st.epoch + 1, 0
        if not self.stop_reason:
            self.stop_reason = f"train.max_epochs={tc.max_epochs} reached"
        if last_saved != st.step:  # max_epochs reached between saves
            self._evaluate(metrics)
            self._save(tc.keep_last, window)
        progress.close(st.step)
        metrics.close()
        if d.main:
            log.info("stopped at step %d: %s", st.step, self.stop_reason)
        self.write_inference_weights()
        d.barrier()
        return st

    def _should_stop(self, log_step: bool) -> bool:
        """max_updates or max_minutes reached (the reason kept in :attr:`stop_reason`). Rank 0's clock decides for
        all processes: a collective (and a synchronization) with several, so then only every few updates;
        nothing at all with one."""
        tc, st = self.cfg.train, self.state
        if st.step >= tc.max_updates:
            self.stop_reason = f"train.max_updates={tc.max_updates} reached"
            return True
        clock = tc.max_minutes is not None and (self.d.world == 1 or log_step or st.step % CLOCK_EVERY == 0)
        if clock and self.d.broadcast_flag(st.elapsed_s >= tc.max_minutes * 60, self.device):
            self.stop_reason = (f"train.max_minutes={tc.max_minutes:g} reached ({st.elapsed_s / 60:.1f} minutes of "
                                "training, counted from the run's first start)")
            return True
        return False

    # --- the weights inference uses ------------------------------------------------------------------

    def write_inference_weights(self) -> Path:
        """model.safetensors: the last, best or averaged weights, as ``train.inference_weights`` says, and says
        which in one line. The average of the last checkpoints is used only where validation finds it at least
        as good as the last weights (:func:`prefer_average`: validation BLEU for translation, then NLL; a run cut
        early averages undertrained checkpoints, which can be much worse); otherwise the last weights are. Rank 0
        writes; every process takes part in the validation."""
        tc, out = self.cfg.train, self.run_dir / "model.safetensors"
        steps = list_checkpoints(self.run_dir)
        chosen: Any = self.model
        if tc.inference_weights == "average" and steps:
            averaged = steps[-tc.average_last :]
            avg = average_weights([checkpoint_paths(self.run_dir, s)[0] for s in averaged])
            chosen, why = self._better_of_average(avg, averaged)
        elif tc.inference_weights == "best" and self.best_path.exists():
            chosen = read_weights(self.best_path)
            why = f"best step {self.state.best_step} (train.inference_weights=best)"
        else:
            why = f"last step {self.state.step}"
        if self.d.main:
            save_weights(chosen, out, {"source": why})
            log.info("inference weights (%s): %s", out.name, why)
        return out

    def _better_of_average(self, avg: dict[str, torch.Tensor], steps: list[int]) -> tuple[Any, str]:
        """The average of checkpoints ``steps`` or the last weights, whichever scores better on validation
        (:func:`prefer_average`: BLEU for a translation run, NLL breaking a tie), and why."""
        last = self.state.step
        if len(steps) == 1 and steps[0] == last:
            return self.model, f"last step {last} (the only checkpoint to average)"
        own = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        last_scores = self._choice_scores()
        self.model.load_state_dict({k: v.to(own[k].device, own[k].dtype) for k, v in avg.items()}, strict=False)
        avg_scores = self._choice_scores()
        self.model.load_state_dict(own)
        said = describe_choice(avg_scores, last_scores, last, search_words(self.cfg.decode))
        if prefer_average(avg_scores, last_scores):
            return avg, f"average of steps {steps} (train.inference_weights=average; {said})"
        return self.model, f"last step {last}: the average of steps {steps} is worse on validation ({said}), so it " \
                           "is not used"

    def _choice_scores(self) -> dict[str, float]:
        """The validation NLL of the model's weights, and for a translation run the validation BLEU of their
        translations by the recipe's own search (``decode``: what the user's translations get; greedy BLEU, the
        training's, disagreed with beam search on runs cut early: an average that wins greedy can write too short
        beam output), greedy for a recipe that samples."""
        scores = {"valid_nll": self._validation(self.model, self.d)["valid_nll"]}
        if self.cfg.task == "translation":
            if self._valid_bleu is None:  # built once: the sources and references of the validation set
                from aiayn.data.tokenizer import TokenizerPair
                from aiayn.train.validation import validation_bleu_fn

                tokenizers = TokenizerPair.load(self.run_dir / "tokenizer")
                search = None if self.cfg.decode.sample else self.cfg.decode
                self._valid_bleu = validation_bleu_fn(self.cfg, self.data, tokenizers, search)
            with engine.kernels(self.device, inference_precision(self.device)):  # as aiayn translate decodes
                scores.update(self._valid_bleu(self.model, self.d))
        return scores


# Validation BLEU closer than this is a tie (sacreBLEU prints two decimals), which validation NLL decides.
BLEU_TIE = 0.01


def prefer_average(avg: dict[str, float], last: dict[str, float]) -> bool:
    """Whether the averaged weights beat the last ones: on validation BLEU when both have it and it differs by
    ``BLEU_TIE`` or more (a run cut early can average undertrained checkpoints; a longer one gains from it, on
    BLEU even where NLL says otherwise), else on validation NLL, the average winning a tie."""
    if "valid_bleu" in avg and "valid_bleu" in last and abs(avg["valid_bleu"] - last["valid_bleu"]) >= BLEU_TIE:
        return avg["valid_bleu"] > last["valid_bleu"]
    return avg["valid_nll"] <= last["valid_nll"]


def describe_choice(avg: dict[str, float], last: dict[str, float], last_step: int, search: str = "greedy") -> str:
    """The scores behind :func:`prefer_average`'s choice, in words (``search``: how the BLEU was decoded)."""
    nll = f"NLL {avg['valid_nll']:.4f} against {last['valid_nll']:.4f}"
    if "valid_bleu" not in avg:
        return f"validation {nll} for the last step {last_step}"
    tie = " (a tie: NLL decides)" if abs(avg["valid_bleu"] - last["valid_bleu"]) < BLEU_TIE else ""
    return (f"validation BLEU ({search}) {avg['valid_bleu']:.2f} against {last['valid_bleu']:.2f} for the last "
            f"step {last_step}{tie}; {nll}")


def search_words(o: DecodeOptions) -> str:
    """How a validation BLEU was decoded, in words: the recipe's beam and length penalty, or greedy."""
    if o.sample or o.beam == 1:
        return "greedy"
    return f"the recipe's beam {o.beam}, {o.length_penalty} alpha {o.alpha:g}"


def _more_minutes(elapsed_s: float, minutes: float) -> str:
    return f"{max(minutes * 2, elapsed_s / 60 + minutes):g}"


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
        log.info("epoch %d: updates %d-%d (the epoch's %d-%d) in %.1f s, of which %.2f s (%.2f%%) waiting for "
                 "batches", self.epoch, self.step + 1, self.step + position - self.first, self.first + 1, position,
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
