"""A language model's log-probabilities of given tokens, teacher-forced in one pass: what OpenAI's legacy
completions return as ``logprobs`` (with ``echo``, the prompt's too), and what lm-evaluation-harness sums for its
loglikelihood tasks.

Shapes: T tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiayn.config import DecodeOptions
from aiayn.decode.generate import TextStream, lm_context
from aiayn.device import model_device
from aiayn.engine import kernels
from aiayn.errors import ConfigError
from aiayn.run.directory import Run
from aiayn.search import SearchSpec, strategy_for


@dataclass
class TokenScores:
    """``ids`` with, per position, the model's log-probability of that id given the ids before it (None for the
    first: nothing predicts it) and the ``top`` most likely ids there with theirs (None for the first)."""

    ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


# Padded positions (rows x the longest row) of one scoring pass: its logits are that many rows of V floats.
SCORE_TOKENS = 4096


@torch.no_grad()
def score_many(run: Run, seqs: Sequence[Sequence[int]], top: int = 0) -> list[TokenScores]:
    """For each of ``seqs``: the log-softmax of the model's logits (temperature 1, nothing filtered) at each id
    given the ids before it, and the ``top`` most likely ids there. Each sequence must fit the model's context (no
    sliding window: a window would change what each token is conditioned on). Several sequences per forward pass:
    rows sorted by length and right-padded, at most :data:`SCORE_TOKENS` padded positions a pass. The model is
    causal, so a row's padding comes after everything its positions read: each score is the row's own, up to
    float rounding (other matmul shapes)."""
    seqs = [[int(i) for i in ids] for ids in seqs]
    ctx = lm_context(run.cfg)
    for ids in seqs:
        if not 0 < len(ids) <= ctx:
            raise ConfigError(f"{len(ids)} tokens to score: the model reads 1 to {ctx} at once (its training block)")
    out: list[TokenScores | None] = [None] * len(seqs)
    group: list[int] = []
    for k in sorted(range(len(seqs)), key=lambda k: len(seqs[k])):
        if group and (len(group) + 1) * len(seqs[k]) > SCORE_TOKENS:
            _score_rows(run, seqs, group, top, out)
            group = []
        group.append(k)
    if group:
        _score_rows(run, seqs, group, top, out)
    return out  # type: ignore[return-value]  (every index was filled)


def _score_rows(run: Run, seqs: list[list[int]], rows: list[int], top: int, out: list) -> None:
    """One forward pass over ``seqs[k]`` for k in ``rows`` (shortest first), right-padded to the longest (B, T)."""
    device = model_device(run.model)
    longest = len(seqs[rows[-1]])
    batch = torch.full((len(rows), longest), run.tokenizers.specials.pad, dtype=torch.long)
    for b, k in enumerate(rows):
        batch[b, :len(seqs[k])] = torch.tensor(seqs[k])
    with kernels(device, run.precision):
        logits = run.model(batch.to(device))  # (B, T, V): row t predicts the id at t + 1
    for b, k in enumerate(rows):
        ids = seqs[k]
        logp = logits[b, :len(ids) - 1].float().log_softmax(dim=-1).cpu()  # (T_k - 1, V)
        chosen = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        best: list = [[] for _ in chosen]
        if top > 0 and chosen:
            values, index = logp.topk(min(top, logp.size(1)), dim=-1)  # (T_k - 1, top)
            best = [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
        out[k] = TokenScores(ids, [None, *chosen], [None, *best])


def continue_ids(run: Run, ids: Sequence[int], opts: DecodeOptions, max_new_tokens: int) -> list[int]:
    """Up to ``max_new_tokens`` ids after ``ids`` by the stream of ``opts``' strategy (:func:`aiayn.search.sample`:
    ``opts``' sampling, or greedy), EOS included when the model ends with it: a client that scores "the next
    token" gets one, whichever it is."""
    if max_new_tokens == 0:
        return []
    spec = SearchSpec(opts, run.tokenizers.specials)
    with kernels(model_device(run.model), run.precision):
        new = list(strategy_for(opts).stream(run.model, list(ids), spec, max_new_tokens, lm_context(run.cfg)))
    return new + [spec.eos] if len(new) < max_new_tokens else new  # sample() stops at EOS without giving it


def token_texts(run: Run, ids: Sequence[int]) -> tuple[list[str], list[int], str]:
    """(each id's text, where it starts in the whole text, the whole text) of ``ids`` decoded together: the texts
    join to the whole text, except an id that adds no text of its own (a special id, a byte of an unfinished
    character), which is named by its piece and adds nothing."""
    tok = run.tokenizers.src
    stream, shown = TextStream(tok), ""
    texts, offsets = [], []
    for i in ids:
        offsets.append(len(shown))
        piece = stream.add(int(i))
        shown += piece
        texts.append(piece or tok.id_to_piece(int(i)))
    return texts, offsets, shown + stream.finish()
