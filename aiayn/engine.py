"""The speed choices, in one place: which computation of attention runs where, which kernel computes the linear
layers (:func:`inference_linear_kind`; the kernels themselves are :mod:`aiayn.linear`'s, which never calls back),
PyTorch's CUDA attention backends, the CPU dropout, the fused optimizer, ``torch.compile``, CPU threads, the
processes that share the cores (:func:`worker_pool`) and what the C allocator keeps.

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
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import LIMITS, SDPA_BACKENDS
from aiayn.device import int8_kind, model_device, resolve_device, resolve_precision
from aiayn.errors import ConfigError
from aiayn.linear import check_int8, packed_available, use_linear

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


# aiayn's choice of PyTorch's SDPA backends on CUDA (by the names of train.attention_backends, SDPA_BACKENDS): flash
# and memory-efficient attention, with the math kernel as the fallback for inputs the fused ones refuse (not cuDNN's:
# ``kernels`` says why).
DEFAULT_SDPA_BACKENDS = ("flash", "efficient", "math")


def _sdpa_backends(names: Sequence[str] = DEFAULT_SDPA_BACKENDS) -> list | None:
    """PyTorch's SDPA backends named ``names`` (:data:`SDPA_BACKENDS`), in that order of preference; None on a
    PyTorch without the selector."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # pragma: no cover - torch < 2.3
        return None
    by_name = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return [by_name[n] for n in names]


def attention_backends(model: nn.Module, run: Callable[[], object]) -> dict[str, str]:
    """Which computation of eq. (1) each kind of attention of ``model`` takes while ``run()`` runs it (eagerly):
    {"encoder self-attention" | "decoder self-attention" | "cross-attention" (by the modules' names): "flash",
    "efficient", "cudnn" or "math" (PyTorch's SDPA backend, as its dispatcher picks it for the call's inputs,
    padding mask, dropout and the backends enabled around the call, e.g. by :func:`kernels`), "flash (CPU)"
    on a CPU, or "explicit" (aiayn's matmul + softmax)}. Layers of one kind that took different ones are joined
    with "+"."""
    from torch.overrides import TorchFunctionMode

    seen: dict[str, set[str]] = {}
    current: list[str | None] = [None, None]  # the kind running now, and the backend its call took

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and current[0] is not None:
                current[1] = _sdpa_choice(*args, **kwargs)
            return func(*args, **kwargs)

    def begin(kind: str) -> Callable:
        return lambda module, args: current.__setitem__(slice(None), [kind, None])

    def end(module: nn.Module, args: object, out: object) -> None:
        seen.setdefault(current[0], set()).add(current[1] or "explicit")
        current[:] = [None, None]

    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, AttentionKernel):
            kind = ("cross-attention" if name.endswith("cross_attn") else "encoder self-attention"
                    if "encoder" in name else "decoder self-attention")
            hooks += [m.register_forward_pre_hook(begin(kind)), m.register_forward_hook(end)]
    try:
        with Spy():
            run()
    finally:
        for h in hooks:
            h.remove()
    return {kind: "+".join(sorted(names)) for kind, names in seen.items()}


def _sdpa_choice(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> str:
    """The backend ``F.scaled_dot_product_attention`` takes for these arguments (PyTorch's own choice function)."""
    choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    name = names.get(int(choice), "none")
    return f"{name} (CPU)" if name == "flash" and q.device.type == "cpu" else name


@contextlib.contextmanager
def kernels(device: torch.device, precision: str = "fp32",
            attention_backends: Sequence[str] | None = None) -> Iterator[None]:
    """Run the block with aiayn's CUDA attention backends (a no-op off CUDA), restoring the previous ones after;
    with ``precision="tf32"`` (CUDA) fp32 matmuls run on TF32 tensor cores inside the block. ``attention_backends``
    (``train.attention_backends``; names of :data:`SDPA_BACKENDS`, in order of preference) replaces aiayn's choice,
    :data:`DEFAULT_SDPA_BACKENDS`.

    cuDNN's attention backend is left out: it builds a new execution plan for every new (batch, length) shape,
    and token-budget batches have a new shape almost every update, so planning costs far more host time than
    the kernel saves (BENCHMARKS.md, "GPU"). The choice holds only inside the block: training runs its
    loop in one, the translator and generator their searches, and a program that loads a run keeps its own
    settings everywhere else."""
    backends = _sdpa_backends(attention_backends or DEFAULT_SDPA_BACKENDS) if device.type == "cuda" else None
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


def inference_linear_kind(device: torch.device, precision: str) -> str:
    """The linear layers' kernel for inference (:mod:`aiayn.linear` computes it; the choice is made here, with the
    others): int8 where asked (a CPU: :func:`aiayn.device.resolve_precision` refused it elsewhere; dynamic or with
    bf16 rows, :func:`aiayn.device.int8_kind`), bf16 products on a CPU at bf16 (the probe passed), oneDNN for fp32
    on a CPU where PyTorch has it, else PyTorch's own."""
    if precision == "int8":
        return int8_kind()[0]
    if device.type == "cpu" and precision == "bf16":
        return "bf16"
    if device.type == "cpu" and precision == "fp32" and packed_available():
        return "packed"
    return "plain"


def prepare_model(model: nn.Module, device: str | torch.device, training: bool, precision: str = "fp32"
                  ) -> nn.Module:
    """Put ``model`` on ``device`` (``"auto"`` resolves as everywhere) with aiayn's speed choices: the
    attention rule (:data:`ATTENTION_RULE`); the linear layers' kernel (:mod:`aiayn.linear`: for inference on a
    CPU oneDNN in fp32, int8 at ``precision="int8"``; PyTorch's own in training and elsewhere); for training on a
    CPU the faster dropout. ``precision`` is a resolved one (:func:`aiayn.device.resolve_precision`). Returns
    ``model``. Used by ``aiayn.run.directory.load_run`` (inference) and the trainer."""
    dev = resolve_device(device)
    resolve_precision(precision, dev, training)  # int8 off the CPU or in training: one line, before the move
    linear = "plain" if training else inference_linear_kind(dev, precision)  # every choice made here, then applied
    if precision == "int8":
        check_int8(model)
    model.to(dev)
    use_attention(model)
    use_linear(model, linear)
    if training and dev.type == "cpu":
        _swap_dropouts(model)
    return model


@contextlib.contextmanager
def weights_in(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Inside the block, every floating-point parameter and buffer of ``module`` reads as its copy in ``dtype``, cast
    once on entry (a tensor shared by several modules, the tied embedding, once); the originals are back after, also
    on an exception. Gradients flow through the casts into the originals: a forward in bf16 with fp32 master
    weights, without autocast's casts at every use (``train.cast_weights_once``). Not thread-safe: the module's
    parameter tables are swapped in place."""
    casts: dict[int, Tensor] = {}
    saved = []
    for m in module.modules():  # each module once, however many names it has
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None and t.is_floating_point() and t.dtype != dtype:
                    saved.append((table, name, t))
                    table[name] = casts.setdefault(id(t), t.to(dtype))
    try:
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def use_fused_optimizer(params: list[Tensor]) -> bool:
    """Whether Adam takes its fused CUDA kernel (one kernel for every parameter, and no host-device sync under
    an fp16 GradScaler): there are parameters and all are floating-point CUDA tensors. Elsewhere PyTorch's
    default implementation, with which earlier checkpoints and the exact-resume tests were made."""
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)


# Compiled training's shape policy (token-budget batches): every batch dimension that changes from update to update
# (rows, source and target lengths) is symbolic in the one graph each region compiles on its first update, and no
# size that torch.compile specializes ever reaches it, so no update after the first compiles again
# (tests/test_engine.py trains 200 updates of varied shapes and counts the graphs). Two things would specialize:
# a size of 1 (dynamo makes 0 and 1 constants: a one-sentence batch, a target of BOS alone) and equal sizes within
# one batch (duck shaping gives S == T one symbol, and a later batch with S != T compiles anew). So the update pads
# a batch to at least MIN_ROWS rows (all-padding rows change nothing: the model zeroes their attention, the loss
# ignores them) and its lengths to a multiple of SHAPE_MULTIPLE (tensor-core tiles; also never 1), and the compiled
# calls run without duck shaping.
SHAPE_MULTIPLE = 8
MIN_ROWS = 2
# torch.compile's backend for training (tests may swap in "aot_eager": the same tracing and autograd, no C++ build).
COMPILE_BACKEND = "inductor"
# train.compile: auto compiles on CUDA from this many updates and, with a time budget, this many minutes: about where
# paper-base's measured cold compile pays back at its measured speed-up over eager (BENCHMARKS.md, "GPU training
# speed"); shorter runs (the quick recipes, tests) start at once in eager mode.
COMPILE_AUTO_MIN_UPDATES = 5000
COMPILE_AUTO_MIN_MINUTES = 10.0
# Graphs of compiled regions one process may hold with the dynamic shape policy (compile_regions).
REGION_GRAPHS = 16


def compile_wanted(setting: bool | str, device: torch.device, max_updates: int,
                   max_minutes: float | None = None) -> bool:
    """Whether training compiles: ``train.compile`` true or false as set; ``"auto"``: on CUDA, for runs of at least
    :data:`COMPILE_AUTO_MIN_UPDATES` updates and no time budget under :data:`COMPILE_AUTO_MIN_MINUTES` (never on a
    CPU, where inductor's C++ build takes minutes)."""
    if setting != "auto":
        return bool(setting)
    long_enough = max_minutes is None or max_minutes >= COMPILE_AUTO_MIN_MINUTES
    return device.type == "cuda" and max_updates >= COMPILE_AUTO_MIN_UPDATES and long_enough


def fit_shape(ids: Tensor, pad_id: int) -> Tensor:
    """(B, L) token ids padded with ``pad_id`` to at least :data:`MIN_ROWS` rows and a multiple of
    :data:`SHAPE_MULTIPLE` columns (the compiled shape policy); ``ids`` itself when it fits already."""
    rows, cols = max(0, MIN_ROWS - ids.size(0)), -ids.size(1) % SHAPE_MULTIPLE
    return F.pad(ids, (0, cols, 0, rows), value=pad_id) if rows or cols else ids


def compile_dynamic(fn: Callable, mode: str | None = None) -> Callable:
    """``torch.compile(fn, dynamic=True)`` whose calls trace without duck shaping (the shape policy above)."""
    compiled = torch.compile(fn, backend=COMPILE_BACKEND, mode=mode, dynamic=True)
    from torch.fx.experimental import _config as fx_config

    def call(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call


def _compile(fn: Callable, mode: str | None, dynamic: bool) -> Callable:
    return compile_dynamic(fn, mode) if dynamic else torch.compile(fn, backend=COMPILE_BACKEND, mode=mode,
                                                                   dynamic=False)


def compile_regions(module: nn.Module, blocks: Sequence[nn.Module], fixed_shapes: bool, n_shapes: int,
                    mode: str) -> nn.Module:
    """``torch.compile`` for training, by regions: each of ``blocks`` (the model's encoder and decoder layers) is
    compiled in place, and the layers of a stack share one compiled graph, so compiling costs one layer's graph, not
    the whole model's (the cold start of both: ``python -m benchmarks.compile_time``, BENCHMARKS.md). The
    embeddings, the output projection and the loss (which compiles its chunks' math itself:
    :func:`aiayn.train.loss.compiled_loss`) stay around them. A block runs its compiled graph only in training mode:
    validation and decoding (eval mode, with caches) run the plain layer. Without ``blocks`` (a model of other
    layers) the whole ``module`` is compiled, in place and for training mode too. Returns ``module``.

    Shapes decide how. With fixed batch shapes (``data.length_buckets``, or language-model blocks: ``fixed_shapes``)
    there are few shapes (``n_shapes``) and each repeats: one static graph per shape (``dynamic=False``: kernels
    specialized to the sizes, and the fixed shapes CUDA graphs need for ``reduce-overhead``); the recompile limit is
    raised to the number of shapes. Otherwise token-budget batches change the batch size with almost every update
    and the lengths with the data: one graph with symbolic batch size and lengths (the shape policy above; the model
    widths stay static) instead of a recompile per shape. ``mode`` is ``train.compile_mode``. The compiled blocks take
    PyTorch's fused attention for every key length (:func:`use_attention`). The model has no graph break
    (tests/test_engine.py)."""
    # Every compiled region of the process is a frame of one function, nn.Module._call_impl, whose graphs count
    # against one recompile limit: an encoder and a decoder layer per model (a benchmark compiles several models in
    # one process), or one per shape; past the limit dynamo would silently run the regions eagerly.
    raise_recompile_limit(n_shapes if fixed_shapes else REGION_GRAPHS)
    key_cpu_kernels_by_vector_width(model_device(module))
    mode_or_none = None if mode == "default" else mode
    for block in blocks or [module]:
        # One computation of eq. (1) for every key length: the CPU rule's branch on it (explicit up to 128 keys)
        # would compile a second graph for the first batch past it. Inductor fuses either, and eval mode runs it too.
        use_attention(block, "fused")
        compile_for_training_mode(block, "_call_impl", _compile(block._call_impl, mode_or_none, not fixed_shapes))
    return module


def compile_for_training_mode(module: nn.Module, name: str, compiled: Callable) -> None:
    """Make ``module.<name>`` run ``compiled`` in training mode and the plain method otherwise. For ``_call_impl`` this
    is what ``nn.Module.compile`` does (``Module.__call__`` runs ``_compiled_call_impl`` when it is set); another
    method (``residual``) is shadowed by an instance attribute."""
    plain = getattr(module, name)

    def call(*args, **kwargs):
        return compiled(*args, **kwargs) if module.training else plain(*args, **kwargs)

    setattr(module, "_compiled_call_impl" if name == "_call_impl" else name, call)


class CompileCounter:
    """The graphs torch.compile (dynamo) has built in this process since the counter was made, and since
    :meth:`warmed_up` was called: a graph built after warm-up is a recompile (an update that stalls for seconds on a
    GPU; ``TORCH_LOGS=recompiles`` says why)."""

    def __init__(self) -> None:
        self.start, self.warm = _graphs_built(), None

    def warmed_up(self) -> None:
        """Warm-up ends here: later graphs count as recompiles."""
        self.warm = _graphs_built()

    @property
    def graphs(self) -> int:
        return _graphs_built() - self.start

    @property
    def recompiles(self) -> int:
        return 0 if self.warm is None else _graphs_built() - self.warm


def _graphs_built() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def key_cpu_kernels_by_vector_width(device: torch.device | None = None) -> None:
    """Make the vector width of inductor's CPU kernels part of torch.compile's cache key; call before compiling for
    ``device`` (None: a CPU). Nothing for another device: no CPU kernel is compiled there, and the pick builds a
    test program per instruction set with the C++ compiler: seconds in a fresh process.

    Inductor builds its CPU kernels for the vector instructions it picks by the CPU and ``ATEN_CPU_CAPABILITY``
    (AVX-512, AVX2 or none), but its on-disk FX graph cache (PyTorch 2.13, ``TORCHINDUCTOR_CACHE_DIR``, by default
    shared by every process of the user) does not key its entries on that pick. A process under another capability,
    or another CPU sharing the directory, was served the graph built for the first: on an AVX-512 Xeon, a loss
    compiled under the default pick and replayed under ``ATEN_CPU_CAPABILITY=avx2`` gave NaN or heap corruption,
    and under ``=default`` the replayed vector code failed to build (``'at::vec' has not been declared``). The
    inductor config is part of the key, so the width inductor would pick anyway is written into it
    (``cpp.simdlen``; 0 where it vectorizes nothing). A width the user set is kept. tests/test_engine.py
    replays one cache under three capabilities."""
    if device is not None and device.type != "cpu":
        return
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


_WORKER: list[Callable[[Any], Any]] = []  # a worker process's encoder (worker_pool)


def _init_worker(make: Callable[..., Callable[[Any], Any]], args: tuple[Any, ...]) -> None:
    _WORKER[:] = [make(*args)]


def _work(item: Any) -> Any:
    return _WORKER[0](item)


@contextlib.contextmanager
def worker_pool(workers: int | None, big: bool, make: Callable[..., Callable[[Any], Any]], args: tuple[Any, ...]
                ) -> Iterator[Callable[[Iterable[Any]], Iterator[Any]]]:
    """items -> ``make(*args)(item)`` of each, in order: in ``workers`` processes (None: every usable core for a
    ``big`` input, else one; spawned: never fork a process that holds torch's threads), or in this one."""
    if workers is None:
        workers = usable_cores() if big else 1
    if workers <= 1:
        yield partial(map, make(*args))
        return
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(make, args)) as pool:
        yield partial(pool.imap, _work)


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
    """Set this thread's PyTorch intra-op CPU threads to ``threads`` (None: leave PyTorch's choice); return the count
    in use. The count is asked for first: a thread's first question (or first parallel operation) sets its count to
    the one last set by any thread, so a count set before it was undone when another thread set its own in between
    (two serve workers setting 2 and 1 threads both ended with 1)."""
    torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_threads(threads, "threads"))
    return torch.get_num_threads()


# glibc's mallopt parameters (malloc.h) and the values keep_freed_memory sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCK_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
KEPT_FREE = 256 << 20  # freed memory the heap may keep at its top instead of handing it back
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """Let the C allocator keep freed blocks of up to 32 MiB for the next ones, instead of handing them back to the
    OS and taking fresh (zeroed, page-faulting) pages for the next block. A search on the CPU frees and allocates
    the same few-MiB tensors (a step's logits, its log-probabilities, the int8 products) every step; with glibc's
    defaults each came back as new, page-faulting pages. A training's update does the same with its activations and
    the loss's chunks (train/loss.py keeps those below the mmap threshold on a CPU): ~100,000 page faults an update
    of the quick recipe in bf16 without both (BENCHMARKS.md, "Training's heap"). Process-wide, so the ``aiayn`` CLI
    calls it at start, never the library on loading a run; a program that embeds aiayn may call it.
    Nothing is changed where the environment already tunes the allocator (``MALLOC_*``, ``GLIBC_TUNABLES``, a
    preloaded jemalloc or tcmalloc) or where the C library is not glibc. Returns whether it was set."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or any(os.environ.get(k) for k in _MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's; another C library may lack it
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Both: setting one turns off glibc's own adjustment of the other (which is what kept handing pages back).
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, KEPT_FREE))


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``): what training a tokenizer and
    encoding a corpus freed would otherwise stay resident for hours of training (``benchmarks.rss_timeline``)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


__all__ = [
    "ATTENTION_RULE", "AttentionKernel", "CompileCounter", "CpuDropout", "MAX_THREADS", "SDPA_BACKENDS",
    "attention_backends", "attention_path", "busy_cores", "check_threads", "compile_dynamic",
    "compile_for_training_mode", "compile_regions", "compile_wanted", "cpu_threads", "fit_shape", "keep_freed_memory",
    "kernels", "key_cpu_kernels_by_vector_width", "prepare_model", "release_free_memory", "set_cpu_threads",
    "usable_cores", "use_attention", "use_fused_optimizer", "weights_in", "worker_pool",
]
