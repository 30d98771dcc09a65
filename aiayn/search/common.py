"""The utilities the searches share: length penalties by name, score dtypes, top-k, the cache, padded rows of ids.
The protocol every search implements, and its hypothesis record, are :mod:`aiayn.search.strategy`'s."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from aiayn.config import LENGTH_PENALTIES, STOP_RULES  # noqa: F401 - the names the searches check

NEG_INF = float("-inf")


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


# top_k's chunks: each row's maxima are read per chunk of this many ids (one vectorized pass), then only the chunks
# whose maxima rank in the top k are searched. 64 was fastest among 16 to 256 for 8,000 ids (k 8).
TOPK_CHUNK = 64


def top_k(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of x (R, V), best first, and their columns: (R, k), (R, k) long; what
    ``x.topk(k)`` gives, found faster for a wide vocabulary.

    The j-th largest value v_j lies in a chunk whose maximum is >= v_j, and fewer than j chunks have a maximum
    above v_j (each holds a value above it), so the k chunks with the largest maxima hold the k largest values.
    Among exactly equal values another one of them may be chosen than by ``x.topk``, as between two of
    PyTorch's top-k kernels: ties in a search are broken by how it is computed, never by a rule."""
    R, V = x.shape
    C = TOPK_CHUNK
    if V < 4 * k * C:
        return x.topk(k, dim=-1)
    whole = V // C * C  # the columns in whole chunks; the rest (fewer than C) is always searched
    best = x[:, :whole].reshape(R, whole // C, C).amax(dim=-1).topk(k, dim=-1).indices  # (R, k) chunks
    cols = (best[:, :, None] * C + torch.arange(C, device=x.device)).reshape(R, k * C)
    if whole < V:
        cols = torch.cat([cols, torch.arange(whole, V, device=x.device).expand(R, V - whole)], dim=1)
    values, at = x.gather(1, cols).topk(k, dim=-1)
    return values, cols.gather(1, at)


def new_cache(model: nn.Module, steps: int):
    """``model.new_cache()`` with room for ``steps`` decoding steps when the cache can reserve it
    (:class:`~aiayn.model.cache.KVCache` preallocates them; a cache without ``reserve`` is used as is)."""
    cache = model.new_cache()
    reserve = getattr(cache, "reserve", None)
    if reserve is not None:
        reserve(steps)
    return cache
