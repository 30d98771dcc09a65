"""One optimizer update: the module that trains (DDP and ``torch.compile`` around the model), the batches on the
device, the dropout seeds, gradient accumulation normalized by target tokens, clipping and the optimizer step,
with the statistics left on the device until someone reads them.

Shapes: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import aiayn.engine as engine
from aiayn.config import Config
from aiayn.data.batching import Batch
from aiayn.device import model_device
from aiayn.model.layers import DecoderLayer, EncoderLayer
from aiayn.train.loss import compiled_loss, label_smoothed_cross_entropy
from aiayn.train.parallel import Dist

log = logging.getLogger("aiayn.train")

LossFn = Callable[[torch.Tensor, torch.Tensor, float, int], tuple[torch.Tensor, torch.Tensor]]


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


def update_seed(seed: int, step: int, slot: int) -> int:
    """The dropout seed of micro-batch ``slot`` of update ``step``: a hash of the three. A slot is the micro-batch's
    place among all of the update's micro-batches, ``accumulation step x processes + rank``, so every process and
    every accumulation step draws its own masks, a resumed run draws what the uninterrupted one drew (no RNG
    state is carried over), and 2 processes x 1 step draw what 1 process x 2 steps draws."""
    digest = hashlib.sha256(f"aiayn-update:{seed}:{step}:{slot}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_update(seed: int, step: int, slot: int) -> None:
    """Seed torch's generators (CPU and every GPU) for micro-batch ``slot`` of update ``step`` (:func:`update_seed`)."""
    torch.manual_seed(update_seed(seed, step, slot))


@dataclass
class UpdateStats:
    loss: float  # label-smoothed loss summed over target tokens
    nll: float  # negative log-likelihood summed over target tokens
    ntokens: int  # target tokens of the whole update (all micro-batches, all processes)
    grad_norm: float | None = None


@dataclass
class UpdateSums:
    """An update's statistics still on the device: ``sums`` (2,) loss and NLL summed over the update's target
    tokens on every process, then the gradient norm when clipped (3,); ``norms`` (2,) this process's gradient and
    weight norms when asked for (the processes' agreement check). :meth:`read` waits for the device."""

    sums: torch.Tensor
    ntokens: int
    norms: torch.Tensor | None = None

    def read(self) -> UpdateStats:
        values = self.sums.tolist()  # a host-device synchronization
        return UpdateStats(values[0], values[1], self.ntokens, values[2] if len(values) > 2 else None)


@dataclass
class Update:
    """How every update of a training runs: the module that runs forward/backward (the model, or DDP /
    compiled around it), its optimizer and loss, clipping, the distributed place, autocast and the fp16 scaler,
    and the seed of the dropout masks (None: torch's generators are left as they are)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    label_smoothing: float = 0.0
    pad_id: int = 0
    clip_norm: float | None = None
    dist: Dist = field(default_factory=Dist)
    autocast: Any = None
    scaler: torch.amp.GradScaler | None = None
    loss_fn: LossFn = label_smoothed_cross_entropy
    seed: int | None = None

    def __call__(self, micro_batches: Sequence[Batch], lr: float, step: int = 0,
                 total_tokens: int | None = None) -> UpdateStats:
        """:meth:`run`, then its statistics read (the host waits for the device once)."""
        return self.run(micro_batches, lr, step, total_tokens).read()

    def run(self, micro_batches: Sequence[Batch], lr: float, step: int = 0, total_tokens: int | None = None,
            measure_norms: bool = False) -> UpdateSums:
        """Update ``step`` over ``micro_batches`` (gradient accumulation), without waiting for the device.

        Every micro-batch's summed loss is divided by the target tokens of the *whole* update (all micro-batches,
        all processes), so k accumulated micro-batches give the same gradient as one batch k times larger. DDP
        averages gradients over processes, so the loss is multiplied by the world size. ``total_tokens``: that
        count when the caller knows it (the trainer does: every process sees every batch's size); otherwise it
        is summed over processes here, one more synchronization when there are several. ``measure_norms``: also
        this process's gradient and weight norms (:attr:`UpdateSums.norms`).

        The host never waits for the device here: losses stay device tensors, clipping keeps the norm on the
        device, and a fused optimizer takes the fp16 GradScaler's inf check without reading it back."""
        d, module, optimizer, scaler = self.dist, self.module, self.optimizer, self.scaler
        device = model_device(module)
        if total_tokens is None:
            (total_tokens,) = d.sum([sum(b.ntokens for b in micro_batches)], device)
        scale = d.world / max(total_tokens, 1.0)
        sums = []  # per micro-batch (loss, nll), detached, on the device
        ctx = self.autocast or contextlib.nullcontext()
        for j, batch in enumerate(micro_batches):
            if self.seed is not None:
                seed_update(self.seed, step, j * d.world + d.rank)
            last = j == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or not hasattr(module, "no_sync") else module.no_sync()
            with sync:
                with ctx:
                    logits = batch_logits(module, batch)
                loss, nll = self.loss_fn(logits, batch.tgt_out, self.label_smoothing, self.pad_id)
                scaled = loss * scale
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            sums.append(torch.stack([loss.detach(), nll.detach()]))  # a copy: compiled outputs may be reused
        for group in optimizer.param_groups:
            group["lr"] = lr
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = list(module.parameters()) if self.clip_norm or measure_norms else []  # not on every update
        grad_norm = None
        if self.clip_norm:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip_norm)
        elif measure_norms:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        norms = None
        if measure_norms:
            weight_norm = torch.nn.utils.get_total_norm([p.detach() for p in params])
            norms = torch.stack([grad_norm.detach().float(), weight_norm.float()])
        stats = d.all_reduce_sum(torch.stack(sums).sum(0))  # (2,): loss, nll over the whole update
        if self.clip_norm:  # the same on every process (after DDP's gradient all-reduce)
            stats = torch.cat([stats, grad_norm.detach().to(stats.dtype).reshape(1)])
        return UpdateSums(stats, int(total_tokens), norms)


def compile_for_training(module: nn.Module, cfg: Config) -> tuple[nn.Module, LossFn]:
    """``torch.compile`` of the training module's layers and of the loss (:func:`aiayn.engine.compile_regions`),
    with what the config says of the batch shapes: fixed with ``data.length_buckets`` (one shape per bucket, plus
    those of over-long examples and last LM batches) or language-model blocks, token-budget shapes otherwise."""
    from aiayn.data.summarization import is_summary_lm

    fixed = bool(cfg.data.length_buckets) if cfg.task != "lm" else not is_summary_lm(cfg)
    if not fixed and cfg.train.compile_mode == "reduce-overhead":
        log.warning("train.compile_mode=reduce-overhead records a CUDA graph per batch shape; set "
                    "data.length_buckets so that shapes repeat")
    n_shapes = len(cfg.data.length_buckets) + 4
    blocks = [m for m in module.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]
    return (engine.compile_regions(module, blocks, fixed, n_shapes, cfg.train.compile_mode),
            compiled_loss(dynamic=not fixed))


def training_module(model: nn.Module, cfg: Config, d: Dist) -> tuple[nn.Module, LossFn]:
    """The module that runs forward/backward and its loss: ``model`` in DDP with several processes, its layers
    compiled with ``train.compile``."""
    module, loss_fn = model, label_smoothed_cross_entropy
    if d.world > 1:
        ids = [d.device.index] if d.device.type == "cuda" else None
        # No buffer broadcast before every forward (the only buffers are the constant sinusoid tables); gradients
        # live in DDP's buckets (no copy into them, less memory).
        ddp = nn.parallel.DistributedDataParallel
        quiet = ({"forward_sync_buffers": False}  # the name since PyTorch 2.13 (broadcast_buffers before)
                 if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
                 else {"broadcast_buffers": False})
        module = ddp(module, device_ids=ids, gradient_as_bucket_view=True, **quiet)
    if cfg.train.compile:
        module, loss_fn = compile_for_training(module, cfg)
    return module, loss_fn
