"""Batched beam search with a KV cache and length penalties by name.

:func:`beam_search` reads the spec's options: ``beam`` N, ``nbest``, ``alpha`` and ``length_penalty``, ``stop``,
the lengths, ``min_len``, ``no_repeat_ngram``, ``ban_pad``. The rules are those of fairseq and Hugging Face, so
results can be compared:

* The encoder runs once. Memory, its mask and the cache's cross-attention keys/values keep one row per
  sentence, which its N beams share (the decoder groups a sentence's beams' queries against it); they are
  selected only when sentences leave the batch. The self-attention cache holds B*N rows and is reordered
  with ``cache.reorder`` after every step. The first step decodes one row per sentence (its N beams would
  be N copies of the same prefix), then each sentence's best N candidates become its beams.
* Each step keeps the 2N best (beam, token) candidates by summed logprob. A candidate ending in
  EOS among the first N of them becomes a finished hypothesis (EOS candidates ranked lower are
  dropped); the N best non-EOS candidates are the next live beams. At a sentence's max_len the
  first N candidates are all finalized, EOS or not.
* Each sentence keeps its N best finished hypotheses by penalized score (see
  :func:`length_penalty_denominator`). It is done when that pool is full and no live beam can
  still beat its worst member, judged by ``stop``:
  ``exact`` (default): a sound upper bound (:func:`_stop_bound`), so the result equals running
  every sentence to max_len; it asks only whether a live beam can still beat the ``nbest``-th best
  finished hypothesis (the last one returned; a pool need not be full): the pool's lower members
  might still change, but they are never returned; ``hf``: Hugging Face's default (``early_stopping=False``) heuristic,
  for reproducing ``generate(num_beams=N, length_penalty=alpha)`` token for token with
  ``length_penalty='power'``; ``first``: done as soon as the pool is full, whatever the live beams
  could still reach: HF's ``early_stopping=True``, fairseq's rule, and CTranslate2's default with a
  length penalty (patience 1), hence Argos Translate's. (HF's ``early_stopping="never"`` with
  alpha > 0 is sound too and returns the same hypotheses as ``exact``.) Done sentences leave the batch.
* ``no_repeat_ngram`` n > 0: a beam may not repeat one of its own n-grams (its candidates that would
  are set to -inf before the top-k, as fairseq and Hugging Face do).

Built for a GPU: the finished hypotheses stay on the device (:class:`_Finished`) and the cache is
written in place, so a step waits for the device once, to learn which sentences are done (n-gram
blocking adds a transfer of the beams' tokens); the hypotheses come back in one transfer at the end.
Scores are float32 sums of float32 log-probabilities whatever the model's dtype; penalized scores
and the stopping bound are float64, as Python floats were (float32 on MPS, which has no float64).

Shapes: B batch (sentences), n live sentences, N beam size, S source length, t tokens produced, V vocabulary;
rows are sentence-major: row = sentence * N + beam.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import DecodeOptions
from aiayn.search import native
from aiayn.search.common import (
    LENGTH_PENALTIES,
    NEG_INF,
    STOP_RULES,
    length_penalty_denominator,
    new_cache,
    score_dtype,
    top_k,
    waits_are_free,
)
from aiayn.search.fixed import FixedShapeSteps
from aiayn.search.processing import LogitsProcessor
from aiayn.search.sampling import SampledStream
from aiayn.search.spec import SearchSpec, max_lengths
from aiayn.search.strategy import Hypothesis, Strategy


class _Finished:
    """The N best finished hypotheses of each live sentence, on the device: what the search keeps instead
    of Python lists, so a step needs no transfer. Rows are the live sentences; ``store`` holds every
    sentence's pool (written when sentences leave the batch) for the one transfer at the end.

    Order: penalized score, best first; equal scores keep the earlier hypothesis first (an earlier step,
    or within a step an earlier candidate of the top-k), as inserting one by one after equal scores would.
    """

    def __init__(self, B: int, N: int, steps: int, device: torch.device) -> None:
        self.N = N
        self.score = torch.full((B, N), NEG_INF, dtype=score_dtype(device), device=device)  # -inf: empty slot
        self.logprob = torch.zeros(B, N, device=device)
        self.length = torch.zeros(B, N, dtype=torch.long, device=device)
        self.tokens = torch.zeros(B, N, steps, dtype=torch.long, device=device)
        self.store = [x.clone() for x in (self.score, self.logprob, self.length, self.tokens)]

    @property
    def worst(self) -> Tensor:
        """(n,) the score of the N-th best (-inf while a pool is not full)."""
        return self.score[:, -1]

    def kth(self, k: int) -> Tensor:
        """(n,) the score of the k-th best (-inf while fewer than k have finished)."""
        return self.score[:, k - 1]

    def offer(self, score: Tensor, logprob: Tensor, seqs: Tensor, lengths: Tensor) -> None:
        """Merge k new hypotheses per sentence: score (n, k) of :func:`score_dtype` (-inf: not a hypothesis),
        logprob (n, k), seqs (n, k, w) tokens (the first ``lengths`` (n, k) count), w >= every length."""
        n, w = score.size(0), seqs.size(2)
        both = torch.cat([self.score, score], 1)
        order = both.sort(dim=1, descending=True, stable=True).indices[:, : self.N]
        self.score = both.gather(1, order)
        self.logprob = torch.cat([self.logprob, logprob], 1).gather(1, order)
        self.length = torch.cat([self.length, lengths], 1).gather(1, order)
        both = torch.cat([self.tokens[:, :, :w], seqs], 1)  # (n, N + k, w): pooled tokens end before w
        self.tokens[:, :, :w] = both.gather(1, order[:, :, None].expand(n, self.N, w))

    def save_and_keep(self, sent: Tensor, keep: Tensor) -> None:
        """Write the pools of the live sentences ``sent`` (n,) to the store; keep rows ``keep``."""
        fields = (self.score, self.logprob, self.length, self.tokens)
        for stored, x in zip(self.store, fields):
            stored.index_copy_(0, sent, x)
        self.score, self.logprob, self.length, self.tokens = (x.index_select(0, keep) for x in fields)

    def hypotheses(self, nbest: int) -> list[list[Hypothesis]]:
        """Every sentence's best ``nbest`` from the store (one transfer)."""
        score, logprob, length, tokens = (x[:, :nbest].tolist() for x in self.store)
        return [[Hypothesis(tok[:n], s, lp) for s, lp, n, tok in zip(*row) if s != NEG_INF]
                for row in zip(score, logprob, length, tokens)]


def _stop_bound(best_live: Tensor, length: int, limit_denominator: Tensor, spec: SearchSpec) -> Tensor:
    """(n,): upper bound on the penalized score any continuation of a live beam can still finish with;
    best_live (n,) (:func:`score_dtype`) is the best live summed logprob, ``length`` |Y| of the live beams now.

    ``exact``: a continuation finishes with |Y'| in [length+1, limit] and logprob' <= best_live <= 0, so
    its score is at most best_live divided by the largest denominator over that range; the penalties are
    monotone in |Y|, so it sits at an end (alpha >= 0: at the limit, whose denominator is
    ``limit_denominator`` (n,); alpha < 0: at length+1); the max of both ends also covers a logprob
    rounded a hair above 0 (log_softmax of p ~ 1). A sentence at its limit is done whatever this says.
    ``hf``: Hugging Face's default heuristic (early_stopping=False) divides by the denominator at the
    *current* length; with alpha > 0 a longer hypothesis can still beat it, so that rule may stop
    before the best hypothesis is found. ``first``: -inf, so a full pool is done (the first N to end).
    """
    alpha, kind = spec.options.alpha, spec.options.length_penalty
    if spec.options.stop == "first":
        return torch.full_like(best_live, NEG_INF)
    if spec.options.stop == "hf":
        return best_live / length_penalty_denominator(length, alpha, kind)
    return torch.maximum(best_live / length_penalty_denominator(length + 1, alpha, kind),
                         best_live / limit_denominator)


def _check(spec: SearchSpec) -> None:
    o = spec.options
    if o.length_penalty not in LENGTH_PENALTIES:
        raise ValueError(f"unknown length penalty {o.length_penalty!r}; expected one of {', '.join(LENGTH_PENALTIES)}")
    if o.stop not in STOP_RULES:
        raise ValueError(f"unknown stop rule {o.stop!r}; expected one of {', '.join(STOP_RULES)}")
    if o.beam < 1 or not 1 <= o.nbest <= o.beam:
        raise ValueError(f"need beam >= 1 and 1 <= nbest <= beam (got beam={o.beam}, nbest={o.nbest})")


def _candidates(lprobs: Tensor, scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The 2N best (beam, token) candidates of each live sentence, best first, from lprobs (rows, V) of its R
    rows (1 on the first step, then N) and scores (n, N), the live beams' summed logprobs: (summed logprob,
    beam, token), each (n, 2N) (fewer when N * V < 2N)."""
    (n, N), V = scores.shape, lprobs.size(-1)
    R, k = lprobs.size(0) // n, min(2 * N, V)
    if R * k >= min(2 * N, N * V):
        # Each row's best k first (the 2N best of a sentence are among its rows' best 2N), then the 2N best
        # of those R * k per sentence: the same candidates as a top-k over all N * V, without writing them.
        row_lp, row_tok = top_k(lprobs, k)  # (rows, k)
        cand = (scores[:, :R, None] + row_lp.view(n, R, k)).view(n, R * k)
        top_lp, top_pos = cand.topk(min(2 * N, N * V), dim=-1)  # (n, 2N), best first
        return top_lp, top_pos // k, row_tok.view(n, R * k).gather(1, top_pos)
    # a vocabulary smaller than 2N on the first step: every beam's candidates, the others' at -inf
    cand = (scores.unsqueeze(-1) + lprobs.view(n, R, V)).view(n, N * V)
    top_lp, top_idx = cand.topk(min(2 * N, N * V), dim=-1)  # (n, 2N), best first
    return top_lp, top_idx // V, top_idx % V


def _first_candidates(tokens: Tensor, top_beam: Tensor, top_tok: Tensor, N: int) -> Tensor:
    """(n, N, t + 1) the tokens of each sentence's first N candidates: their beam's prefix (tokens (rows, 1 + t),
    BOS first), then the candidate's token (top_beam, top_tok (n, 2N))."""
    n, t = top_beam.size(0), tokens.size(1) - 1
    prefix = tokens[:, 1:].view(n, tokens.size(0) // n, t)  # (n, R, t); (n, 1, 0) on the first step
    prefix = prefix.gather(1, top_beam[:, :N, None].expand(n, N, t)) if t else prefix.expand(n, N, 0)
    return torch.cat([prefix, top_tok[:, :N, None]], 2)


class _Step(NamedTuple):
    """One step's 2N best candidates of each live sentence, best first (:func:`_candidates`), each (n, 2N): summed
    logprob, beam, token, and whether the token is EOS."""

    lp: Tensor
    beam: Tensor
    tok: Tensor
    eos: Tensor


def _offer_finished(finished: _Finished, step: _Step, tokens: Tensor, at_limit: Tensor, t: int, spec: SearchSpec,
                    free_waits: bool) -> None:
    """Offer the step's finished hypotheses to the pools: EOS among each sentence's first N candidates, or all
    first N when the sentence is at its limit (at_limit (n,)); tokens (rows, 1 + t) the live beams' prefixes."""
    N, o = finished.N, spec.options
    lp, eos = step.lp[:, :N], step.eos[:, :N]
    new = (eos | at_limit[:, None]) & (lp > NEG_INF)
    if not free_waits or bool(new.any()):  # skip the merge when nothing finished, if asking is free
        den = length_penalty_denominator(t + 1, o.alpha, o.length_penalty)
        penalized = (lp.to(finished.score.dtype) / den).masked_fill(~new, NEG_INF)
        finished.offer(penalized, lp, _first_candidates(tokens, step.beam, step.tok, N), t + (~eos).long())


def _next_beams(step: _Step, N: int, first_rows: Tensor, sent: Tensor, t: int) -> tuple[Tensor, Tensor, Tensor]:
    """The next live beams, the N best non-EOS candidates (a stable sort keeps the topk order): their summed
    logprobs, the row each continues and its token, each (n, N). first_rows (n, 1) is each sentence's first row,
    sent (n,) its original index (on the first step, t = 0, every beam continues its sentence's one row)."""
    n = step.lp.size(0)
    live_lp = step.lp.masked_fill(step.eos, NEG_INF)
    order = live_lp.sort(dim=-1, descending=True, stable=True).indices[:, :N]  # (n, N)
    src_rows = first_rows + step.beam.gather(1, order) if t else sent[:, None].expand(n, N)
    return live_lp.gather(1, order), src_rows, step.tok.gather(1, order)


def _keep_sentences(keep: Tensor, cache: Any, memory: Tensor, mem_mask: Tensor | None
                    ) -> tuple[Tensor, Tensor | None]:
    """Memory (n, S, D), its mask (n, S) (None: no padding) and the cache's cross-attention K/V of the kept
    sentences keep (n',). They
    are one row per sentence, which its N beams share (the decoder's grouped cross-attention): they are selected
    only when a sentence leaves the batch, never copied per beam nor reordered with the beams."""
    cache.reorder_cross(keep)
    return memory.index_select(0, keep), None if mem_mask is None else mem_mask.index_select(0, keep)


@torch.no_grad()
def beam_search(model: nn.Module, src: Tensor, src_mask: Tensor | None = None,
                spec: SearchSpec = SearchSpec()) -> list[list[Hypothesis]]:
    """Batched beam search with a KV cache. src (B, S) ids, src_mask (B, S) bool (default ``src != spec.pad``).

    Returns, per sentence, up to ``nbest`` finished :class:`Hypothesis`, best (highest penalized score) first.
    The rules (fairseq's and Hugging Face's) and the device-side bookkeeping: the module docstring. A few sentences
    on the CPU are searched in one native loop (:mod:`aiayn.search.native`, the same search), the rest here."""
    _check(spec)
    src_mask = src != spec.pad if src_mask is None else src_mask
    if native.chosen(model, src, src_mask, spec):
        return native.beam_search(model, src, src_mask, spec)
    return _search(model, src, src_mask, spec)


def _search(model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec) -> list[list[Hypothesis]]:
    """:func:`beam_search`'s loop in PyTorch operations, on any device."""
    o, device, B = spec.options, src.device, src.size(0)
    N = o.beam
    process, free_waits, sdt = LogitsProcessor(spec, device), waits_are_free(device), score_dtype(device)
    lengths = src_mask.sum(dim=1).tolist()  # the sources' lengths: one transfer, before the loop
    limits = max_lengths(model, src_mask, spec, lengths)
    memory = model.encode(src, src_mask)  # (n, S, D): one row per live sentence, all its beams'
    # no padding (one sentence, or sources of one length): no mask for the cross-attention to apply at every step
    mem_mask = None if all(n == src_mask.size(1) for n in lengths) else src_mask
    if o.cuda_graphs:  # every step at fixed shapes, on CUDA one graph replayed (aiayn.search.fixed)
        decode = (cache := FixedShapeSteps(model, memory, mem_mask, N, max(limits), spec.pad)).decode
    else:
        cache, decode = new_cache(model, max(limits)), model.decode
    tokens = torch.full((B, 1), spec.bos, dtype=torch.long, device=device)  # (rows, 1 + t): B at first, then n*N
    scores = torch.full((B, N), NEG_INF, device=device)  # summed logprob of each live beam
    scores[:, 0] = 0.0
    sent = torch.arange(B, device=device)  # (n,) original sentence of each live group of N rows
    limit = torch.tensor(limits, device=device)  # (n,) step limits
    limit_den = torch.tensor([length_penalty_denominator(m, o.alpha, o.length_penalty) for m in limits],
                             dtype=sdt, device=device)  # (n,) their length-penalty denominators
    finished = _Finished(B, N, max(limits), device)
    offsets = torch.arange(B, device=device)[:, None] * N  # (B, 1) first row of each group; live rows are 0..n-1
    t = 0  # tokens produced so far by every live beam
    while True:
        spec.check_stop()
        n = scores.size(0)
        logits = process.ban(decode(tokens[:, -1:], memory, mem_mask, cache)[:, -1])  # (rows, V)
        lprobs = process.constrain(F.log_softmax(logits, dim=-1, dtype=torch.float32), tokens[:, 1:], t)
        top_lp, top_beam, top_tok = _candidates(lprobs, scores)
        step = _Step(top_lp, top_beam, top_tok, top_tok == spec.eos)
        length = t + 1  # |Y| of every candidate of this step
        at_limit = limit <= length  # (n,)
        _offer_finished(finished, step, tokens, at_limit, t, spec, free_waits)
        new_scores, src_rows, new_tok = _next_beams(step, N, offsets[:n], sent, t)

        best_live = new_scores[:, 0]
        bound = _stop_bound(best_live.to(sdt), length, limit_den, spec)
        # done: at the limit, no live beam can produce anything finite, or none can beat a full pool (exact: none
        # can beat the nbest-th best, the last one returned)
        cut = finished.kth(o.nbest) if o.stop == "exact" else finished.worst
        done = at_limit | (best_live == NEG_INF) | ((cut > NEG_INF) & (bound <= cut))
        keep = (~done).nonzero().squeeze(1)  # (n',) the step's one wait for the device
        if keep.numel() < n:
            finished.save_and_keep(sent, keep)
            if keep.numel() == 0:
                break
            src_rows, new_tok, new_scores = src_rows[keep], new_tok[keep], new_scores[keep]
            sent, limit, limit_den = sent[keep], limit[keep], limit_den[keep]
            memory, mem_mask = _keep_sentences(keep, cache, memory, mem_mask)
        next_rows = src_rows.reshape(-1)  # (n'*N,) beam reorder and dropped sentences
        cache.reorder(next_rows, cross=False)  # self-attention's keys/values: the beams' own
        tokens, scores, t = torch.cat([tokens[next_rows], new_tok.reshape(-1, 1)], dim=1), new_scores, t + 1
    return finished.hypotheses(o.nbest)


class Beam(SampledStream, Strategy):
    """Beam search (beam > 1, no sampling). A language model's stream has no beams: it continues greedily, the
    options' beam aside."""

    name = "beam"

    def chosen(self, options: DecodeOptions) -> bool:
        return not options.sample and options.beam > 1

    def rows(self, options: DecodeOptions) -> int:
        return options.beam

    def search(self, model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec, scores: bool
               ) -> list[list[Hypothesis]]:
        return beam_search(model, src, src_mask, spec)
