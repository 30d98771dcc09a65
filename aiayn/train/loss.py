"""Label-smoothed cross entropy (section 5.4, eps_ls = 0.1) that ignores padding.

Shapes: N target positions (flattened B*T), V vocabulary.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def label_smoothed_cross_entropy(
    logits: Tensor, target: Tensor, epsilon: float, ignore_index: int = 0
) -> tuple[Tensor, Tensor]:
    """Summed loss and summed NLL over non-padding targets.

    logits (..., V), target (...) long. The smoothed target distribution is
    q = (1 - eps) * one_hot(y) + eps / V  (Szegedy et al. 2016, uniform over all V classes, the
    convention of ``torch.nn.CrossEntropyLoss(label_smoothing=eps)``; fairseq spreads eps over the
    V - 1 other classes instead, a difference of eps/V on the true class).
    Returns (loss_sum, nll_sum): divide by the number of target tokens of the whole update.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1).reshape(-1, logits.size(-1))  # (N, V)
    target = target.reshape(-1)
    keep = target != ignore_index
    nll = -lprobs.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1)  # (N,)
    nll_sum = nll.masked_select(keep).sum()
    if epsilon == 0.0:
        return nll_sum, nll_sum.detach()
    smooth = -lprobs.mean(dim=-1)  # (N,): cross entropy with the uniform distribution
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss.masked_select(keep).sum(), nll_sum.detach()


def token_count(target: Tensor, ignore_index: int = 0) -> int:
    """Number of non-padding target tokens."""
    return int((target != ignore_index).sum())


__all__ = ["label_smoothed_cross_entropy", "token_count"]
