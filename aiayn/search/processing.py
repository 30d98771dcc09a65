"""The per-step logits processing every search shares: banned ids, ``min_len``, n-gram blocking, and the
sampling filters (temperature, top-k, top-p).

Shapes: R rows (live sentences, beams or draws), V vocabulary, t tokens produced so far.

Each search applies the steps where its scores need them, in the same order as the references it is tested
against: :meth:`LogitsProcessor.ban` on the decoder's raw logits (before any softmax, so the other tokens'
probabilities renormalize, as Hugging Face's ``bad_words_ids`` with ``renormalize_logits``), then
:meth:`LogitsProcessor.constrain` on what the search ranks (greedy: the logits; beam search: the
log-probabilities, as fairseq and Hugging Face; sampling: the logits it draws from). A new decoding option that
changes the scores of a step is one more step here and a field of :class:`~aiayn.config.DecodeOptions`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from aiayn.search.common import NEG_INF
from aiayn.search.spec import SearchSpec


def repeated_ngram_bans(seq: Sequence[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already in ``seq`` (n-gram blocking; n <= 0: none).

    The last n-1 tokens of ``seq`` are the prefix; every earlier occurrence of that prefix bans the token
    that followed it. ``n = 1`` bans every token already produced. Same rule as fairseq's and Hugging
    Face's ``no_repeat_ngram_size``, applied to the produced tokens only (never the prompt or source).
    """
    if n <= 0 or len(seq) < n - 1:
        return []
    if n == 1:
        return sorted(set(seq))
    prefix = tuple(seq[len(seq) - n + 1:])
    return sorted({seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == prefix})


def filter_top_k(logits: Tensor, k: int | None) -> Tensor:
    """Keep the k largest logits of (..., V), set the rest to -inf (ties with the k-th are kept)."""
    if k is None or k >= logits.size(-1):
        return logits
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {k}")
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def filter_top_p(logits: Tensor, p: float | None) -> Tensor:
    """Nucleus filtering of (..., V): keep the smallest set of most probable tokens whose probability
    mass is >= p (always at least the top token); set the rest to -inf."""
    if p is None or p >= 1.0:
        return logits
    if not 0.0 < p:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more probable tokens
    drop_sorted = mass_before >= p  # the set already reached p without this token
    # The most probable token always stays: a p below float32's smallest value (1e-46, 1e-300) rounds to 0 in the
    # comparison, which would drop every token and leave nothing to draw from (softmax of all -inf: NaN).
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


class LogitsProcessor:
    """The steps of one search call, built once from its :class:`SearchSpec` (the banned ids moved to the
    device once, not every step)."""

    def __init__(self, spec: SearchSpec, device: torch.device) -> None:
        o = spec.options
        self.eos, self.min_len, self.ngram = spec.eos, o.min_len, o.no_repeat_ngram
        self.temperature, self.top_k, self.top_p = o.temperature, o.top_k, o.top_p
        self.banned = torch.tensor(spec.banned, dtype=torch.long, device=device) if spec.banned else None

    def ban(self, logits: Tensor) -> Tensor:
        """logits (..., V) with the banned ids at -inf (a new tensor; the same one when nothing is banned)."""
        return logits if self.banned is None else logits.index_fill(-1, self.banned, NEG_INF)

    def constrain(self, scores: Tensor, produced: Tensor, t: int) -> Tensor:
        """In place on scores (R, V): EOS at -inf while fewer than ``min_len`` tokens are produced, and each
        row's tokens that would repeat one of its n-grams at -inf; ``produced`` (R, t) are the tokens so far."""
        if t < self.min_len:
            scores[:, self.eos] = NEG_INF
        if self.ngram > 0 and produced.size(1) >= max(self.ngram - 1, 1):
            for r, seq in enumerate(produced.tolist()):  # one transfer of the rows' tokens
                banned = repeated_ngram_bans(seq, self.ngram)
                if banned:
                    scores[r, banned] = NEG_INF
        return scores

    def filtered(self, logits: Tensor) -> Tensor:
        """What sampling draws from: logits (..., V) / temperature, then top-k, then top-p (temperature > 0)."""
        return filter_top_p(filter_top_k(logits / self.temperature, self.top_k), self.top_p)
