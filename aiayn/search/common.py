"""What every search shares: the hypothesis record, length penalties by name, score dtypes, the cache, padded
rows of ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from aiayn.config import LENGTH_PENALTIES, STOP_RULES  # noqa: F401 - the names the searches check, defined once

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    """One finished output: ``tokens`` without BOS/EOS, ``score`` the length-penalized score used for ranking,
    ``logprob`` the sum of the token log-probabilities (EOS included)."""

    tokens: list[int]
    score: float
    logprob: float


def pad_rows(rows: Sequence[Sequence[int]], pad: int) -> Tensor:
    """Right-pad id lists into one (B, longest) long tensor."""
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), pad, dtype=torch.long)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def length_penalty_denominator(length: int, alpha: float, kind: str = "gnmt") -> float:
    """The number a hypothesis' log-probability is divided by; ``length`` is |Y| (EOS counted).

    ``gnmt``: ((5 + |Y|) / 6) ** alpha (Wu et al. 2016, used by the paper with alpha 0.6);
    ``power``: |Y| ** alpha (fairseq, Hugging Face, CTranslate2); ``none``: 1.
    """
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "power":
        return float(length) ** alpha
    if kind == "none":
        return 1.0
    raise ValueError(f"unknown length penalty {kind!r}; expected one of {', '.join(LENGTH_PENALTIES)}")


def penalized_score(logprob: float, length: int, alpha: float, kind: str = "gnmt") -> float:
    """score = logprob / length_penalty_denominator(|Y|, alpha, kind)."""
    return logprob / length_penalty_denominator(length, alpha, kind)


def score_dtype(device: torch.device) -> torch.dtype:
    """The dtype of penalized scores: float64, as Python floats are, so a search on the device ranks exactly as
    Python bookkeeping would; float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def waits_are_free(device: torch.device) -> bool:
    """Whether reading a value on the host costs nothing here (the CPU: no queue of work to wait for), so a
    search may ask, e.g., whether anything finished this step, to skip work."""
    return device.type == "cpu"


def new_cache(model: nn.Module, steps: int):
    """``model.new_cache()`` with room for ``steps`` decoding steps when the cache can reserve it
    (:class:`~aiayn.model.cache.KVCache` preallocates them; a cache without ``reserve`` is used as is)."""
    cache = model.new_cache()
    reserve = getattr(cache, "reserve", None)
    if reserve is not None:
        reserve(steps)
    return cache
