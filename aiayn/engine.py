"""The speed choices, in one place: which computation of attention runs where, PyTorch's CUDA attention
backends, the CPU dropout, the fused optimizer, ``torch.compile``, CPU threads.

Every choice here computes what the plain path computes (tests/test_model.py and tests/test_engine.py prove
each equal to it); only the speed differs, and the measurements behind each are in BENCHMARKS.md with their
commands. The model receives the choices as explicit values (an attribute the engine sets on each attention
module, a dropout module swapped in for training); nothing here changes a process-wide PyTorch setting
outside a ``with kernels(device):`` block, so loading a run leaves the host program's torch settings alone.

Precision policy (:mod:`aiayn.device`): fp32 means IEEE fp32 on every device (TF32 matmuls stay as PyTorch
leaves them, off); ``tf32`` turns TF32 matmuls on for the ``kernels`` block only (CUDA); bf16 / fp16 are autocast
on CUDA only: training defaults to bf16 where the GPU has it, inference to fp32.

Shapes: B batch, T length, D model width.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from aiayn.config import LIMITS
from aiayn.device import resolve_device, resolve_precision
from aiayn.errors import ConfigError
from aiayn.linear import check_int8, inference_linear_kind, use_linear

# Attention, eq. (1): the explicit matmul-softmax-matmul (which can also return the probabilities) or PyTorch's
# fused kernel. Per device type, key lengths up to this many take the explicit path; longer ones (and other
# devices) the fused kernel. On CPU the explicit path is faster up to about 128 keys once the thread count is
# set, and the fused kernel wins clearly at 512 (`python -m benchmarks.cpu_kernels`, BENCHMARKS.md).
ATTENTION_RULE: dict[str, int] = {"cpu": 128}
ATTENTION_PATHS = {"explicit": {"cpu": 1 << 30, "cuda": 1 << 30, "mps": 1 << 30}, "fused": {}}


class AttentionKernel:
    """What a module that computes eq. (1) declares (``class MultiHeadAttention(AttentionKernel, nn.Module)``): the
    engine chooses its computation by setting ``explicit_max_keys``: per device type, key lengths up to it take
    the explicit path, longer ones PyTorch's fused kernel (empty: always fused)."""

    explicit_max_keys: dict[str, int]


def _attention_modules(model: nn.Module) -> Iterator[AttentionKernel]:
    """The modules of ``model`` whose computation of attention the engine chooses."""
    return (m for m in model.modules() if isinstance(m, AttentionKernel))


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
def kernels(device: torch.device, precision: str = "fp32") -> Iterator[None]:
    """Run the block with aiayn's CUDA attention backends (a no-op off CUDA), restoring the previous ones after;
    with ``precision="tf32"`` (CUDA) fp32 matmuls run on TF32 tensor cores inside the block.

    cuDNN's attention backend is left out: it builds a new execution plan for every new (batch, length) shape,
    and token-budget batches have a new shape almost every update, so planning costs far more host time than
    the kernel saves (BENCHMARKS.md, "GPU"). The choice holds only inside the block: training runs its
    loop in one, the translator and generator their searches, and a program that loads a run keeps its own
    settings everywhere else."""
    backends = _sdpa_backends() if device.type == "cuda" else None
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":  # fp32 is IEEE fp32 in the block whatever the host program set; tf32 is TF32
            stack.enter_context(_matmul_precision("high" if precision == "tf32" else "highest"))
        if backends is not None:
            from torch.nn.attention import sdpa_kernel

            stack.enter_context(sdpa_kernel(backends))
        yield


@contextlib.contextmanager
def _matmul_precision(level: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(level)`` inside the block ("high": TF32), the previous one after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(level)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


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


def prepare_model(model: nn.Module, device: str | torch.device, training: bool, precision: str = "fp32"
                  ) -> nn.Module:
    """Put ``model`` on ``device`` (``"auto"`` resolves as everywhere) with aiayn's speed choices: the
    attention rule (:data:`ATTENTION_RULE`); the linear layers' kernel (:mod:`aiayn.linear`: for inference on a
    CPU oneDNN in fp32, int8 at ``precision="int8"``; PyTorch's own in training and elsewhere); for training on a
    CPU the faster dropout. ``precision`` is a resolved one (:func:`aiayn.device.resolve_precision`). Returns
    ``model``. Used by ``aiayn.run_dir.load_run`` (inference) and the trainer."""
    dev = resolve_device(device)
    resolve_precision(precision, dev, training)  # int8 off the CPU or in training: one line, before the move
    if precision == "int8":
        check_int8(model)
    model.to(dev)
    use_attention(model)
    use_linear(model, "plain" if training else inference_linear_kind(dev, precision))
    if training and dev.type == "cpu":
        _swap_dropouts(model)
    return model


def use_fused_optimizer(params: list[Tensor]) -> bool:
    """Whether Adam takes its fused CUDA kernel (one kernel for every parameter, and no host-device sync under
    an fp16 GradScaler): there are parameters and all are floating-point CUDA tensors. Elsewhere PyTorch's
    default implementation, with which earlier checkpoints and the exact-resume tests were made."""
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)


def compile_regions(module: nn.Module, blocks: Sequence[nn.Module], fixed_shapes: bool, n_shapes: int,
                    mode: str) -> nn.Module:
    """``torch.compile`` for training, by regions: each of ``blocks`` (the model's encoder and decoder layers) is
    compiled in place, and the layers of a stack share one compiled graph, so compiling costs one layer's graph, not
    the whole model's (the cold start of both: ``python -m benchmarks.compile_time``, BENCHMARKS.md). The
    embeddings, the output projection and the loss (which compiles its chunks' math itself:
    :func:`aiayn.train.loss.compiled_loss`) stay around them. A block runs its compiled graph only in training mode:
    validation and decoding (eval mode, with caches) run the plain layer. Without ``blocks`` (a model of other
    layers) the whole ``module`` is compiled. Returns the module to train (``module`` itself when compiled by
    regions).

    Shapes decide how. With fixed batch shapes (``data.length_buckets``, or language-model blocks: ``fixed_shapes``)
    there are few shapes (``n_shapes``) and each repeats: one static graph per shape (``dynamic=False``: kernels
    specialized to the sizes, and the fixed shapes CUDA graphs need for ``reduce-overhead``); the recompile limit is
    raised to the number of shapes. Otherwise token-budget batches change the batch size with almost every update
    and the lengths with the data: one graph with symbolic batch size and lengths (``dynamic=True``; the model
    widths stay static) instead of a recompile per shape. ``mode`` is ``train.compile_mode``. The model has no graph
    break (tests/test_engine.py)."""
    if fixed_shapes:
        raise_recompile_limit(n_shapes)
    key_cpu_kernels_by_vector_width()
    options = {"mode": None if mode == "default" else mode, "dynamic": not fixed_shapes}
    if not blocks:
        return torch.compile(module, **options)
    for block in blocks:
        _compile_for_training_mode(block, options)
    return module


def _compile_for_training_mode(block: nn.Module, options: dict) -> None:
    """What ``nn.Module.compile`` does (``Module.__call__`` runs ``_compiled_call_impl`` when it is set), with the
    compiled graph taken only in training mode."""
    compiled = torch.compile(block._call_impl, **options)

    def call(*args, **kwargs):
        return compiled(*args, **kwargs) if block.training else block._call_impl(*args, **kwargs)

    block._compiled_call_impl = call


def key_cpu_kernels_by_vector_width() -> None:
    """Make the vector width of inductor's CPU kernels part of torch.compile's cache key; call before compiling.

    Inductor builds its CPU kernels for the vector instructions it picks by the CPU and ``ATEN_CPU_CAPABILITY``
    (AVX-512, AVX2 or none), but its on-disk FX graph cache (PyTorch 2.13, ``TORCHINDUCTOR_CACHE_DIR``, by default
    shared by every process of the user) does not key its entries on that pick. A process under another capability,
    or another CPU sharing the directory, was served the graph built for the first: on an AVX-512 Xeon, a loss
    compiled under the default pick and replayed under ``ATEN_CPU_CAPABILITY=avx2`` gave NaN or heap corruption,
    and under ``=default`` the replayed vector code failed to build (``'at::vec' has not been declared``). The
    inductor config is part of the key, so the width inductor would pick anyway is written into it
    (``cpp.simdlen``; 0 where it vectorizes nothing). A width the user set is kept. tests/test_engine.py
    replays one cache under three capabilities."""
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if inductor_config.cpp.simdlen is None:
        inductor_config.cpp.simdlen = pick_vec_isa().bit_width()


def raise_recompile_limit(n: int) -> None:
    """Let torch.compile keep at least ``n`` graphs of one function (``recompile_limit`` since PyTorch 2.7,
    ``cache_size_limit`` before)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), n))


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[float, float] | None:
    """(busy, all) CPU seconds since boot of the cores this process may run on, from /proc/stat's per-core lines
    (Linux); None elsewhere."""
    try:
        mine = os.sched_getaffinity(0)
        with open("/proc/stat", encoding="ascii") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
    except (AttributeError, OSError):
        return None
    busy = total = 0
    for name, *values in lines:
        if int(name[3:]) in mine:
            fields = [int(x) for x in values[:8]]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
            busy, total = busy + sum(fields) - idle, total + sum(fields)
    hz = os.sysconf("SC_CLK_TCK")
    return (busy / hz, total / hz) if total else None


def busy_cores(interval_s: float = 0.3) -> float:
    """How many of this process's cores other processes keep busy now: their busy CPU time over ``interval_s``
    minus this process's own; the 1-minute load average where /proc/stat is missing. Sampled now rather than
    averaged over the last minute, which would count the run that just ended (or this process's own tokenizer
    training) as other work."""
    first, own0 = _cpu_times(), os.times()
    if first is None:
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):  # pragma: no cover - no load average (Windows)
            return 0.0
    time.sleep(interval_s)
    second, own1 = _cpu_times(), os.times()
    if second is None or second[1] <= first[1]:
        return 0.0
    own = (own1.user + own1.system) - (own0.user + own0.system)
    cores = (second[1] - first[1]) / interval_s  # the cores' CPU seconds per second
    return cores * max(0.0, (second[0] - first[0]) - own) / (second[1] - first[1])


def cpu_threads(requested: int | None = None) -> int:
    """The intra-op thread count for this process: ``requested``; else ``OMP_NUM_THREADS`` when the environment
    sets it (torchrun, a job scheduler); else the cores not busy with other work right now (:func:`busy_cores`),
    at least 1.

    PyTorch's threads spin while they wait for work, so on a shared machine more threads than free cores make a
    run several times slower, not faster; on a quiet machine every core helps, for the 0.8M-parameter character
    LM as for the 7.6M Multi30k recipe, so the choice depends on the free cores, not on the model's size
    (``python -m benchmarks.threads``: BENCHMARKS.md, 1 against 2 threads, quiet and loaded)."""
    if requested is not None:
        return check_threads(requested, "--threads")
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return check_threads(int(env), "$OMP_NUM_THREADS")
    cores = usable_cores()
    return max(1, min(cores, round(cores - busy_cores())))


MAX_THREADS = int(LIMITS["train.threads"])  # one ceiling for every command's --threads, train.threads included


def check_threads(threads: int, where: str = "--threads") -> int:
    """``threads`` when it is a usable thread count (1 to :data:`MAX_THREADS`), else a one-line ConfigError naming
    ``where`` (each thread is an OS thread: 10,000 of them would start 10,000 threads, not run faster)."""
    if not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"{where} {threads}: expected 1 to {MAX_THREADS:,} CPU threads")
    return threads


def set_cpu_threads(threads: int | None) -> int:
    """Set PyTorch's intra-op CPU threads to ``threads`` (None: leave PyTorch's choice); return the count in use."""
    if threads is not None:
        torch.set_num_threads(check_threads(threads, "threads"))
    return torch.get_num_threads()


__all__ = [
    "ATTENTION_RULE", "AttentionKernel", "CpuDropout", "MAX_THREADS", "attention_path", "busy_cores", "check_threads",
    "compile_regions", "cpu_threads", "key_cpu_kernels_by_vector_width", "kernels", "prepare_model",
    "set_cpu_threads", "usable_cores", "use_attention", "use_fused_optimizer",
]
