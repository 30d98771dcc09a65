"""Another CPU's rounding, simulated: ``AIAYN_TEST_ROUNDING=SEED[:SCALE]`` perturbs the result of every matrix
product, softmax, layer norm and attention in the test processes by up to ``SCALE`` of itself (1e-6 by default,
a dozen float32 ulps), so a test that holds only by this machine's last bits fails here, on any machine.

What a CPU with other kernels (AVX-512's wider vectors, MKL's other paths) does to these ops, and what the
perturbation keeps of it:
- Deterministic: the same op on the same inputs gives the same result, so exact contracts (a resume, a rerun,
  two equal computations) still hold. The perturbation is a hash of the result's bits, the op and its shape.
- Shape-dependent where kernels are: another CPU may take another matrix-product kernel for another shape (a
  batch of one vs of eight, one new position vs all of them), so two results that are equal here may differ there;
  the product's shape is in the hash. Softmax and layer norm reduce each row alone, by the same code whatever the
  number of rows, so only the row's length is.
- Larger than a real ISA change (1e-6 relative on every op, compounded through the layers), so passing under it
  says more than passing on one more CPU; each seed stands for another machine.

Installed by tests/conftest.py when the variable is set, and in every Python process the tests start (through
tests/rounding_site/sitecustomize.py on PYTHONPATH, once the process imports torch): the CLI's subprocesses round
as the test's own process does. Native code outside PyTorch's Python functions (CTranslate2) keeps its own
rounding, as it would anyway; so does a graph torch.compile builds.
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

ENV = "AIAYN_TEST_ROUNDING"
_inside = threading.local()  # F.softmax calls Tensor.softmax: only the outermost wrapped call perturbs


def settings() -> tuple[int, float] | None:
    """``(seed, scale)`` from :data:`ENV`, or ``None`` when it is unset or empty."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    seed, _, scale = raw.partition(":")
    return int(seed), float(scale or 1e-6)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each element of ``h`` (int32). The products wrap around, as 32-bit integer
    multiplication does in every kernel PyTorch has; int32 rather than int64 halves the memory the hash moves,
    and it runs on the output of every wrapped op."""
    h = (h ^ ((h >> 16) & 0xFFFF)) * 0x045D9F3B  # the mask: a logical shift (>> keeps an int32's sign)
    h = (h ^ ((h >> 16) & 0xFFFF)) * 0x045D9F3B
    return h ^ ((h >> 16) & 0xFFFF)


def perturb(t: torch.Tensor, key: int, scale: float) -> torch.Tensor:
    """``t`` with each finite element ``x`` moved to ``x * (1 + scale * u)``, ``u`` in [-1, 1) a hash of ``x``'s
    bits and ``key`` (below 2**31); zeros, infinities and NaNs unchanged. Differentiable (``u`` is a constant)."""
    if not t.is_floating_point() or t.numel() == 0:
        return t
    u = _mix(t.detach().float().view(torch.int32) ^ key).float() * 2.0**-31
    return torch.where(torch.isfinite(t), t + t * (scale * u).to(t.dtype), t)


_ROW_WISE = ("softmax", "log_softmax", "layer_norm")


def _wrap(name: str, fn: Callable, seed: int, scale: float) -> Callable:
    if getattr(fn, "_aiayn_rounding", False):
        return fn

    row_wise = name in _ROW_WISE

    @functools.wraps(fn)
    def rounded(*args: Any, **kwargs: Any) -> Any:
        # A compiled graph is another CPU's code of its own (inductor's kernels): left as it is, and the wrapper
        # adds no graph break to it.
        if torch.compiler.is_compiling() or getattr(_inside, "depth", 0):
            return fn(*args, **kwargs)
        _inside.depth = 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _inside.depth = 0
        outs = out if isinstance(out, tuple) else (out,)
        rounded_outs = []
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                shape = tuple(o.shape[-1:] if row_wise else o.shape)
                key = zlib.crc32(f"{seed}|{name}|{i}|{shape}".encode()) & 0x7FFFFFFF
                o = perturb(o, key, scale)
            rounded_outs.append(o)
        return tuple(rounded_outs) if isinstance(out, tuple) else rounded_outs[0]

    rounded._aiayn_rounding = True  # type: ignore[attr-defined]
    return rounded


# (owner, attribute): the ops whose results depend on a CPU's kernels (sums in an order of the kernel's choosing,
# vectorized exp and log). Elementwise additions and the like round the same on every CPU.
_OPS: list[tuple[Any, str]] = [
    (F, "linear"), (F, "softmax"), (F, "log_softmax"), (F, "layer_norm"), (F, "scaled_dot_product_attention"),
    (torch, "matmul"), (torch, "bmm"), (torch, "baddbmm"), (torch, "softmax"), (torch, "log_softmax"),
    (torch.Tensor, "matmul"), (torch.Tensor, "__matmul__"), (torch.Tensor, "softmax"), (torch.Tensor, "log_softmax"),
    # oneDNN's prepacked linear (aiayn.linear, CPU fp32 inference); int8's integer products are exact everywhere
    (torch.ops.mkldnn, "_linear_pointwise"),
]


def install() -> bool:
    """Wrap the ops of :data:`_OPS` when :data:`ENV` asks for it (idempotent); whether it did."""
    got = settings()
    if got is None:
        return False
    seed, scale = got
    for owner, attr in _OPS:
        # keyed by the op, not by how it is called: F.softmax, torch.softmax and Tensor.softmax run one kernel
        setattr(owner, attr, _wrap(attr.strip("_"), getattr(owner, attr), seed, scale))
    return True
