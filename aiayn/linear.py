"""How the model's linear maps y = x W^T + b are computed: the engine's choice per device and precision.

A module with linear maps declares :class:`LinearKernel` and computes each map as ``self.linear(x, weight, bias)``;
:func:`use_linear` sets ``linear`` on every such module of a model. Kinds (:data:`LINEAR_KINDS`):

* ``plain``: ``F.linear`` (MKL on x86 CPUs, cuBLAS on CUDA). Training, and every device but the CPU.
* ``packed``: fp32 inference on a CPU with oneDNN: each weight is reordered once into oneDNN's blocked layout
  and multiplied by oneDNN's kernels (``torch.ops.mkldnn``), which pick their instructions by the CPU's features.
  MKL, which ``F.linear`` calls, runs its AVX2 code on AMD CPUs that have AVX-512; there oneDNN's products were
  faster (BENCHMARKS.md, "Linear layers on the CPU"). Same math in fp32, summed in another order (the last bits
  move, as between two CPUs); a row's result does not depend on the other rows of the batch.
* ``bf16``: bf16 inference on a CPU with native bf16 (:mod:`aiayn.cpu_probe`): each weight cast to bf16 once and
  reordered for oneDNN, whose kernels use the CPU's bf16 units (AMX tiles, AVX512-BF16 dot products); each input
  row is rounded to bf16 when it comes, the sums are fp32 inside the kernel, and the result comes back as fp32
  (rounded through bf16, as under autocast). Everything around the products (attention, softmax, layer norm, the
  search's scores) stays fp32. Every product takes this path at every row count, so a sentence's rows round the
  same way alone or in a batch (the kernel oneDNN picks for a row count may sum in another order: the last bits).
* ``int8``: ``--precision int8`` on a CPU: dynamic int8 quantization, as CTranslate2's int8. Weights are
  quantized once per output row (symmetric, scale = max |w| / 127); each input row is quantized when it comes
  (symmetric, its own scale), so a row's result never depends on the other rows of its batch, and the integer
  product is exact (``torch._int_mm``, int32 sums), so it does not depend on the CPU either. Activations,
  attention, softmax and layer norm stay fp32; the embeddings stay fp32 (a tied output projection is quantized,
  the lookup is not). The fp32 weights stay in memory (checkpoints, export, and the fallback below read them).
* ``int8_bf16``: ``--precision int8`` on a CPU where :mod:`aiayn.cpu_probe` found native bf16 and measured this
  kind faster than ``int8`` (CTranslate2's "int8_bfloat16"): the same int8 weights and per-row scales as ``int8``,
  but each input row is rounded to bf16 instead of quantized, and the sums are fp32. Up to
  :attr:`Int8Bf16Linear.SMALL_ROWS` rows (one sentence's beam) PyTorch's weight-only int8 kernel multiplies the
  int8 weights as they are (a quarter of fp32's bytes: a beam step reads its weights, not its rows, so this is what
  makes one sentence fast); more rows take oneDNN's bf16 product (AMX) on the int8 values held as bf16, which is
  exact (|q| <= 127 needs 7 bits). Both round the fp32 sums to bf16 (8 bits of mantissa, as ``bf16``'s products),
  then apply the scales and the bias in fp32, so a row's result alone and in a batch differs only where the two
  kernels' sums, added in another order, round to another bf16 value (the last bits, as between two CPUs).

Every kind falls back to ``F.linear`` where its kernel does not apply: when autograd records (training, or a
gradient through the model), and off the CPU or off fp32 (a bf16 model's plain bf16 product). Prepared weights
are built on first use and rebuilt when a weight changes in place (its version counter moves).
Shapes: x (..., K), weight (N, K), bias (N,).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.errors import DeviceError

LINEAR_KINDS = ("plain", "packed", "bf16", "int8", "int8_bf16")
# int32 sums of int8 x int8 products cannot overflow below this input width: 127 * 127 * K < 2 ** 31.
INT8_MAX_WIDTH = (2**31 - 1) // (127 * 127)


class LinearKernel:
    """What a module whose linear maps the engine chooses declares (``class PositionwiseFeedForward(LinearKernel,
    nn.Module)``): it computes y = x W^T + b as ``self.linear(x, weight, bias)``; :func:`use_linear` sets it
    (until then, ``F.linear``)."""

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.linear(x, weight, bias)  # looked up per call: whoever wraps F.linear (tests/rounding.py) is seen


def packed_available() -> bool:
    """Whether this PyTorch has oneDNN's prepacked CPU linear (x86 builds do)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")
                and hasattr(mkldnn, "_reorder_linear_weight"))


class _Prepared:
    """A weight's prepared forms, keyed by the weight view (storage address, shape, strides): built on first use,
    rebuilt when the weight changes in place. An entry holds the weight's storage, so its address is never reused
    by another tensor while the entry lives."""

    def __init__(self, prepare: Callable[[Tensor], object]) -> None:
        self._prepare = prepare
        self._forms: dict[tuple, tuple[object, int, object]] = {}

    def __call__(self, w: Tensor) -> object:
        key = (w.data_ptr(), tuple(w.shape), w.stride())
        version = 0 if w.is_inference() else w._version  # a tensor made under inference_mode has no counter
        hit = self._forms.get(key)
        if hit is None or hit[1] != version:
            with torch.no_grad():
                hit = self._forms[key] = (w.untyped_storage(), version, self._prepare(w.detach()))
        return hit[2]

    def __len__(self) -> int:
        return len(self._forms)


class _CpuKernel:
    """What the CPU kernels share: when they apply, and a fresh (empty) copy where a model is copied."""

    kind = "plain"

    def __init__(self) -> None:
        self.prepared = _Prepared(self.prepare)

    def prepare(self, w: Tensor) -> object:  # pragma: no cover - every kernel overrides it
        raise NotImplementedError

    def __deepcopy__(self, memo: dict) -> _CpuKernel:
        return type(self)()  # a copied model's weights are other tensors: prepare them anew

    @staticmethod
    def applies(x: Tensor, w: Tensor) -> bool:
        """CPU, fp32, and no autograd recording: else ``F.linear``."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to keep 5 significant bits (up to 8 as they are, then multiples of 8 up to 256, of 16 up
    to 512, ...): at most 1/16 more rows from 128 on, and a few dozen distinct counts where a search has hundreds.
    A beam of 4 decoding one sentence is 4 rows, not 8: there padding would double the product."""
    if rows <= 8:
        return rows
    step = 1 << max(3, rows.bit_length() - 5)
    return -(-rows // step) * step


def padded_rows(x2: Tensor) -> Tensor:
    """x2 (M, K) with zero rows appended up to :func:`row_bucket` (M) rows (itself when M is a bucket)."""
    rows = x2.size(0)
    padded = row_bucket(rows)
    return x2 if padded == rows else F.pad(x2, (0, 0, 0, padded - rows))


class PackedLinear(_CpuKernel):
    """fp32 on oneDNN with the weight in its blocked layout, reordered once per weight.

    oneDNN builds (JIT-compiles) and keeps a kernel per row count, each holding memory: a beam search, whose row
    count changes whenever a sentence ends, made hundreds of them, and its peak memory grew by hundreds of MiB
    (BENCHMARKS.md, "int8 on a CPU"). So the rows are padded with zeros up to :func:`row_bucket`: a row's result
    does not depend on the other rows, and the padding costs at most 1/16 more rows from 128 on, where a small
    batch reads the weights anyway. A product of at most :attr:`SMALL_PRODUCT` rows x weight elements (one row
    and a 768 x 256 weight, four rows and a 256 x 256 one) takes ``F.linear``: there oneDNN's call costs more than
    the product (``python -m benchmarks.linear_kernels``)."""

    SMALL_PRODUCT = 1 << 18

    kind = "packed"
    BATCH_HINT = 64  # the row count oneDNN lays the weight out for; any other count runs on it too

    def prepare(self, w: Tensor) -> Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self.BATCH_HINT)

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """x (..., K), w (N, K), b (N,) or None -> (..., N)."""
        if not self.applies(x, w) or x.numel() == 0:
            return F.linear(x, w, b)
        x2 = x.reshape(-1, x.size(-1))  # (M, K)
        rows = x2.size(0)
        if rows * w.numel() <= self.SMALL_PRODUCT:
            return F.linear(x, w, b)
        y = torch.ops.mkldnn._linear_pointwise(padded_rows(x2), self.prepared(w), b, "none", [], "")
        return y[:rows].view(*x.shape[:-1], w.size(0))


class Bf16Linear(PackedLinear):
    """bf16 products on oneDNN (the CPU's AMX or AVX512-BF16 units): the weight cast to bf16 and reordered once, the
    input rounded to bf16 per call, fp32 sums, the result back in fp32 plus the fp32 bias. Rows padded as
    :class:`PackedLinear`'s; no small-product exception (every row count rounds alike)."""

    kind = "bf16"

    def prepare(self, w: Tensor) -> Tensor:
        wb = w.to(torch.bfloat16).contiguous()
        return torch.ops.mkldnn._reorder_linear_weight(wb, self.BATCH_HINT) if packed_available() else wb

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """x (..., K), w (N, K), b (N,) or None -> (..., N), fp32."""
        if not self.applies(x, w) or x.numel() == 0:
            return F.linear(x, w, b)
        x2 = padded_rows(x.reshape(-1, x.size(-1)).to(torch.bfloat16))  # (row_bucket(M), K)
        rows = x.numel() // x.size(-1)
        wb = self.prepared(w)
        if packed_available():
            y = torch.ops.mkldnn._linear_pointwise(x2, wb, None, "none", [], "")
        else:  # pragma: no cover - a PyTorch without oneDNN
            y = F.linear(x2, wb)
        y = y[:rows].float()  # then the fp32 bias: faster than an fp32 + bf16 op, which casts inside
        if b is not None:
            y.add_(b)
        return y.view(*x.shape[:-1], w.size(0))


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: w (N, K) -> (q (N, K) int8, scale (N,) fp32) with w ~ q * scale[:, None].
    A row of zeros gets scale 1 (and q 0)."""
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.div(w, scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(_CpuKernel):
    """Dynamic int8: the weight quantized once per output row, each input row when it comes; int32 sums."""

    kind = "int8"

    def prepare(self, w: Tensor) -> tuple[Tensor, Tensor]:
        q, scale = quantize_rows(w.float())
        return q.t().contiguous(), scale  # (K, N): _int_mm's right operand

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """x (..., K), w (N, K), b (N,) or None -> (..., N)."""
        if not self.applies(x, w) or x.numel() == 0:
            return F.linear(x, w, b)
        wq, w_scale = self.prepared(w)
        x2 = x.reshape(-1, x.size(-1))  # (M, K)
        # Each row its own scale (a row of zeros: a tiny one, and q = 0); |x / scale| <= 127 by construction.
        x_scale = x2.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(127.0)  # (M, 1)
        xq = torch.div(x2, x_scale).round_().to(torch.int8)
        y = torch._int_mm(xq, wq).to(torch.float32).mul_(x_scale).mul_(w_scale)  # (M, N)
        if b is not None:
            y.add_(b)
        return y.view(*x.shape[:-1], w.size(0))


class Int8Bf16Linear(_CpuKernel):
    """int8 weights (per output row, as :class:`Int8Linear`'s), bf16 input rows, fp32 sums rounded to bf16, then the
    scales and the bias in fp32 (the module docstring's ``int8_bf16``)."""

    kind = "int8_bf16"
    SMALL_ROWS = 4  # up to here the weight-only kernel (measured: faster at 1-4 rows, slower from 6, 1024 x 256)

    def prepare(self, w: Tensor) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
        """(the int8 weight (N, K) for the weight-only kernel, or None; ones (N,) bf16, its scales; the int8 values
        as bf16, laid out for oneDNN; the scales (N,) fp32, applied after either kernel)."""
        q, scale = quantize_rows(w.float())
        # The weight-only kernel's vector code loads 16 input values at a time from aligned rows and has no tail: a
        # width that is not a multiple of 16 never takes it (it would read past the rows, or fault).
        small = q.contiguous() if w.size(1) % 16 == 0 else None
        ones = torch.ones(w.size(0), dtype=torch.bfloat16)
        qb = q.to(torch.bfloat16).contiguous()  # exact
        large = torch.ops.mkldnn._reorder_linear_weight(qb, PackedLinear.BATCH_HINT) if packed_available() else qb
        return small, ones, large, scale

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """x (..., K), w (N, K), b (N,) or None -> (..., N), fp32."""
        if not self.applies(x, w) or x.numel() == 0:
            return F.linear(x, w, b)
        small, ones, large, scale = self.prepared(w)
        x2 = x.reshape(-1, x.size(-1)).to(torch.bfloat16).contiguous()  # (M, K): a fresh (aligned) tensor
        rows = x2.size(0)
        # Both paths: the fp32 sums of exact products, rounded to bf16 (the weight-only kernel with unit scales,
        # oneDNN's bf16 product), so that they differ only where the two kernels' sums, added in another order,
        # round apart; then the scales and the bias in fp32. (A oneDNN post-op for the scales, which would round
        # once, was slower on the 8,000-row output projection at 256 rows.)
        if small is not None and rows <= self.SMALL_ROWS:
            y = torch._weight_int8pack_mm(x2, small, ones)  # (M, N) bf16
        elif packed_available():
            y = torch.ops.mkldnn._linear_pointwise(padded_rows(x2), large, None, "none", [], "")[:rows]
        else:  # pragma: no cover - a PyTorch without oneDNN
            y = F.linear(x2, large)
        y = y.float()  # then fp32 ops: faster than bf16 x fp32 ones, which cast inside, for the same values
        y = y.mul_(scale) if b is None else torch.addcmul(b, y, scale)
        return y.view(*x.shape[:-1], w.size(0))


def _plain(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, weight, bias)


KERNELS: dict[str, Callable[[], Callable[..., Tensor]]] = {
    "plain": lambda: _plain, "packed": PackedLinear, "bf16": Bf16Linear, "int8": Int8Linear,
    "int8_bf16": Int8Bf16Linear,
}


def linear_modules(model: nn.Module) -> Iterator[LinearKernel]:
    """The modules of ``model`` whose linear maps the engine chooses."""
    return (m for m in model.modules() if isinstance(m, LinearKernel))


def use_linear(model: nn.Module, kind: str) -> nn.Module:
    """Compute every linear map of ``model`` with ``kind`` (:data:`LINEAR_KINDS`); one kernel (and one store of
    prepared weights) for the whole model. Returns ``model``."""
    if kind not in KERNELS:
        raise ValueError(f"unknown linear kernel {kind!r}; expected one of {', '.join(LINEAR_KINDS)}")
    kernel = KERNELS[kind]()
    for m in linear_modules(model):
        m.linear = kernel
    return model


def linear_kind(model: nn.Module) -> str:
    """The kind of kernel ``model``'s linear maps run (``plain`` for a model without any)."""
    kernel = next((m.linear for m in linear_modules(model)), None)
    return getattr(kernel, "kind", "plain")


def check_int8(model: nn.Module) -> None:
    """Refuse, in one line, a model that int8 cannot compute as described: a linear layer so wide that its int32
    sums could overflow (input width over :data:`INT8_MAX_WIDTH`)."""
    widest = max((m.in_features for m in model.modules() if isinstance(m, nn.Linear)), default=0)
    if widest > INT8_MAX_WIDTH:
        raise DeviceError(f"precision int8: a linear layer {widest:,} inputs wide could overflow int8's int32 sums "
                          f"(at most {INT8_MAX_WIDTH:,}); use fp32")


__all__ = [
    "INT8_MAX_WIDTH", "KERNELS", "LINEAR_KINDS", "Bf16Linear", "Int8Bf16Linear", "Int8Linear", "LinearKernel",
    "PackedLinear", "check_int8", "linear_kind", "linear_modules", "packed_available",
    "quantize_rows", "row_bucket", "use_linear",
]
