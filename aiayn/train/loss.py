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

import torch
from torch import Tensor

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
    V = logits.size(-1)
    loss, nll = _SmoothedCrossEntropy.apply(logits.reshape(-1, V), target.reshape(-1), float(epsilon),
                                            ignore_index)
    return loss, nll


class _SmoothedCrossEntropy(torch.autograd.Function):
    """(N, V) logits, (N,) targets -> (loss_sum, nll_sum); gradient for the logits only."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, epsilon: float, ignore_index: int) -> tuple[Tensor, Tensor]:
        keep = target != ignore_index  # (N,)
        index = target.clamp_min(0).unsqueeze(1)  # (N, 1): ignored positions gather a valid, unused entry
        loss_sum = logits.new_zeros((), dtype=torch.float32)
        nll_sum = logits.new_zeros((), dtype=torch.float32)
        for rows in _chunks(logits):
            # dtype=: the kernel reads bf16 / fp16 logits and computes in fp32, no separate cast
            lprobs = torch.log_softmax(logits[rows], dim=-1, dtype=torch.float32)  # (C, V)
            nll = -lprobs.gather(1, index[rows]).squeeze(1)  # (C,)
            nll = torch.where(keep[rows], nll, 0.0)
            nll_sum = nll_sum + nll.sum()
            if epsilon:
                smooth = torch.where(keep[rows], -lprobs.mean(dim=-1), 0.0)  # CE with the uniform distribution
                loss_sum = loss_sum + (1.0 - epsilon) * nll.sum() + epsilon * smooth.sum()
        if not epsilon:
            loss_sum = nll_sum.clone()
        ctx.save_for_backward(logits, index, keep)
        ctx.epsilon = epsilon
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        logits, index, keep = ctx.saved_tensors
        eps, V = ctx.epsilon, logits.size(-1)
        coef = keep.to(torch.float32) * grad_loss.float()  # (N,): d loss_sum / d loss_i
        chunks = _chunks(logits)
        grad = torch.empty_like(logits) if len(chunks) > 1 else None
        for rows in chunks:
            p = torch.softmax(logits[rows], dim=-1, dtype=torch.float32)  # (C, V)
            c = coef[rows].unsqueeze(1)  # (C, 1)
            p.scatter_add_(1, index[rows], torch.full_like(c, -(1.0 - eps)))  # p - (1 - eps) one_hot(y)
            # c * (p - eps / V), one pass, written in the logits' dtype
            if grad is None:
                grad = torch.addcmul(c * (-eps / V), p, c).to(logits.dtype)
            else:
                torch.addcmul(c * (-eps / V), p, c, out=grad[rows])
        return grad, None, None, None


def _chunks(logits: Tensor) -> list[slice]:
    """Row slices of at most CHUNK_ELEMENTS elements (at least one row each); one slice under
    torch.compile, which fuses the log-softmax into its row reductions by itself (and would recompile
    for every batch size: a Python loop over a symbolic row count specializes on it)."""
    if torch.compiler.is_compiling():
        return [slice(None)]
    N, V = logits.shape
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    return [slice(i, min(i + step, N)) for i in range(0, N, step)]


__all__ = ["label_smoothed_cross_entropy"]
