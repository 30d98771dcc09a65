"""One optimizer update: the module that trains (DDP and ``torch.compile`` around the model), the batches on the
device, the dropout seeds, gradient accumulation normalized by target tokens, clipping and the optimizer step,
with the statistics left on the device until someone reads them; and the training's speed levers
(:class:`Levers`: compile, the weights cast once, the output projection fused into the loss, fused residual +
layer norm), each of which computes what the plain update computes (exactly so in fp32: tests/test_train_speed.py).

Shapes: B batch, T target length, V vocabulary, D model width.
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
from aiayn.device import DTYPES, model_device
from aiayn.model.layers import DecoderLayer, EncoderLayer, SublayerConnection
from aiayn.train.loss import (
    EAGER,
    ChunkKernels,
    compiled_kernels,
    compiled_loss,
    label_smoothed_cross_entropy,
    projected_cross_entropy,
)
from aiayn.train.parallel import Dist

log = logging.getLogger("aiayn.train")

LossFn = Callable[[torch.Tensor, torch.Tensor, float, int], tuple[torch.Tensor, torch.Tensor]]


def batch_logits(model: nn.Module, batch: Batch, project: bool = True) -> torch.Tensor:
    """Teacher-forced logits (B, T, V) for a translation batch (src given) or an LM batch (src None); with
    ``project=False`` (aiayn's models only) the decoder's last states (B, T, D)."""
    kwargs = {} if project else {"project": False}
    if batch.src is None:
        return model(batch.tgt_in, **kwargs)
    return model(batch.src, batch.tgt_in, **kwargs)


def fit_batch(batch: Batch, pad_id: int) -> Batch:
    """``batch`` in the compiled shape policy's shapes (:func:`aiayn.engine.fit_shape`: at least 2 rows, lengths a
    multiple of 8), padded with ``pad_id``; the loss and gradients are those of ``batch``."""
    fit = engine.fit_shape
    src = None if batch.src is None else fit(batch.src, pad_id)
    return Batch(src, fit(batch.tgt_in, pad_id), fit(batch.tgt_out, pad_id), batch.ntokens, batch.indices)


def output_projection(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output projection (weight (V, D), bias or None) of aiayn's model inside ``module`` (DDP or not)."""
    model = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    return model.decoder.output_projection()


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


@dataclass(kw_only=True)
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
    # The speed levers (set by training_module from Levers): the output projection and the loss in one pass over
    # chunks (the chunks' math: kernels for projected_cross_entropy); the forward in this dtype with the weights cast
    # once per micro-batch instead of autocast; batches padded to the compiled shape policy.
    output_loss: ChunkKernels | None = None
    compute_dtype: torch.dtype | None = None
    fit_shapes: bool = False

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
        for j, batch in enumerate(micro_batches):
            if self.seed is not None:
                seed_update(self.seed, step, j * d.world + d.rank)
            last = j == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or not hasattr(module, "no_sync") else module.no_sync()
            with sync:
                loss, nll = self.forward_loss(batch)
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

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed (loss, NLL) of one micro-batch, through the levers this update has: the forward under autocast,
        or in :attr:`compute_dtype` with the weights cast once; the loss on the logits, or projected chunk by chunk
        from the decoder's states (:func:`aiayn.train.loss.projected_cross_entropy`)."""
        module, eps, pad = self.module, self.label_smoothing, self.pad_id
        if self.fit_shapes:
            batch = fit_batch(batch, pad)
        project = self.output_loss is None
        dtype = self.compute_dtype
        with engine.weights_in(module, dtype) if dtype is not None else self.autocast or contextlib.nullcontext():
            out = batch_logits(module, batch, project)
            if not project:  # the projection read inside the block: the cast weights with weights_in
                return projected_cross_entropy(out, *output_projection(module), batch.tgt_out, eps, pad,
                                               self.output_loss)
        return self.loss_fn(out, batch.tgt_out, eps, pad)


@dataclass(frozen=True)
class Levers:
    """The training's speed choices (``train.*`` keys), resolved for its device and precision. Each computes what the
    plain update computes: exactly in fp32 (tests/test_train_speed.py), within the rounding of the compute dtype in
    bf16 / fp16; each is a row of ``benchmarks.train_throughput`` (``--impls aiayn+LEVER``) for a GPU to measure."""

    compile: bool = False  # train.compile (auto resolved: aiayn.engine.compile_wanted)
    compile_mode: str = "default"
    cast_dtype: torch.dtype | None = None  # train.cast_weights_once under bf16 / fp16
    fused_output_loss: bool = False  # train.fused_output_loss
    fuse_norms: bool = False  # train.fuse_norms (implied by compile, whose layers fuse them)
    attention_backends: tuple[str, ...] = ()  # train.attention_backends (on CUDA; empty: aiayn's choice)

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device, precision: str) -> Levers:
        tc = cfg.train
        low = precision in ("bf16", "fp16")
        # auto: casting once where a CPU trains in bf16 (BENCHMARKS.md "1b": 1.3x and 1.7x there), the fused output
        # loss on every CPU (also in fp32: no (tokens x vocabulary) logits over the heap's largest block, BENCHMARKS.md
        # "Training's heap"); GPUs: not measured yet
        cast = device.type == "cpu" and precision == "bf16" if tc.cast_weights_once == "auto" else \
            bool(tc.cast_weights_once)
        fused = device.type == "cpu" if tc.fused_output_loss == "auto" else bool(tc.fused_output_loss)
        return cls(compile=engine.compile_wanted(tc.compile, device, tc.max_updates, tc.max_minutes),
                   compile_mode=tc.compile_mode,
                   cast_dtype=DTYPES[precision] if cast and low else None,
                   fused_output_loss=fused, fuse_norms=tc.fuse_norms,
                   attention_backends=tuple(tc.attention_backends))

    def describe(self) -> str:
        """One line for the training log."""
        on = [f"compile ({self.compile_mode})" if self.compile else "",
              f"weights cast once to {str(self.cast_dtype).removeprefix('torch.')}" if self.cast_dtype else "",
              "output projection fused into the loss" if self.fused_output_loss else "",
              "fused residual + layer norm" if self.fuse_norms and not self.compile else "",
              f"attention backends {', '.join(self.attention_backends)}" if self.attention_backends else ""]
        return ", ".join(x for x in on if x) or "none (eager)"


def fixed_shapes(cfg: Config) -> bool:
    """Whether the batches have fixed shapes (``data.length_buckets``, language-model blocks): compiled with a static
    graph per shape; token-budget batches take the dynamic shape policy."""
    from aiayn.data.pipeline import corpus_of

    return corpus_of(cfg).fixed_shapes(cfg)


def compile_for_training(module: nn.Module, cfg: Config) -> tuple[nn.Module, LossFn]:
    """``torch.compile`` of the training module's layers and of the loss (:func:`aiayn.engine.compile_regions`),
    with what the config says of the batch shapes: fixed with ``data.length_buckets`` (one shape per bucket, plus
    those of over-long examples and last LM batches) or language-model blocks, token-budget shapes otherwise."""
    fixed = fixed_shapes(cfg)
    if not fixed and cfg.train.compile_mode == "reduce-overhead":
        log.warning("train.compile_mode=reduce-overhead records a CUDA graph per batch shape; set "
                    "data.length_buckets so that shapes repeat")
    n_shapes = len(cfg.data.length_buckets) + 4
    blocks = [m for m in module.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]
    return (engine.compile_regions(module, blocks, fixed, n_shapes, cfg.train.compile_mode),
            compiled_loss(dynamic=not fixed, device=model_device(module)))


def fuse_residual_norms(module: nn.Module) -> None:
    """``train.fuse_norms``: each residual connection's ``LayerNorm(x + Dropout(out))`` (section 5.4's wrapper)
    compiled, in training mode, into one kernel per direction instead of three passes over the activations; the
    attention and matmuls around it stay eager. One graph for every such connection (dynamic shapes)."""
    engine.key_cpu_kernels_by_vector_width(model_device(module))
    for m in module.modules():
        if isinstance(m, SublayerConnection):
            engine.compile_for_training_mode(m, "residual", engine.compile_dynamic(m.residual))


def training_module(model: nn.Module, cfg: Config, d: Dist, levers: Levers | None = None
                    ) -> tuple[nn.Module, dict[str, Any]]:
    """The module that runs forward/backward and the :class:`Update` fields of its levers (``loss_fn``,
    ``output_loss``, ``compute_dtype``, ``fit_shapes``): ``model`` in DDP with several processes, its layers compiled
    with ``train.compile``, its residual connections with ``train.fuse_norms``."""
    levers = levers or Levers.from_config(cfg, d.device, "fp32")
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
    fields: dict[str, Any] = {"compute_dtype": levers.cast_dtype}
    if levers.compile:
        module, loss_fn = compile_for_training(module, cfg)
    elif levers.fuse_norms:
        fuse_residual_norms(model)
    # compiled graphs see batches in the shape policy's shapes (fixed shapes already repeat)
    fields["fit_shapes"] = (levers.compile or levers.fuse_norms) and not fixed_shapes(cfg)
    if levers.fused_output_loss:
        fields["output_loss"] = compiled_kernels(not fixed_shapes(cfg), d.device) if levers.compile else EAGER
    return module, {"loss_fn": loss_fn, **fields}
