"""The speed choices, in one place: which computation of attention runs where, PyTorch's CUDA attention
backends, the CPU dropout, the fused optimizer, ``torch.compile``, CPU threads.

Every choice here computes what the plain path computes (tests/test_model.py and tests/test_engine.py prove
each equal to it); only the speed differs, and the measurements behind each are in BENCHMARKS.md with their
commands. The model receives the choices as explicit values (an attribute the engine sets on each attention
module, a dropout module swapped in for training); nothing here changes a process-wide PyTorch setting
outside a ``with kernels(device):`` block, so loading a run leaves the host program's torch settings alone.

Precision policy: fp32 means fp32 (TF32 matmuls stay as PyTorch leaves them, off); bf16 / fp16 are autocast on
CUDA only (:mod:`aiayn.device`): training defaults to bf16 where the GPU has it, inference to fp32 until bf16
decoding is measured to be as good.

Shapes: B batch, T length, D model width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from aiayn.device import resolve_device

# Attention, eq. (1): the explicit matmul-softmax-matmul (which can also return the probabilities) or PyTorch's
# fused kernel. Per device type, key lengths up to this many take the explicit path; longer ones (and other
# devices) the fused kernel. On CPU the explicit path is faster up to about 128 keys once the thread count is
# set, and the fused kernel wins clearly at 512 (`python -m benchmarks.cpu_kernels`, BENCHMARKS.md).
ATTENTION_RULE: dict[str, int] = {"cpu": 128}
ATTENTION_PATHS = {"explicit": {"cpu": 1 << 30, "cuda": 1 << 30, "mps": 1 << 30}, "fused": {}}


def _attention_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The modules that compute attention: those carrying the engine's attention choice."""
    return (m for m in model.modules() if hasattr(m, "explicit_max_keys"))


def use_attention(model: nn.Module, rule: dict[str, int] | str | None = None) -> nn.Module:
    """Set which computation of attention each attention module of ``model`` runs: ``rule`` maps a device type
    to the longest key length that takes the explicit path (None: :data:`ATTENTION_RULE`), or names a path
    for every length and device (``"explicit"``, ``"fused"``). Returns ``model``."""
    if isinstance(rule, str):
        if rule not in ATTENTION_PATHS:
            raise ValueError(f"unknown attention path {rule!r}; expected one of {', '.join(ATTENTION_PATHS)}")
        rule = ATTENTION_PATHS[rule]
    rule = dict(ATTENTION_RULE if rule is None else rule)
    for m in _attention_modules(model):
        m.explicit_max_keys = rule
    return model


@contextlib.contextmanager
def attention_path(model: nn.Module, path: str) -> Iterator[nn.Module]:
    """Inside the block, every attention module of ``model`` takes one path (``"explicit"``: matmul + softmax,
    which ``FlopCounterMode`` counts; ``"fused"``: PyTorch's kernel) whatever the key length; the previous
    choice comes back afterwards, also on an exception. For benchmarks and tests."""
    saved = [(m, m.explicit_max_keys) for m in _attention_modules(model)]
    use_attention(model, path)
    try:
        yield model
    finally:
        for m, rule in saved:
            m.explicit_max_keys = rule


def _sdpa_backends() -> list | None:
    """PyTorch's SDPA backends aiayn uses on CUDA: flash and memory-efficient attention, and the math kernel as
    the fallback for inputs the fused ones refuse; not cuDNN's (None on a PyTorch without the selector)."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # pragma: no cover - torch < 2.3
        return None
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def kernels(device: torch.device) -> Iterator[None]:
    """Run the block with aiayn's CUDA attention backends (a no-op off CUDA), restoring the previous ones after.

    cuDNN's attention backend is left out: it builds a new execution plan for every new (batch, length) shape,
    and token-budget batches have a new shape almost every update, so planning costs far more host time than
    the kernel saves (issue 20; BENCHMARKS.md, "GPU"). The choice holds only inside the block: training runs its
    loop in one, the translator and generator their searches, and a program that loads a run keeps its own
    settings everywhere else."""
    backends = _sdpa_backends() if device.type == "cuda" else None
    if backends is None:
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends):
        yield


class CpuDropout(nn.Dropout):
    """``nn.Dropout`` whose training-mode mask on CPU comes from uniform draws: ``bernoulli_`` (what
    ``F.dropout`` draws with) costs about twice as much there, and mask draws were the largest non-matmul cost
    of a small model's update (`python -m benchmarks.cpu_kernels`). Same distribution: each element is kept
    with probability 1 - p and scaled by 1 / (1 - p). Off the CPU, and in eval mode, it is ``nn.Dropout``."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu" or self.p >= 1.0 or self.inplace:
            return super().forward(x)
        return _UniformMaskDropout.apply(x, self.p)


class _UniformMaskDropout(torch.autograd.Function):
    """Inverted dropout with the mask ``rand_like(x) >= p``, saved once for the backward pass."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        scaled_mask = (torch.rand_like(x) >= p).to(x.dtype).mul_(1.0 / (1.0 - p))
        ctx.save_for_backward(scaled_mask)
        return x * scaled_mask

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (scaled_mask,) = ctx.saved_tensors
        return grad * scaled_mask, None


def _swap_dropouts(module: nn.Module) -> None:
    """Replace every ``nn.Dropout`` under ``module`` by a :class:`CpuDropout` of the same p (no parameters or
    buffers change, so state dicts and checkpoints are unaffected)."""
    for name, child in module.named_children():
        if type(child) is nn.Dropout:
            setattr(module, name, CpuDropout(child.p, child.inplace))
        else:
            _swap_dropouts(child)


def prepare_model(model: nn.Module, device: str | torch.device, training: bool) -> nn.Module:
    """Put ``model`` on ``device`` (``"auto"`` resolves as everywhere) with aiayn's speed choices: the
    attention rule (:data:`ATTENTION_RULE`), and for training on a CPU the faster dropout. Returns ``model``.
    Used by ``aiayn.run_dir.load_run`` (inference) and the trainer."""
    dev = resolve_device(device)
    model.to(dev)
    use_attention(model)
    if training and dev.type == "cpu":
        _swap_dropouts(model)
    return model


def use_fused_optimizer(params: list[Tensor]) -> bool:
    """Whether Adam takes its fused CUDA kernel (one kernel for every parameter, and no host-device sync under
    an fp16 GradScaler): there are parameters and all are floating-point CUDA tensors. Elsewhere PyTorch's
    default implementation, with which earlier checkpoints and the exact-resume tests were made."""
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)


def compile_for_training(module: nn.Module, loss_fn, fixed_shapes: bool, n_shapes: int, mode: str):
    """``torch.compile`` of the training module and of the loss function.

    Shapes decide how. With fixed batch shapes (``data.length_buckets``, or language-model blocks:
    ``fixed_shapes``) there are few shapes (``n_shapes``) and each repeats: one static graph per shape
    (``dynamic=False``: kernels specialized to the sizes, and the fixed shapes CUDA graphs need for
    ``reduce-overhead``); the recompile limit is raised to the number of shapes. Otherwise token-budget batches
    change the batch size with almost every update and the lengths with the data: one graph with symbolic batch
    size and lengths (``dynamic=True``; the model widths stay static) instead of a recompile per shape.
    ``mode`` is ``train.compile_mode``. The model has no graph break (tests/test_engine.py)."""
    if fixed_shapes:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, n_shapes)
    options = {"mode": None if mode == "default" else mode, "dynamic": not fixed_shapes}
    return torch.compile(module, **options), torch.compile(loss_fn, **options)


def set_cpu_threads(threads: int | None) -> int:
    """Set PyTorch's intra-op CPU threads to ``threads`` (None: leave PyTorch's choice); return the count in use."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


__all__ = [
    "ATTENTION_RULE", "CpuDropout", "attention_path", "compile_for_training", "kernels", "prepare_model",
    "set_cpu_threads", "use_attention", "use_fused_optimizer",
]
