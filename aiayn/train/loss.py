"""Label-smoothed cross entropy (section 5.4, eps_ls = 0.1) that ignores padding.

Shapes: N target positions (flattened B*T), V vocabulary, C rows of one chunk.

The loss is one autograd function that goes over the logits in row chunks: per chunk one fp32
``log_softmax`` gives both the NLL and the smoothing term in the forward pass, and the backward pass
writes the gradient ``softmax - (1 - eps) one_hot(y) - eps / V`` directly, recomputing the softmax.
So no fp32 (N, V) log-probabilities are kept between forward and backward (the plain formula,
``log_softmax(logits.float())`` then gather and mean, keeps one such tensor and builds two more in
its backward: 3.7 GB each for 25,000 tokens and a 37,000-word vocabulary), and there is no
data-dependent shape (``masked_select``), which would make the host wait for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from aiayn.engine import key_cpu_kernels_by_vector_width

# Elements of the fp32 temporaries per chunk: 2^26 floats = 256 MiB, about 1,800 rows of a
# 37,000-word vocabulary (a 25,000-token batch in ~14 chunks), a whole small batch on a CPU.
CHUNK_ELEMENTS = 1 << 26


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
    """The per-chunk math of the loss: ``forward(logits (C, V), index (C, 1), keep (C,), eps) -> (loss, nll)``
    and ``backward(logits (C, V), index (C, 1), coef (C, 1), eps) -> grad (C, V)`` in the logits' dtype."""

    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., Tensor]


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


EAGER = ChunkKernels(_forward_chunk, _backward_chunk)


def compiled_loss(dynamic: bool) -> Callable[[Tensor, Tensor, float, int], tuple[Tensor, Tensor]]:
    """:func:`label_smoothed_cross_entropy` with each chunk's math compiled by ``torch.compile`` (``dynamic``:
    one graph for every chunk length) and the loop over chunks left to Python, so a compiled training keeps
    the loss's memory bound: at most ``CHUNK_ELEMENTS`` fp32 temporaries at once, not the whole (N, V)
    softmax (1.85 GB for 12,500 tokens x 37,000 words)."""
    key_cpu_kernels_by_vector_width()
    kernels = ChunkKernels(torch.compile(_forward_chunk, dynamic=dynamic),
                           torch.compile(_backward_chunk, dynamic=dynamic))

    def loss(logits: Tensor, target: Tensor, epsilon: float, ignore_index: int = 0) -> tuple[Tensor, Tensor]:
        return _apply(kernels, logits, target, epsilon, ignore_index)

    return loss


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
        for rows in _chunks(logits):
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
        chunks = _chunks(logits)
        if len(chunks) == 1:
            return ctx.kernels.backward(logits, index, coef, ctx.epsilon), None, None, None, None
        grad = torch.empty_like(logits)
        for rows in chunks:
            grad[rows] = ctx.kernels.backward(logits[rows], index[rows], coef[rows], ctx.epsilon)
        return grad, None, None, None, None


def _chunks(logits: Tensor) -> list[slice]:
    """Row slices of at most CHUNK_ELEMENTS elements (at least one row each); one slice when the whole loss is
    traced by torch.compile (a Python loop over a symbolic row count would specialize on it): the trainer
    compiles the chunks' math instead (:func:`compiled_loss`), which keeps the bound."""
    if torch.compiler.is_compiling():
        return [slice(None)]
    N, V = logits.shape
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    return [slice(i, min(i + step, N)) for i in range(0, N, step)]


__all__ = ["CHUNK_ELEMENTS", "compiled_loss", "label_smoothed_cross_entropy"]
