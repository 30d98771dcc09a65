"""Label-smoothed cross entropy (section 5.4, eps_ls = 0.1) that ignores padding.

Shapes: N target positions (flattened B*T), V vocabulary, C rows of one chunk, D model width.

The loss is one autograd function that goes over the logits in row chunks: per chunk one fp32
``log_softmax`` gives both the NLL and the smoothing term in the forward pass, and the backward pass
writes the gradient ``softmax - (1 - eps) one_hot(y) - eps / V`` directly, recomputing the softmax.
So no fp32 (N, V) log-probabilities are kept between forward and backward (the plain formula,
``log_softmax(logits.float())`` then gather and mean, keeps one such tensor and builds two more in
its backward: 3.7 GB each for 25,000 tokens and a 37,000-word vocabulary), and there is no
data-dependent shape (``masked_select``), which would make the host wait for the device.

:func:`projected_cross_entropy` goes one step further (``train.fused_output_loss``): it takes the decoder's states
and the output projection and computes each chunk's logits itself, with the loss and the chunk's gradients in the
same pass, so the batch's (N, V) logits exist in no dtype at all, only one (C, V) chunk at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

import aiayn.engine as engine

# Elements of the fp32 temporaries per chunk: 2^26 floats = 256 MiB, about 1,800 rows of a
# 37,000-word vocabulary (a 25,000-token batch in ~14 chunks). On a CPU a chunk's fp32 temporary stays below
# glibc's largest mmap threshold (engine.HEAP_BLOCK_MAX, 32 MiB): a bigger block is mapped afresh and every page of it
# faults at each use (the quick recipe's ~4,000-token batches in one chunk: ~100,000 page faults an update in bf16,
# BENCHMARKS.md "Training's heap"; below it, with engine.keep_freed_memory, the heap's blocks are reused).
CHUNK_ELEMENTS = 1 << 26
CPU_CHUNK_ELEMENTS = (engine.HEAP_BLOCK_MAX - (1 << 20)) // 4


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, epsilon: float, ignore_index: int = 0
) -> tuple[Tensor, Tensor]:
    """Summed loss and summed NLL over non-padding targets.

    logits (..., V) of any float dtype (computed in fp32), target (...) long. The smoothed target
    distribution is q = (1 - eps) * one_hot(y) + eps / V  (Szegedy et al. 2016, uniform over all V
    classes, the convention of ``torch.nn.CrossEntropyLoss(label_smoothing=eps)``; fairseq spreads eps
    over the V - 1 other classes instead, a difference of eps/V on the true class), so per position
    loss = (1 - eps) * nll + eps * (-mean_v log p_v).
    Returns (loss_sum, nll_sum) as fp32 scalars, nll_sum detached: divide by the number of target
    tokens of the whole update.
    """
    return _apply(EAGER, logits, target, epsilon, ignore_index)


class ChunkKernels(NamedTuple):
    """The per-chunk math of the loss: ``forward(logits (C, V), index (C, 1), keep (C,), eps) -> (loss, nll)``,
    ``backward(logits (C, V), index (C, 1), coef (C, 1), eps) -> grad (C, V)`` in the logits' dtype, and both at
    once, ``forward_backward(logits, index, keep, eps) -> (loss, nll, grad)`` (the gradient of the chunk's loss)."""

    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., Tensor]
    forward_backward: Callable[..., tuple[Tensor, Tensor, Tensor]]


def _forward_chunk(logits: Tensor, index: Tensor, keep: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    # dtype=: the kernel reads bf16 / fp16 logits and computes in fp32, no separate cast
    lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # (C, V)
    nll = torch.where(keep, -lprobs.gather(1, index).squeeze(1), 0.0)  # (C,)
    if not epsilon:
        return nll.sum(), nll.sum()
    smooth = torch.where(keep, -lprobs.mean(dim=-1), 0.0)  # CE with the uniform distribution
    return (1.0 - epsilon) * nll.sum() + epsilon * smooth.sum(), nll.sum()


def _backward_chunk(logits: Tensor, index: Tensor, coef: Tensor, epsilon: float) -> Tensor:
    p = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (C, V)
    p = p.scatter_add(1, index, torch.full_like(coef, -(1.0 - epsilon)))  # p - (1 - eps) one_hot(y)
    return torch.addcmul(coef * (-epsilon / logits.size(-1)), p, coef).to(logits.dtype)  # c * (p - eps / V)


def _forward_backward_chunk(logits: Tensor, index: Tensor, keep: Tensor, epsilon: float
                            ) -> tuple[Tensor, Tensor, Tensor]:
    lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # (C, V)
    nll = torch.where(keep, -lprobs.gather(1, index).squeeze(1), 0.0)  # (C,)
    smooth = torch.where(keep, -lprobs.mean(dim=-1), 0.0)
    loss = (1.0 - epsilon) * nll.sum() + epsilon * smooth.sum() if epsilon else nll.sum()
    # d loss / d logits = keep * (softmax - (1 - eps) one_hot(y) - eps / V), from the log-probabilities in place
    target_mass = torch.full(index.shape, -(1.0 - epsilon), dtype=torch.float32, device=logits.device)
    p = lprobs.exp_().scatter_add_(1, index, target_mass)
    grad = p.sub_(epsilon / logits.size(-1)).mul_(keep.unsqueeze(1))
    return loss, nll.sum(), grad.to(logits.dtype)


EAGER = ChunkKernels(_forward_chunk, _backward_chunk, _forward_backward_chunk)


def compiled_loss(dynamic: bool, device: torch.device | None = None
                  ) -> Callable[[Tensor, Tensor, float, int], tuple[Tensor, Tensor]]:
    """:func:`label_smoothed_cross_entropy` with each chunk's math compiled by ``torch.compile`` (``dynamic``:
    one graph for every chunk length) and the loop over chunks left to Python, so a compiled training keeps
    the loss's memory bound: at most ``CHUNK_ELEMENTS`` fp32 temporaries at once, not the whole (N, V)
    softmax (1.85 GB for 12,500 tokens x 37,000 words). ``device``: where the logits will be (None: a CPU)."""
    kernels = compiled_kernels(dynamic, device)

    def loss(logits: Tensor, target: Tensor, epsilon: float, ignore_index: int = 0) -> tuple[Tensor, Tensor]:
        return _apply(kernels, logits, target, epsilon, ignore_index)

    return loss


def compiled_kernels(dynamic: bool, device: torch.device | None = None) -> ChunkKernels:
    """The chunks' math under ``torch.compile`` for ``device`` (None: a CPU); ``dynamic``: one graph for every chunk
    length (the engine's shape policy, :func:`aiayn.engine.compile_dynamic`), else one per length."""
    engine.key_cpu_kernels_by_vector_width(device)
    if dynamic:
        return ChunkKernels(*(engine.compile_dynamic(f) for f in EAGER))
    return ChunkKernels(*(torch.compile(f, backend=engine.COMPILE_BACKEND, dynamic=False) for f in EAGER))


def _apply(kernels: ChunkKernels, logits: Tensor, target: Tensor, epsilon: float,
           ignore_index: int) -> tuple[Tensor, Tensor]:
    V = logits.size(-1)
    return _SmoothedCrossEntropy.apply(logits.reshape(-1, V), target.reshape(-1), float(epsilon), ignore_index,
                                       kernels)


class _SmoothedCrossEntropy(torch.autograd.Function):
    """(N, V) logits, (N,) targets -> (loss_sum, nll_sum); gradient for the logits only."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, epsilon: float, ignore_index: int,
                kernels: ChunkKernels) -> tuple[Tensor, Tensor]:
        keep = target != ignore_index  # (N,)
        index = target.clamp_min(0).unsqueeze(1)  # (N, 1): ignored positions gather a valid, unused entry
        loss_sum = logits.new_zeros((), dtype=torch.float32)
        nll_sum = logits.new_zeros((), dtype=torch.float32)
        for rows in _chunks(*logits.shape, logits.device):
            loss, nll = kernels.forward(logits[rows], index[rows], keep[rows], epsilon)
            loss_sum, nll_sum = loss_sum + loss, nll_sum + nll
        ctx.save_for_backward(logits, index, keep)
        ctx.epsilon, ctx.kernels = epsilon, kernels
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None, None, None]:
        logits, index, keep = ctx.saved_tensors
        coef = (keep.to(torch.float32) * grad_loss.float()).unsqueeze(1)  # (N, 1): d loss_sum / d loss_i
        chunks = _chunks(*logits.shape, logits.device)
        if len(chunks) == 1:
            return ctx.kernels.backward(logits, index, coef, ctx.epsilon), None, None, None, None
        grad = torch.empty_like(logits)
        for rows in chunks:
            grad[rows] = ctx.kernels.backward(logits[rows], index[rows], coef[rows], ctx.epsilon)
        return grad, None, None, None, None


def _chunks(N: int, V: int, device: torch.device) -> list[slice]:
    """Row slices of N rows, each of at most CHUNK_ELEMENTS elements (on a CPU no more than CPU_CHUNK_ELEMENTS) of a
    V-wide row (at least one row) and of balanced sizes (two at most, one row apart), so that no chunk but of a
    one-row batch has one row (a compiled chunk would specialize on it: the engine's shape policy); one slice when
    the whole loss is traced by torch.compile (a Python loop over a symbolic row count would specialize on it): the
    trainer compiles the chunks' math instead (:func:`compiled_loss`), which keeps the bound."""
    if torch.compiler.is_compiling():
        return [slice(None)]
    most = min(CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS) if device.type == "cpu" else CHUNK_ELEMENTS
    step = max(1, most // max(V, 1))
    n = max(1, -(-N // step))
    size, bigger = divmod(N, n)  # the first `bigger` chunks have one row more
    bounds = [i * size + min(i, bigger) for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


# --- the output projection and the loss in one pass over chunks ----------------------------------------------


def projected_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, epsilon: float,
                            ignore_index: int = 0, kernels: ChunkKernels | None = None) -> tuple[Tensor, Tensor]:
    """:func:`label_smoothed_cross_entropy` of the logits ``hidden @ weight.T + bias`` without the (N, V) logits.

    hidden (..., D) decoder states, weight (V, D) the output projection (the tied embedding), bias (V,) or None,
    target (...) long. Chunk by chunk (:data:`CHUNK_ELEMENTS`), the forward pass computes the chunk's logits, its
    loss and the loss's gradient with respect to them (one softmax), and turns that at once into the gradients of
    the chunk's states and of the projection; the backward pass only scales them by the incoming gradient (a
    scalar: the loss is a sum). The matmuls are the plain path's (one forward, two backward per chunk). Under
    autocast the chunks run in its dtype, as the plain projection would. Returns (loss_sum, nll_sum) in fp32;
    ``kernels``: the chunks' math (:func:`compiled_kernels` when training compiles; eager by default)."""
    dtype = hidden.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    D = hidden.size(-1)
    with torch.autocast(hidden.device.type, enabled=False):
        return _ProjectedCrossEntropy.apply(hidden.reshape(-1, D).to(dtype), weight.to(dtype),
                                            None if bias is None else bias.to(dtype), target.reshape(-1),
                                            float(epsilon), ignore_index, kernels or EAGER)


class _ProjectedCrossEntropy(torch.autograd.Function):
    """(N, D) states, (V, D) weight, (V,) bias or None, (N,) targets -> (loss_sum, nll_sum); gradients for the
    states, the weight and the bias, computed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, epsilon: float,
                ignore_index: int, kernels: ChunkKernels) -> tuple[Tensor, Tensor]:
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        keep = target != ignore_index  # (N,)
        index = target.clamp_min(0).unsqueeze(1)  # (N, 1)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(weight.size(0), dtype=torch.float32, device=weight.device) if want_b else None
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        nll_sum = hidden.new_zeros((), dtype=torch.float32)
        for rows in _chunks(hidden.size(0), weight.size(0), hidden.device):
            h = hidden[rows]  # (C, D)
            logits = F.linear(h, weight, bias)  # (C, V)
            if want_h or want_w or want_b:
                loss, nll, grad = kernels.forward_backward(logits, index[rows], keep[rows], epsilon)  # grad (C, V)
                if want_h:
                    torch.mm(grad, weight, out=grad_h[rows])  # (C, D)
                if want_w:  # fp32 sums of the chunks' (V, D) products, whatever the compute dtype
                    _accumulate(grad_w, grad.t(), h)
                if want_b:
                    grad_b += grad.sum(0, dtype=torch.float32)
            else:  # no gradient wanted (validation): the loss alone
                loss, nll = kernels.forward(logits, index[rows], keep[rows], epsilon)
            loss_sum, nll_sum = loss_sum + loss, nll_sum + nll
        ctx.save_for_backward(*(g for g in (grad_h, grad_w, grad_b) if g is not None))
        ctx.wanted = (want_h, want_w, want_b)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if wanted else None for wanted in ctx.wanted]
        h, w, b = (None if g is None else g * grad_loss.float() for g in grads)  # h stays in its dtype
        dtype_h, dtype_w = ctx.dtypes
        return (None if h is None else h.to(dtype_h), None if w is None else w.to(dtype_w),
                None if b is None else b.to(dtype_w), None, None, None, None)


def _accumulate(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, with acc fp32 and a, b in the compute dtype (the product rounded to it, then summed in fp32)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


__all__ = ["CHUNK_ELEMENTS", "compiled_kernels", "compiled_loss", "label_smoothed_cross_entropy",
           "projected_cross_entropy"]
