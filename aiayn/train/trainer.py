"""The training loop: token-normalized accumulation, the paper's schedule, evaluation, early stopping,
atomic resumable checkpoints, progress and metrics, and data parallelism through torchrun.

Shapes: B batch, S source length, T target length, V vocabulary.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

import aiayn.engine as engine
from aiayn.config import Config, ConfigError
from aiayn.data.batching import Batch
from aiayn.data.loader import Prefetcher
from aiayn.device import autocast_context, inference_precision, model_device, resolve_device
from aiayn.errors import CheckpointError, DeviceError
from aiayn.model.layers import DecoderLayer, EncoderLayer
from aiayn.train.checkpoint import load_checkpoint, read_checkpoint_state, save_checkpoint, set_rng_state
from aiayn.train.loss import compiled_loss, label_smoothed_cross_entropy
from aiayn.train.metrics import MetricsLog
from aiayn.train.progress import Progress
from aiayn.train.schedule import build_optimizer, learning_rate
from aiayn.weights import (
    average_weights,
    checkpoint_paths,
    list_checkpoints,
    read_weights,
    save_weights,
)

log = logging.getLogger("aiayn.train")

PREFETCH_UPDATES = 2  # updates collated ahead of the step by the loader thread


class TrainData(Protocol):
    """What the loop needs from a task's data: a deterministic plan of each epoch's batches (cheap: no tensors),
    the target tokens of a planned batch, the batch itself on demand, and the validation batches."""

    def epoch_plan(self, epoch: int) -> Sequence[Any]: ...

    def plan_tokens(self, item: Any) -> int: ...

    def collate_plan(self, item: Any) -> Batch: ...

    @property
    def valid_batches(self) -> list[Batch]: ...


# --- distributed helpers ---------------------------------------------------------------------------


@dataclass
class Dist:
    """Where this process trains: its rank among ``world`` processes, and its device (resolved once)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    setup_group: Any = None  # the gloo group of the setup barriers (their own, long timeout)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def setup_barrier(self) -> None:
        """The barrier where the other processes wait while rank 0 prepares the data (tokenizer, store, caches):
        on its own gloo group, whose timeout is ``train.setup_timeout_s`` rather than the training collectives'."""
        if self.world > 1:
            dist.barrier(group=self.setup_group)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (picklable, small), in rank order, on every process."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: Sequence[float], device: torch.device) -> list[float]:
        """All-reduce (sum) a few scalars across processes."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over processes (in place; no host synchronization)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def broadcast_flag(self, flag: bool, device: torch.device) -> bool:
        """Rank 0's decision, for all (so every process stops at the same update)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], device=device)
        dist.broadcast(t, 0)
        return bool(t.item())


def init_distributed(device: str | torch.device = "auto", timeout_s: float = 1800.0,
                     setup_timeout_s: float = 86400.0) -> Dist:
    """This process's place: the process group torchrun set up (WORLD_SIZE > 1), else a single process, and
    its device, resolved once from ``train.device`` (a torchrun process gets its own GPU, cuda:LOCAL_RANK).

    NCCL when this process trains on CUDA (its GPU is made current first, so NCCL's communicators and buffers
    live there rather than all on GPU 0), gloo otherwise. ``timeout_s`` (``train.dist_timeout_s``) bounds every
    collective of the training; the wait while rank 0 prepares the data is on a gloo group of its own, bounded by
    ``setup_timeout_s`` (``train.setup_timeout_s``): a first start on a big corpus outlasts a collective's
    timeout without being killed by it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return Dist(device=dev)
    check_rank_device(dev, local_rank, world)
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = timedelta(seconds=timeout_s)
        # torchrun's store outlives a restart (--max-restarts) and still holds the dead processes' addresses under
        # the keys a new group reads: each attempt gets keys of its own, or a restarted group may connect to a
        # dead port (refused, or a hang).
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.PrefixStore(
            f"aiayn/attempt-{attempt}/", store), rank=rank, world_size=world, timeout=timeout)
    setup = dist.new_group(backend="gloo", timeout=timedelta(seconds=setup_timeout_s))
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev, setup)


def check_rank_device(device: torch.device, local_rank: int, world: int) -> None:
    """Each of several processes on a machine trains on its own GPU, cuda:LOCAL_RANK (what ``auto`` and a
    bare ``cuda`` give); ``cuda:N`` would put them all on one GPU."""
    if world > 1 and device.type == "cuda" and device.index != local_rank:
        raise DeviceError(f"train.device={device}: with {world} processes each needs its own GPU (process "
                          f"{local_rank} would use {device}); use auto or cuda")


# --- one update ------------------------------------------------------------------------------------


def batch_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Teacher-forced logits (B, T, V) for a translation batch (src given) or an LM batch (src None)."""
    if batch.src is None:
        return model(batch.tgt_in)
    return model(batch.src, batch.tgt_in)


def batch_to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` on ``device``; to CUDA through page-locked memory with a non-blocking copy, so the host
    goes on queueing work instead of waiting for the transfer (a batch the prefetcher already pinned is not
    copied again)."""
    if device.type == "cuda":
        pinned = batch if batch.tgt_in.is_pinned() else batch.pin_memory()
        return pinned.to(device, non_blocking=True)
    return batch.to(device)


LossFn = Callable[[torch.Tensor, torch.Tensor, float, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class UpdateStats:
    loss: float  # label-smoothed loss summed over target tokens
    nll: float  # negative log-likelihood summed over target tokens
    ntokens: int  # target tokens of the whole update (all micro-batches, all processes)
    grad_norm: float | None = None


@dataclass
class UpdateSums:
    """An update's statistics still on the device: ``sums`` (2,) loss and NLL summed over the update's target
    tokens on every process, then the gradient norm when clipped (3,); :meth:`read` waits for the device."""

    sums: torch.Tensor
    ntokens: int

    def read(self) -> UpdateStats:
        values = self.sums.tolist()  # a host-device synchronization
        return UpdateStats(values[0], values[1], self.ntokens, values[2] if len(values) > 2 else None)


def train_update(*args, **kwargs) -> UpdateStats:
    """:func:`run_update`, then its statistics read (the host waits for the device once)."""
    return run_update(*args, **kwargs).read()


def run_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Batch],
    lr: float,
    label_smoothing: float,
    pad_id: int = 0,
    clip_norm: float | None = None,
    dist_info: Dist | None = None,
    autocast=None,
    scaler: torch.amp.GradScaler | None = None,
    total_tokens: int | None = None,
    loss_fn: LossFn = label_smoothed_cross_entropy,
) -> UpdateSums:
    """One optimizer update over ``micro_batches`` (gradient accumulation), without waiting for the device.

    Every micro-batch's summed loss is divided by the target tokens of the *whole* update (all
    micro-batches, all processes), so k accumulated micro-batches give the same gradient as one batch
    k times larger. DDP averages gradients over processes, so the loss is multiplied by the world size.
    ``total_tokens``: that count when the caller knows it (the trainer does: every process sees every
    batch); otherwise it is summed over processes here, one more synchronization when there are several.

    The host never waits for the device here: losses stay device tensors (read them with
    :meth:`UpdateSums.read`, as :func:`train_update` does), clipping keeps the norm on the device, and a fused
    optimizer takes the fp16 GradScaler's inf check without reading it back.
    """
    d = dist_info or Dist()
    device = model_device(model)
    if total_tokens is None:
        (total_tokens,) = d.sum([sum(b.ntokens for b in micro_batches)], device)
    scale = d.world / max(total_tokens, 1.0)
    sums = []  # per micro-batch (loss, nll), detached, on the device
    ctx = autocast or contextlib.nullcontext()
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with ctx:
                logits = batch_logits(model, batch)
            loss, nll = loss_fn(logits, batch.tgt_out, label_smoothing, pad_id)
            scaled = loss * scale
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        sums.append(torch.stack([loss.detach(), nll.detach()]))  # a copy: compiled outputs may be reused
    for group in optimizer.param_groups:
        group["lr"] = lr
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = None
    if clip_norm:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats = d.all_reduce_sum(torch.stack(sums).sum(0))  # (2,): loss, nll over the whole update
    if grad_norm is not None:  # the same on every process (after DDP's gradient all-reduce)
        stats = torch.cat([stats, grad_norm.detach().to(stats.dtype).reshape(1)])
    return UpdateSums(stats, int(total_tokens))


@torch.no_grad()
def evaluate_loss(
    model: nn.Module, batches: Sequence[Batch], label_smoothing: float, pad_id: int = 0,
    dist_info: Dist | None = None, autocast=None,
) -> dict[str, float]:
    """Validation loss, NLL per token and perplexity (exp of NLL per token), sharded over processes."""
    d = dist_info or Dist()
    device = model_device(model)
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device)  # loss, nll: read once at the end
    tokens = 0
    for batch in batches[d.rank :: d.world]:
        batch = batch_to_device(batch, device)
        with autocast or contextlib.nullcontext():
            logits = batch_logits(model, batch)
        sums += torch.stack(label_smoothed_cross_entropy(logits, batch.tgt_out, label_smoothing, pad_id))
        tokens += batch.ntokens
    model.train(was_training)
    loss, nll = d.all_reduce_sum(sums).tolist()
    (tokens,) = d.sum([tokens], device)
    per_tok = nll / max(tokens, 1)
    return {"valid_loss": loss / max(tokens, 1), "valid_nll": per_tok, "valid_ppl": math.exp(min(per_tok, 50))}


# With several processes, the time budget (train.max_minutes) is checked every this many updates (and at every
# logged one): the check is a broadcast from rank 0 that the host waits for.
CLOCK_EVERY = 10


def update_seed(seed: int, step: int, rank: int) -> int:
    """The seed of update ``step`` on process ``rank``: a hash of the three, so every process draws its own
    dropout masks and a resumed run draws what the uninterrupted one drew, with no RNG state carried over."""
    digest = hashlib.sha256(f"aiayn-update:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_update(seed: int, step: int, rank: int) -> None:
    """Seed torch's generators (CPU and every GPU) for update ``step`` on process ``rank``
    (:func:`update_seed`)."""
    torch.manual_seed(update_seed(seed, step, rank))


def update_token_totals(tokens: Sequence[int], accum_steps: int, world: int) -> list[int]:
    """Target tokens of each update of an epoch summed over all processes, from the target tokens of each
    planned batch. Batches are dealt round-robin (process r takes r, r + world, ...), so every process can
    count what the others hold instead of all-reducing the count before every update."""
    n_updates = len(tokens) // (accum_steps * world)
    k = accum_steps
    ranks = [tokens[r::world][: n_updates * k] for r in range(world)]
    return [sum(n for mine in ranks for n in mine[i * k : (i + 1) * k]) for i in range(n_updates)]


def compile_for_training(module: nn.Module, cfg: Config) -> tuple[nn.Module, LossFn]:
    """``torch.compile`` of the training module's layers and of the loss (:func:`aiayn.engine.compile_for_training`),
    with what the config says of the batch shapes: fixed with ``data.length_buckets`` (one shape per bucket, plus
    those of over-long examples and last LM batches) or language-model blocks, token-budget shapes otherwise."""
    from aiayn.data.summarization import is_summary_lm

    fixed = bool(cfg.data.length_buckets) if cfg.task != "lm" else not is_summary_lm(cfg)
    if not fixed and cfg.train.compile_mode == "reduce-overhead":
        log.warning("train.compile_mode=reduce-overhead records a CUDA graph per batch shape; set "
                    "data.length_buckets so that shapes repeat")
    n_shapes = len(cfg.data.length_buckets) + 4
    blocks = [m for m in module.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]
    return (engine.compile_for_training(module, blocks, fixed, n_shapes, cfg.train.compile_mode),
            compiled_loss(dynamic=not fixed))


# --- the loop --------------------------------------------------------------------------------------


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
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("step", "epoch", "position", "best_valid", "best_step",
                                              "bad_evals", "elapsed_s", "tokens")}

    @classmethod
    def from_json(cls, values: Any, step: int) -> TrainState:
        """The state a checkpoint of ``step`` saved, checked: exactly the keys of :meth:`to_json`, counts
        non-negative integers, ``step`` the checkpoint's. ValueError says what is wrong."""
        if not isinstance(values, dict):
            raise ValueError(f"train_state is {type(values).__name__}, expected an object")
        keys = cls().to_json()
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
        if values["step"] != step:
            raise ValueError(f"train_state.step is {values['step']}, the checkpoint's step is {step}")
        return cls(**values)



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
        """``dist_info``: the process and its device (:func:`init_distributed`); ``precision``: the resolved
        ``train.precision`` (fp32, bf16 or fp16; :func:`aiayn.device.resolve_precision`)."""
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
        self._planner: concurrent.futures.ThreadPoolExecutor | None = None
        self._planned: dict[int, concurrent.futures.Future] = {}

    @property
    def best_path(self) -> Path:
        return self.run_dir / "checkpoints" / "best.safetensors"

    # The module that runs forward/backward, and the loss: DDP and torch.compile wrap the plain ones.
    def _train_module(self) -> tuple[nn.Module, LossFn]:
        module, loss_fn = self.model, label_smoothed_cross_entropy
        if self.d.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            # No buffer broadcast before every forward (the only buffers are the constant sinusoid tables);
            # gradients live in DDP's buckets (no copy into them, less memory).
            ddp = nn.parallel.DistributedDataParallel
            quiet = ({"forward_sync_buffers": False}  # the name since PyTorch 2.13 (broadcast_buffers before)
                     if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
                     else {"broadcast_buffers": False})
            module = ddp(module, device_ids=ids, gradient_as_bucket_view=True, **quiet)
        if self.cfg.train.compile:
            module, loss_fn = compile_for_training(module, self.cfg)
        return module, loss_fn

    def resume(self) -> bool:
        """Restore the newest complete checkpoint; False when there is none."""
        steps = list_checkpoints(self.run_dir)
        if not steps:
            return False
        _, _, jpath = checkpoint_paths(self.run_dir, steps[-1])
        try:  # checked before the weights are loaded: a damaged state leaves the model as it was
            state = TrainState.from_json(read_checkpoint_state(self.run_dir, steps[-1]).get("train_state"), steps[-1])
        except ValueError as e:
            raise CheckpointError(f"{jpath}: not a valid checkpoint state ({e})") from None
        saved = read_checkpoint_state(self.run_dir, steps[-1]).get("world_size")
        if saved is not None and saved != self.d.world:
            raise CheckpointError(
                f"{jpath}: trained by {saved} process(es), resumed by {self.d.world}: each update would take other "
                f"batches; resume with {saved} process(es) in all (torchrun --nproc-per-node ...)")
        meta = load_checkpoint(self.run_dir, steps[-1], self.model, self.optimizer)
        self.state = state
        set_rng_state(meta["rng"])  # Python's and NumPy's; torch's is set again before every update
        return True

    def epoch_updates(self, epoch: int) -> list[list[Any]]:
        """This process's updates of an epoch, as planned batches (collated when trained on): the plan's batches
        dealt round-robin, grouped by accum_steps. Every process gets the same number of updates (a remainder
        is left for the next epoch's shuffle) and collates only its own."""
        ahead = self._planned.pop(epoch, None)
        plan, tokens = ahead.result() if ahead is not None else self._plan(epoch)
        k, w = self.cfg.train.accum_steps, self.d.world
        n_updates = len(plan) // (k * w)
        mine = plan[self.d.rank :: w][: n_updates * k]
        self._update_tokens = update_token_totals(tokens, k, w)
        return [mine[i * k : (i + 1) * k] for i in range(n_updates)]

    def _plan_ahead(self, epoch: int) -> None:
        """Plan ``epoch`` in the background while the current one trains, so that it starts without a pause.
        Called after the current epoch's first update: planning holds the interpreter for seconds on a large
        corpus (its seeded shuffle is Python's), and the first update would otherwise wait for it too."""
        if self._planner is not None and epoch not in self._planned:
            self._planned = {epoch: self._planner.submit(self._plan, epoch)}

    def _plan(self, epoch: int) -> tuple[Sequence[Any], list[int]]:
        """An epoch's plan and the target tokens of each planned batch."""
        plan = self.data.epoch_plan(epoch)
        return plan, [self.data.plan_tokens(p) for p in plan]

    def _collate_update(self, update: list[Any]) -> list[Batch]:
        """The batches of one planned update, in page-locked memory for a GPU (run by the prefetch thread)."""
        batches = [self.data.collate_plan(p) for p in update]
        return [b.pin_memory() for b in batches] if self.device.type == "cuda" else batches

    def _save(self, keep_last: int) -> None:
        if self.d.main:
            save_checkpoint(self.run_dir, self.state.step, self.model, self.optimizer,
                            {"train_state": self.state.to_json(), "world_size": self.d.world,
                             "cpu_threads": torch.get_num_threads()},
                            keep_last=keep_last)
        self.d.barrier()

    def _evaluate(self, metrics: MetricsLog) -> bool:
        """Validation; returns True when early stopping says stop."""
        tc = self.cfg.train
        result = evaluate_loss(self.model, self.data.valid_batches, tc.label_smoothing, self.pad_id,
                               self.d, self.autocast)
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
        return tc.patience is not None and st.bad_evals >= tc.patience

    def train(self) -> TrainState:
        """Train until max_updates / max_epochs / max_minutes / early stop; returns the final state. The loop
        runs inside the engine's kernel choice for the device (:func:`aiayn.engine.kernels`)."""
        with engine.kernels(self.device, self.precision), \
                concurrent.futures.ThreadPoolExecutor(1, "aiayn-plan") as planner:
            self._planner = planner
            try:
                return self._train()
            finally:
                self._planner = None
                for ahead in self._planned.values():
                    ahead.cancel()
                self._planned = {}

    def _train(self) -> TrainState:
        tc, st = self.cfg.train, self.state
        metrics = MetricsLog(self.run_dir, self.d.main, st.step if st.step else None, tc.log_to, self.cfg)
        module, loss_fn = self._train_module()
        module.train()
        progress = Progress(tc, st.step, st.elapsed_s, show=self.d.main, bar=self.progress)
        d_model = self.cfg.model.d_model
        window: dict[str, Any] = {"sums": None, "tokens": 0, "t0": time.perf_counter(), "updates": 0}
        start = time.perf_counter() - st.elapsed_s
        stop = st.step >= tc.max_updates
        last_saved = st.step
        while not stop and (tc.max_epochs is None or st.epoch < tc.max_epochs):
            updates = self.epoch_updates(st.epoch)
            if not updates:
                raise ConfigError("the training data gives no full update: lower data.max_tokens "
                                  "or train.accum_steps, or add data")
            with Prefetcher(updates, self._collate_update, start=st.position, depth=PREFETCH_UPDATES) as loader:
                while st.position < len(updates) and not stop:
                    micro = [batch_to_device(b, self.device) for b in loader.next()]
                    seed_update(tc.seed, st.step + 1, self.d.rank)
                    lr = learning_rate(tc, d_model, st.step + 1)
                    update = run_update(module, self.optimizer, micro, lr, tc.label_smoothing, self.pad_id,
                                        tc.clip_norm, self.d, self.autocast, self.scaler,
                                        self._update_tokens[st.position], loss_fn)
                    st.step += 1
                    st.position += 1
                    self._plan_ahead(st.epoch + 1)
                    st.tokens += update.ntokens
                    sums = update.sums[:2]
                    window["sums"] = sums if window["sums"] is None else window["sums"] + sums
                    window["tokens"] += update.ntokens
                    window["updates"] += 1
                    log_step = st.step % tc.log_every == 0 or st.step == tc.max_updates
                    if log_step:
                        loss, nll = window["sums"].tolist()  # the loop's one host-device synchronization
                        now = time.perf_counter()
                        st.elapsed_s = now - start
                        tokens = max(window["tokens"], 1)
                        rec = {"step": st.step, "epoch": st.epoch, "lr": lr,
                               "train_loss": round(loss / tokens, 5), "train_nll": round(nll / tokens, 5),
                               "tokens_per_s": round(window["tokens"] / max(now - window["t0"], 1e-9), 1),
                               "tokens_per_update": round(window["tokens"] / max(window["updates"], 1)),
                               "elapsed_s": round(st.elapsed_s, 2)}
                        metrics.write(rec)
                        progress.record(rec)
                        window = {"sums": None, "tokens": 0, "t0": time.perf_counter(), "updates": 0}
                    else:  # the host's clock: it may be ahead of the device by the updates queued
                        st.elapsed_s = time.perf_counter() - start
                    progress.update(st.step, st.elapsed_s)
                    # Rank 0's clock decides, for all processes: a collective (and a synchronization) with several
                    # processes, so then only every few updates; nothing at all with one.
                    clock = tc.max_minutes is not None and (self.d.world == 1 or log_step
                                                            or st.step % CLOCK_EVERY == 0)
                    out_of_time = clock and self.d.broadcast_flag(st.elapsed_s >= tc.max_minutes * 60, self.device)
                    stop = st.step >= tc.max_updates or out_of_time
                    if st.step % tc.eval_every == 0 or stop:
                        stop = self._evaluate(metrics) or stop
                    if st.step % tc.save_every == 0 or stop:
                        self._save(tc.keep_last)
                        last_saved = st.step
            if st.position >= len(updates):
                st.epoch, st.position = st.epoch + 1, 0
        if last_saved != st.step:  # max_epochs reached between saves
            self._evaluate(metrics)
            self._save(tc.keep_last)
        progress.close(st.step)
        metrics.close()
        if self.d.main:
            self.write_inference_weights()
        self.d.barrier()
        return st

    def write_inference_weights(self) -> Path:
        """model.safetensors: the last, best or averaged weights, as train.inference_weights says."""
        tc, out = self.cfg.train, self.run_dir / "model.safetensors"
        steps = list_checkpoints(self.run_dir)
        if tc.inference_weights == "average":
            paths = [checkpoint_paths(self.run_dir, s)[0] for s in steps[-tc.average_last :]]
            save_weights(average_weights(paths), out, {"source": f"average of steps {steps[-tc.average_last:]}"})
        elif tc.inference_weights == "best" and self.best_path.exists():
            save_weights(read_weights(self.best_path), out, {"source": f"best step {self.state.best_step}"})
        else:
            save_weights(self.model, out, {"source": f"last step {self.state.step}"})
        return out
