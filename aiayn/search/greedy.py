"""Greedy (argmax) decoding, and the teacher-forced scores of found outputs.

Shapes: B batch, S source length, T target length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from aiayn.config import DecodeOptions
from aiayn.search.common import new_cache, pad_rows, penalized_score
from aiayn.search.processing import LogitsProcessor
from aiayn.search.sampling import SampledStream
from aiayn.search.spec import SearchSpec, max_lengths
from aiayn.search.strategy import Hypothesis, Strategy


@torch.no_grad()
def greedy_search(model: nn.Module, src: Tensor, src_mask: Tensor | None = None, spec: SearchSpec = SearchSpec(),
                  use_cache: bool = True) -> list[list[int]]:
    """Argmax decoding. src (B, S) ids, src_mask (B, S) bool (default ``src != spec.pad``).

    Returns one token list per sentence, without BOS and EOS. Sentences that end drop out of the batch (their
    rows are removed from the cache), so the remaining steps cost only the live rows. Each step waits for the
    device once, to learn which rows ended; outputs stay on the device until the end. ``use_cache=False``
    re-decodes the whole prefix at every step (the reference for cache tests). The spec's ``min_len``,
    ``no_repeat_ngram`` and banned ids apply (:class:`~aiayn.search.processing.LogitsProcessor`).
    """
    if src_mask is None:
        src_mask = src != spec.pad
    device = src.device
    process = LogitsProcessor(spec, device)
    limits = max_lengths(model, src_mask, spec)
    memory = model.encode(src, src_mask)  # (B, S, D)
    mem_mask = src_mask
    B, steps = src.size(0), max(limits)
    sent = torch.arange(B, device=device)  # original sentence of each live row
    limit = torch.tensor(limits, device=device)  # (B',) step limit of each live row
    tokens = torch.full((B, 1), spec.bos, dtype=torch.long, device=device)  # (B', 1 + t)
    cache = new_cache(model, steps) if use_cache else None
    out = torch.zeros(B, steps, dtype=torch.long, device=device)  # (B, steps) tokens of ended sentences
    out_len = torch.zeros(B, dtype=torch.long, device=device)
    t = 0  # tokens produced so far by every live row
    while True:
        spec.check_stop()
        inp = tokens[:, -1:] if cache is not None else tokens
        logits = process.ban(model.decode(inp, memory, mem_mask, cache)[:, -1]).float()  # (B', V)
        nxt = process.constrain(logits, tokens[:, 1:], t).argmax(dim=-1)  # (B',)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        ended = nxt == spec.eos
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


@torch.no_grad()
def score_tokens(model: nn.Module, src: Tensor, src_mask: Tensor, found: Sequence[Sequence[int]],
                 spec: SearchSpec) -> list[Hypothesis]:
    """Teacher-forced log-probabilities of found outputs (e.g. greedy search's, which tracks none): src (B, S)
    ids, src_mask (B, S) bool, ``found`` token lists without BOS/EOS; scored with the spec's length penalty,
    banned ids renormalized away as in the search.

    A sentence shorter than its step limit ended with EOS (counted in the logprob and in |Y|); one of exactly
    its limit was cut there (see :mod:`aiayn.search`)."""
    o, device = spec.options, src.device
    limits = max_lengths(model, src_mask, spec)
    seqs = [list(t) + [spec.eos] if len(t) < lim else list(t) for t, lim in zip(found, limits)]
    width = max(len(q) for q in seqs)
    tgt_in = pad_rows([[spec.bos] + q[:-1] for q in seqs], spec.pad).to(device)  # (B, T)
    tgt_out = pad_rows(seqs, spec.pad).to(device)  # (B, T)
    memory = model.encode(src, src_mask)
    logits = LogitsProcessor(spec, device).ban(model.decode(tgt_in, memory, src_mask))
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    tok_lp = lprobs.gather(2, tgt_out.unsqueeze(-1)).squeeze(-1)  # (B, T)
    lengths = torch.tensor([len(q) for q in seqs], device=device)
    real = torch.arange(width, device=device)[None, :] < lengths[:, None]  # (B, T)
    sums = tok_lp.masked_fill(~real, 0.0).sum(dim=1).tolist()
    return [Hypothesis(list(t), penalized_score(lp, len(q), o.alpha, o.length_penalty), lp)
            for t, q, lp in zip(found, seqs, sums)]


class Greedy(SampledStream, Strategy):
    """Beam 1 without sampling (nbest is then 1: DecodeOptions allows no more hypotheses than the beam): argmax,
    its score and logprob from a teacher-forced pass when asked for (else NaN)."""

    name = "greedy"

    def chosen(self, options: DecodeOptions) -> bool:
        return not options.sample and options.beam == 1

    def rows(self, options: DecodeOptions) -> int:
        return 1

    def search(self, model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec, scores: bool
               ) -> list[list[Hypothesis]]:
        found = greedy_search(model, src, src_mask, spec)
        if not scores:
            return [[Hypothesis(t, float("nan"), float("nan"))] for t in found]
        return [[h] for h in score_tokens(model, src, src_mask, found, spec)]
