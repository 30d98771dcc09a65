"""Search on token ids: greedy, batched beam search with length penalties by name, and sampling.

Nothing here knows about text. The functions drive any model exposing

    memory = model.encode(src (B, S), src_mask (B, S) bool)          -> (B, S, D)
    logits = model.decode(tgt (B, T), memory, memory_mask, cache)    -> (B, T, V)
    cache  = model.new_cache();  cache.reorder(rows: LongTensor)     (select / repeat / drop rows)
    cache.reserve(steps)                                             (optional: preallocate decoding steps)

With a cache, ``decode`` receives only the tokens it has not seen yet. A decoder-only LM takes
``memory=None, memory_mask=None`` (only :func:`sample` uses one).

Shapes: B batch (sentences), S source length, T target length, D model width, V vocabulary,
N beam size; rows of beam search are sentence-major: row = sentence * N + beam.

Conventions shared by greedy and beam search:

* The output never contains BOS or EOS. ``bos_id`` is the decoder's start token (Hugging Face
  Marian starts from its pad id, aiayn models from BOS).
* ``max_len`` of sentence i is ``int(max_len_a * src_len_i + max_len_b)`` with ``src_len_i`` its real
  (non-pad) length, so batching never changes a sentence's limit; it is capped at the model's
  ``cfg.max_positions`` (the decoder reads positions 0 .. max_len-1). ``max_len`` bounds the number of
  *decoding steps*: EOS is one of them. A sentence ended by EOS has at most max_len-1 tokens; one still
  running at step max_len is cut there and returned with exactly max_len tokens and no EOS, as Hugging
  Face finalizes unfinished beams (fairseq instead forces an EOS after max_len tokens). Hugging Face's
  ``max_length`` counts the start token as well: ``max_length = max_len + 1``.
* ``min_len``: EOS is forbidden until ``min_len`` tokens have been produced (HF ``min_length - 1``).
* ``|Y|``, the length in the length penalty, is the number of decoding steps of the hypothesis: its
  tokens **plus the EOS** when it ended with one (a hypothesis cut at max_len has |Y| = max_len). This
  is Hugging Face's ``cur_len + 1 - decoder_prompt_len`` and fairseq's ``step + 1``.

Models are not switched to eval mode here: callers decode with ``model.eval()`` (dropout off).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

LENGTH_PENALTIES = ("gnmt", "power", "none")
STOP_RULES = ("exact", "hf")
NEG_INF = float("-inf")


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


@dataclass
class Hypothesis:
    """One finished beam-search output: ``tokens`` without BOS/EOS, ``score`` the length-penalized
    score used for ranking, ``logprob`` the sum of the token log-probabilities (EOS included)."""

    tokens: list[int]
    score: float
    logprob: float


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


def max_lengths(model, src_mask: Tensor, max_len_a: float, max_len_b: float) -> list[int]:
    """Per-sentence decoding-step limits int(a * src_len_i + b) from src_mask (B, S) bool, at least 1
    and at most the model's ``cfg.max_positions`` when it has one."""
    cap = getattr(getattr(model, "cfg", None), "max_positions", None)
    out = []
    for n in src_mask.sum(dim=1).tolist():
        m = int(max_len_a * n + max_len_b)
        if cap is not None:
            m = min(m, int(cap))
        out.append(max(1, m))
    return out


class BannedTokens:
    """``model`` whose decoder logits of ``ids`` are -inf before any softmax: those tokens are never produced
    and the probabilities renormalize over the others, as Hugging Face's ``bad_words_ids`` (single tokens)
    with ``renormalize_logits=True`` (Marian checkpoints ban their pad id so). Every search function drives it."""

    def __init__(self, model, ids: Sequence[int]) -> None:
        self.model, self.cfg = model, getattr(model, "cfg", None)
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long)

    def encode(self, *args, **kwargs) -> Tensor:
        return self.model.encode(*args, **kwargs)

    def decode(self, *args, **kwargs) -> Tensor:
        logits = self.model.decode(*args, **kwargs)  # (B, T, V)
        if self.ids.device != logits.device:  # move the ids once, not on every step
            self.ids = self.ids.to(logits.device)
        return logits.index_fill(-1, self.ids, NEG_INF)

    def new_cache(self):
        return self.model.new_cache()

    def parameters(self):
        return self.model.parameters()


# Greedy ----------------------------------------------------------------------------------------------


def score_dtype(device: torch.device) -> torch.dtype:
    """The dtype of penalized scores in beam search: float64, as Python floats are, so a search on the
    device ranks exactly as the former Python bookkeeping did; float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def _waits_are_free(device: torch.device) -> bool:
    """Whether reading a value on the host costs nothing here (the CPU: no queue of work to wait for),
    so a search may ask, e.g., whether anything finished this step, to skip work."""
    return device.type == "cpu"


def _new_cache(model, steps: int):
    """``model.new_cache()`` with room for ``steps`` decoding steps when the cache can reserve it
    (:class:`~aiayn.model.cache.KVCache` preallocates them; a cache without ``reserve`` is used as is)."""
    cache = model.new_cache()
    reserve = getattr(cache, "reserve", None)
    if reserve is not None:
        reserve(steps)
    return cache


@torch.no_grad()
def greedy_search(
    model,
    src: Tensor,
    src_mask: Tensor | None = None,
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    min_len: int = 0,
    bos_id: int = 2,
    eos_id: int = 3,
    pad_id: int = 0,
    use_cache: bool = True,
    no_repeat_ngram: int = 0,
) -> list[list[int]]:
    """Argmax decoding. src (B, S) ids, src_mask (B, S) bool (default ``src != pad_id``).

    Returns one token list per sentence, without BOS and EOS. Sentences that end drop out of the
    batch (their rows are removed from the cache), so the remaining steps cost only the live rows.
    Each step waits for the device once, to learn which rows ended; outputs stay on the device until
    the end. ``use_cache=False`` re-decodes the whole prefix at every step (the reference for cache
    tests). ``no_repeat_ngram`` n > 0 never lets a sentence repeat one of its own n-grams
    (:func:`repeated_ngram_bans`).
    """
    if src_mask is None:
        src_mask = src != pad_id
    device = src.device
    limits = max_lengths(model, src_mask, max_len_a, max_len_b)
    memory = model.encode(src, src_mask)  # (B, S, D)
    mem_mask = src_mask
    B, steps = src.size(0), max(limits)
    sent = torch.arange(B, device=device)  # original sentence of each live row
    limit = torch.tensor(limits, device=device)  # (B',) step limit of each live row
    tokens = torch.full((B, 1), bos_id, dtype=torch.long, device=device)  # (B', 1 + t)
    cache = _new_cache(model, steps) if use_cache else None
    out = torch.zeros(B, steps, dtype=torch.long, device=device)  # (B, steps) tokens of ended sentences
    out_len = torch.zeros(B, dtype=torch.long, device=device)
    t = 0  # tokens produced so far by every live row
    while True:
        inp = tokens[:, -1:] if cache is not None else tokens
        logits = model.decode(inp, memory, mem_mask, cache)[:, -1].float()  # (B', V)
        if t < min_len:
            logits[:, eos_id] = NEG_INF
        if no_repeat_ngram > 0:
            _ban_ngrams(logits, tokens[:, 1:], no_repeat_ngram)
        nxt = logits.argmax(dim=-1)  # (B',)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        ended = nxt == eos_id
        keep = (~(ended | (limit <= t + 1))).nonzero().squeeze(1)  # the step's one wait for the device
        if keep.numel() < sent.numel():
            # Record every live row (the ended ones are final; the others are overwritten later).
            out[:, : t + 1].index_copy_(0, sent, tokens[:, 1:])
            out_len.index_copy_(0, sent, t + 1 - ended.long())  # EOS is not part of the output
            if keep.numel() == 0:
                break
            tokens, memory, mem_mask = tokens[keep], memory[keep], mem_mask[keep]
            sent, limit = sent[keep], limit[keep]
            if cache is not None:
                cache.reorder(keep)
        t += 1
    return [seq[:n] for seq, n in zip(out.tolist(), out_len.tolist())]


def _ban_ngrams(scores: Tensor, produced: Tensor, n: int) -> None:
    """Set to -inf, in place, the entries of scores (R, V) that would repeat an n-gram of the row's
    produced tokens (R, t)."""
    if produced.size(1) < max(n - 1, 1):
        return
    for r, seq in enumerate(produced.tolist()):
        banned = repeated_ngram_bans(seq, n)
        if banned:
            scores[r, banned] = NEG_INF


@torch.no_grad()
def score_tokens(model, src: Tensor, src_mask: Tensor, found: Sequence[Sequence[int]], limits: Sequence[int],
                 alpha: float, length_penalty: str, bos_id: int = 2, eos_id: int = 3, pad_id: int = 0
                 ) -> list[Hypothesis]:
    """Teacher-forced log-probabilities of found outputs (e.g. greedy search's, which tracks none):
    src (B, S) ids, src_mask (B, S) bool, ``found`` token lists without BOS/EOS.

    A sentence shorter than its step limit ended with EOS (counted in the logprob and in |Y|); one of
    exactly ``limit`` tokens was cut there (see the module docstring)."""
    from aiayn.data.batching import pad_batch  # the same layer as this module (see tests/test_structure.py)

    seqs = [list(t) + [eos_id] if len(t) < lim else list(t) for t, lim in zip(found, limits)]
    width = max(len(q) for q in seqs)
    tgt_in = pad_batch([[bos_id] + q[:-1] for q in seqs], pad_id).to(src.device)  # (B, T)
    tgt_out = pad_batch(seqs, pad_id).to(src.device)  # (B, T)
    memory = model.encode(src, src_mask)
    lprobs = torch.log_softmax(model.decode(tgt_in, memory, src_mask).float(), dim=-1)  # (B, T, V)
    tok_lp = lprobs.gather(2, tgt_out.unsqueeze(-1)).squeeze(-1)  # (B, T)
    lengths = torch.tensor([len(q) for q in seqs], device=src.device)
    real = torch.arange(width, device=src.device)[None, :] < lengths[:, None]  # (B, T)
    sums = tok_lp.masked_fill(~real, 0.0).sum(dim=1).tolist()
    return [Hypothesis(list(t), penalized_score(lp, len(q), alpha, length_penalty), lp)
            for t, q, lp in zip(found, seqs, sums)]


# Beam search -----------------------------------------------------------------------------------------


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


def _stop_bound(best_live: Tensor, length: int, limit_denominator: Tensor, alpha: float, kind: str,
                stop: str) -> Tensor:
    """(n,): upper bound on the penalized score any continuation of a live beam can still finish with;
    best_live (n,) (:func:`score_dtype`) is the best live summed logprob, ``length`` |Y| of the live beams now.

    ``exact``: a continuation finishes with |Y'| in [length+1, limit] and logprob' <= best_live <= 0, so
    its score is at most best_live divided by the largest denominator over that range; the penalties are
    monotone in |Y|, so it sits at an end (alpha >= 0: at the limit, whose denominator is
    ``limit_denominator`` (n,); alpha < 0: at length+1); the max of both ends also covers a logprob
    rounded a hair above 0 (log_softmax of p ~ 1). A sentence at its limit is done whatever this says.
    ``hf``: Hugging Face's default heuristic (early_stopping=False) divides by the denominator at the
    *current* length; with alpha > 0 a longer hypothesis can still beat it, so that rule may stop
    before the best hypothesis is found.
    """
    if stop == "hf":
        return best_live / length_penalty_denominator(length, alpha, kind)
    return torch.maximum(best_live / length_penalty_denominator(length + 1, alpha, kind),
                         best_live / limit_denominator)


@torch.no_grad()
def beam_search(
    model,
    src: Tensor,
    src_mask: Tensor | None = None,
    beam: int = 4,
    alpha: float = 0.6,
    length_penalty: str = "gnmt",
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    nbest: int = 1,
    min_len: int = 0,
    stop: str = "exact",
    bos_id: int = 2,
    eos_id: int = 3,
    pad_id: int = 0,
    no_repeat_ngram: int = 0,
) -> list[list[Hypothesis]]:
    """Batched beam search with a KV cache. src (B, S) ids, src_mask (B, S) bool (default ``src != pad_id``).

    Returns, per sentence, up to ``nbest`` finished :class:`Hypothesis`, best (highest penalized
    score) first. The rules are those of fairseq and Hugging Face, so results can be compared:

    * The encoder runs once; memory, its mask and the cache hold B*N rows, and the cache is reordered
      with ``cache.reorder`` after every step. At the first step only beam 0 of each sentence is live
      (the others start at -inf) so N copies of the same prefix are not expanded.
    * Each step keeps the 2N best (beam, token) candidates by summed logprob. A candidate ending in
      EOS among the first N of them becomes a finished hypothesis (EOS candidates ranked lower are
      dropped); the N best non-EOS candidates are the next live beams. At a sentence's max_len the
      first N candidates are all finalized, EOS or not.
    * Each sentence keeps its N best finished hypotheses by penalized score (see
      :func:`length_penalty_denominator`). It is done when that pool is full and no live beam can
      still beat its worst member, judged by ``stop``:
      ``exact`` (default): a sound upper bound (:func:`_stop_bound`), so the result equals running
      every sentence to max_len; ``hf``: Hugging Face's default (``early_stopping=False``) heuristic,
      for reproducing ``generate(num_beams=N, length_penalty=alpha)`` token for token with
      ``length_penalty='power'``. (HF's ``early_stopping="never"`` with alpha > 0 is sound too and
      returns the same hypotheses as ``exact``.) Done sentences leave the batch.
    * ``no_repeat_ngram`` n > 0: a beam may not repeat one of its own n-grams (its candidates that would
      are set to -inf before the top-k, as fairseq and Hugging Face do).

    Built for a GPU: the finished hypotheses stay on the device (:class:`_Finished`) and the cache is
    written in place, so a step waits for the device once, to learn which sentences are done (n-gram
    blocking adds a transfer of the beams' tokens); the hypotheses come back in one transfer at the end.
    Scores are float32 sums of float32 log-probabilities whatever the model's dtype; penalized scores
    and the stopping bound are float64, as Python floats were (float32 on MPS, which has no float64).
    """
    if length_penalty not in LENGTH_PENALTIES:
        raise ValueError(f"unknown length penalty {length_penalty!r}; expected one of {', '.join(LENGTH_PENALTIES)}")
    if stop not in STOP_RULES:
        raise ValueError(f"unknown stop rule {stop!r}; expected one of {', '.join(STOP_RULES)}")
    if beam < 1 or not 1 <= nbest <= beam:
        raise ValueError(f"need beam >= 1 and 1 <= nbest <= beam (got beam={beam}, nbest={nbest})")
    if src_mask is None:
        src_mask = src != pad_id
    device = src.device
    free_waits, sdt = _waits_are_free(device), score_dtype(device)
    B, N = src.size(0), beam
    limits = max_lengths(model, src_mask, max_len_a, max_len_b)
    memory = model.encode(src, src_mask)  # (B, S, D)
    rows = torch.arange(B, device=device).repeat_interleave(N)
    memory, mem_mask = memory.index_select(0, rows), src_mask.index_select(0, rows)  # (B*N, S, D), (B*N, S)
    cache = _new_cache(model, max(limits))
    tokens = torch.full((B * N, 1), bos_id, dtype=torch.long, device=device)  # (B*N, 1 + t)
    scores = torch.full((B, N), NEG_INF, device=device)  # summed logprob of each live beam
    scores[:, 0] = 0.0
    sent = torch.arange(B, device=device)  # (n,) original sentence of each live group of N rows
    limit = torch.tensor(limits, device=device)  # (n,) step limits
    limit_den = torch.tensor([length_penalty_denominator(m, alpha, length_penalty) for m in limits],
                             dtype=sdt, device=device)  # (n,) their length-penalty denominators
    finished = _Finished(B, N, max(limits), device)
    beams = torch.arange(N, device=device)
    offsets = torch.arange(B, device=device)[:, None] * N  # (B, 1) first row of each group; live rows are 0..n-1
    t = 0  # tokens produced so far by every live beam
    while True:
        n = scores.size(0)
        logits = model.decode(tokens[:, -1:], memory, mem_mask, cache)[:, -1]  # (n*N, V)
        lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        if t < min_len:
            lprobs[:, eos_id] = NEG_INF
        if no_repeat_ngram > 0:
            _ban_ngrams(lprobs, tokens[:, 1:], no_repeat_ngram)
        V = lprobs.size(-1)
        cand = (scores.unsqueeze(-1) + lprobs.view(n, N, V)).view(n, N * V)
        top_lp, top_idx = cand.topk(min(2 * N, N * V), dim=-1)  # (n, 2N), best first
        top_beam, top_tok = top_idx // V, top_idx % V
        length = t + 1  # |Y| of every candidate of this step
        is_eos = top_tok == eos_id
        at_limit = limit <= length  # (n,)

        # Finished hypotheses: EOS among the first N candidates, or all first N at the limit.
        lp, eos = top_lp[:, :N], is_eos[:, :N]
        new = (eos | at_limit[:, None]) & (lp > NEG_INF)
        if not free_waits or bool(new.any()):  # skip the merge when nothing finished, if asking is free
            den = length_penalty_denominator(length, alpha, length_penalty)
            penalized = (lp.to(sdt) / den).masked_fill(~new, NEG_INF)
            prefix = tokens[:, 1:].view(n, N, t).gather(1, top_beam[:, :N, None].expand(n, N, t))  # (n, N, t)
            finished.offer(penalized, lp, torch.cat([prefix, top_tok[:, :N, None]], 2), t + (~eos).long())

        # Next live beams: the N best non-EOS candidates (a stable sort keeps the topk order).
        live_lp = top_lp.masked_fill(is_eos, NEG_INF)
        order = live_lp.sort(dim=-1, descending=True, stable=True).indices[:, :N]  # (n, N)
        new_scores = live_lp.gather(1, order)
        src_rows = offsets[:n] + top_beam.gather(1, order)  # (n, N)
        new_tok = top_tok.gather(1, order)

        best_live = new_scores[:, 0]
        bound = _stop_bound(best_live.to(sdt), length, limit_den, alpha, length_penalty, stop)
        # done: at the limit, no live beam can produce anything finite, or none can beat a full pool
        done = at_limit | (best_live == NEG_INF) | ((finished.worst > NEG_INF) & (bound <= finished.worst))
        keep = (~done).nonzero().squeeze(1)  # (n',) the step's one wait for the device
        if keep.numel() < n:
            finished.save_and_keep(sent, keep)
            if keep.numel() == 0:
                break
            src_rows, new_tok, new_scores = src_rows[keep], new_tok[keep], new_scores[keep]
            sent, limit, limit_den = sent[keep], limit[keep], limit_den[keep]
            # Memory and cross-attention K/V are the same for every beam of a sentence: select them only
            # when a sentence leaves the batch, not on every step's beam reorder.
            sent_rows = (keep[:, None] * N + beams).reshape(-1)
            cache.reorder_cross(sent_rows)
            memory, mem_mask = memory[sent_rows], mem_mask[sent_rows]
        next_rows = src_rows.reshape(-1)  # (n'*N,) beam reorder and dropped sentences
        cache.reorder(next_rows, cross=False)
        tokens = torch.cat([tokens[next_rows], new_tok.reshape(-1, 1)], dim=1)
        scores = new_scores
        t += 1
    return finished.hypotheses(nbest)


# Sampling --------------------------------------------------------------------------------------------


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
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def _pick(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, gen) -> int:
    """One token id from logits (V,)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = filter_top_p(filter_top_k(logits.float() / temperature, top_k), top_p)
    return int(torch.multinomial(logits.softmax(dim=-1), 1, generator=gen))


def _device(model) -> torch.device:
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def sample(
    model,
    prompt: Sequence[int] | Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    context_limit: int | None = None,
    no_repeat_ngram: int = 0,
) -> Iterator[int]:
    """Stream up to ``max_new_tokens`` ids from a language model, one at a time, after ``prompt``
    (a list of ids, a (T,) or a (1, T) tensor; not empty: start it with BOS if the model expects one).

    ``temperature`` 0 is greedy (argmax); otherwise logits / temperature, then top-k, then top-p
    (nucleus) filtering, then a draw with a ``torch.Generator`` seeded by ``seed`` (None: torch's
    global RNG). Generation stops after ``eos_id``, which is not yielded. The prompt is prefilled in
    one call, then one token per step with the cache. The model sees at most ``context_limit`` tokens
    (default: its ``cfg.max_positions``); once the text is longer, each step re-decodes the last
    ``context_limit`` tokens without a cache (absolute positions cannot slide inside a cache), as
    nanoGPT does. ``no_repeat_ngram`` n > 0 forbids repeating an n-gram of the generated tokens (the
    prompt may be copied from freely).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = _device(model)
    tokens = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(1, -1)  # (1, T)
    if tokens.size(1) == 0:
        raise ValueError("sample needs a non-empty prompt (e.g. [bos_id])")
    if context_limit is None:
        context_limit = getattr(getattr(model, "cfg", None), "max_positions", None)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    steps = tokens.size(1) + max_new_tokens
    cache = _new_cache(model, min(steps, context_limit or steps)) if use_cache else None
    pending = tokens  # (1, t): tokens the cache has not seen yet
    cached = 0
    produced: list[int] = []
    for _ in range(max_new_tokens):
        if cache is not None and context_limit is not None and cached + pending.size(1) > context_limit:
            cache = None  # past the position table: from here on, slide a window
        if cache is not None:
            logits = model.decode(pending, None, None, cache)[0, -1]  # (V,)
            cached += pending.size(1)
        else:
            window = tokens if context_limit is None else tokens[:, -context_limit:]
            logits = model.decode(window, None, None, None)[0, -1]
        banned = repeated_ngram_bans(produced, no_repeat_ngram)  # [] at once when blocking is off
        if banned:
            logits = logits.float().index_fill(0, torch.tensor(banned, device=device), NEG_INF)
        tok = _pick(logits, temperature, top_k, top_p, gen)
        if eos_id is not None and tok == eos_id:
            return
        yield tok
        produced.append(tok)
        pending = torch.tensor([[tok]], dtype=torch.long, device=device)
        tokens = torch.cat([tokens, pending], dim=1)


def sample_list(model, prompt: Sequence[int] | Tensor, max_new_tokens: int, **kwargs) -> list[int]:
    """:func:`sample` collected into a list (same arguments)."""
    return list(sample(model, prompt, max_new_tokens, **kwargs))


@torch.no_grad()
def sample_search(
    model,
    src: Tensor,
    src_mask: Tensor | None = None,
    nbest: int = 1,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    alpha: float = 0.6,
    length_penalty: str = "gnmt",
    max_len_a: float = 1.0,
    max_len_b: float = 50,
    min_len: int = 0,
    bos_id: int = 2,
    eos_id: int = 3,
    pad_id: int = 0,
    no_repeat_ngram: int = 0,
) -> list[list[Hypothesis]]:
    """Sampling for an encoder-decoder: ``nbest`` independent draws per sentence, best score first.

    src (B, S) ids, src_mask (B, S) bool. Each step draws from softmax(logits / temperature) after top-k
    then top-p filtering (temperature 0: argmax, so nbest draws are equal); EOS is forbidden before
    ``min_len`` tokens and n-grams are blocked as in :func:`greedy_search`. One ``torch.Generator``
    seeded by ``seed`` serves the whole call (None: torch's global RNG), so the same inputs in the same
    batch give the same draws. ``logprob`` sums the model's own log-probabilities (temperature 1, no
    filtering) of the drawn tokens, EOS included, and ``score`` is it length-penalized as in beam search.
    """
    if temperature < 0 or nbest < 1:
        raise ValueError(f"need temperature >= 0 and nbest >= 1 (got {temperature}, {nbest})")
    if src_mask is None:
        src_mask = src != pad_id
    device = src.device
    limits = max_lengths(model, src_mask, max_len_a, max_len_b)
    rows = torch.arange(src.size(0), device=device).repeat_interleave(nbest)  # draw j of sentence i: i*nbest + j
    mem_mask = src_mask.index_select(0, rows)
    memory = model.encode(src, src_mask).index_select(0, rows)  # (B*nbest, S, D)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    R = rows.numel()
    live = list(range(R))  # original row of each live row
    tokens = torch.full((R, 1), bos_id, dtype=torch.long, device=device)  # (R', 1 + t)
    logprob = torch.zeros(R, device=device)  # (R',) summed log-probabilities of the live rows
    cache = _new_cache(model, max(limits))
    found: list[Hypothesis | None] = [None] * R
    t = 0
    while live:
        logits = model.decode(tokens[:, -1:], memory, mem_mask, cache)[:, -1].float()  # (R', V)
        if t < min_len:
            logits[:, eos_id] = NEG_INF
        if no_repeat_ngram > 0:
            _ban_ngrams(logits, tokens[:, 1:], no_repeat_ngram)
        lprobs = torch.log_softmax(logits, dim=-1)
        if temperature == 0:
            nxt = logits.argmax(dim=-1)
        else:
            filtered = filter_top_p(filter_top_k(logits / temperature, top_k), top_p)
            nxt = torch.multinomial(filtered.softmax(dim=-1), 1, generator=gen).squeeze(1)  # (R',)
        logprob = logprob + lprobs.gather(1, nxt[:, None]).squeeze(1)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        ended, lp = (nxt == eos_id).tolist(), logprob.tolist()
        keep = []
        for i, r in enumerate(live):
            if ended[i] or t + 1 >= limits[r // nbest]:
                seq = tokens[i, 1:].tolist()
                seq = seq[:-1] if ended[i] else seq
                found[r] = Hypothesis(seq, penalized_score(lp[i], t + 1, alpha, length_penalty), lp[i])
            else:
                keep.append(i)
        if len(keep) < len(live):
            if not keep:
                break
            idx = torch.tensor(keep, dtype=torch.long, device=device)
            tokens, memory, mem_mask, logprob = tokens[idx], memory[idx], mem_mask[idx], logprob[idx]
            cache.reorder(idx)
            live = [live[i] for i in keep]
        t += 1
    out = []
    for i in range(src.size(0)):
        draws = [h for h in found[i * nbest:(i + 1) * nbest] if h is not None]
        out.append(sorted(draws, key=lambda h: -h.score))  # stable: equal scores keep draw order
    return out
