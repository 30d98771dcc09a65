"""Validation during training: the loss and perplexity of the validation batches (:func:`evaluate_loss`), and
the scores a run's task adds beside them (:data:`VALID_SCORES`, named by ``Task.valid_scores`` and
``Task.weights_scores``): BLEU (``train.eval_bleu``) from greedy decoding of the validation sources
(:func:`validation_bleu_fn`). What the choice of a run's inference weights compares: :class:`WeightsScores`.

BLEU decodes through the id-level :func:`aiayn.search.decode_ids`, exactly as ``aiayn translate --beam 1`` does
(the same batches, the run's length limits, ``min_len``, n-gram blocking and banned ids, the tokenizer's
special ids), so the BLEU the training reports is the BLEU of the translations a user gets from that run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sacrebleu.metrics import BLEU
from torch import nn

import aiayn.engine as engine
from aiayn.config import Config, DecodeOptions
from aiayn.data.batching import Batch
from aiayn.data.tokenizer import TokenizerPair
from aiayn.device import inference_precision, model_device
from aiayn.search import SearchSpec, decode_ids
from aiayn.train.loss import label_smoothed_cross_entropy
from aiayn.train.parallel import Dist
from aiayn.train.update import batch_logits, batch_to_device


@torch.no_grad()
def evaluate_loss(
    model: nn.Module, batches: Sequence[Batch], label_smoothing: float, pad_id: int = 0,
    dist_info: Dist | None = None, autocast=None,
) -> dict[str, float]:
    """Validation loss, NLL per token and perplexity (exp of NLL per token), sharded over processes."""
    d = dist_info or Dist()
    device = model_device(model)
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, device=device)  # loss, nll: read once at the end
    tokens = 0
    for batch in batches[d.rank :: d.world]:
        batch = batch_to_device(batch, device)
        with autocast or contextlib.nullcontext():
            logits = batch_logits(model, batch)
        sums += torch.stack(label_smoothed_cross_entropy(logits, batch.tgt_out, label_smoothing, pad_id))
        tokens += batch.ntokens
    model.train(was_training)
    loss, nll = d.all_reduce_sum(sums).tolist()
    (tokens,) = d.sum([tokens], device)
    per_tok = nll / max(tokens, 1)
    return {"valid_loss": loss / max(tokens, 1), "valid_nll": per_tok, "valid_ppl": math.exp(min(per_tok, 50))}


def validation_bleu_fn(cfg: Config, data: Any, tokenizers: TokenizerPair, search: DecodeOptions | None = None
                       ) -> Callable[..., dict[str, float]]:
    """A function ``(model, dist=None) -> {"valid_bleu": sacreBLEU}`` that decodes ``data.valid_src`` (id lists
    without specials) greedily, or by ``search`` (e.g. the recipe's beam: the averaging choice, what the user's
    translations get), and scores the detokenized output against the decoded ``data.valid_tgt``. With a
    :class:`~aiayn.train.parallel.Dist` of several processes each decodes every world-th sentence and the
    hypotheses are gathered, so no process waits on the others inside a collective while one decodes them all
    (every process gets the score). The model is put in eval mode for the decoding and returned to its previous
    mode; the caller's autocast applies."""
    options = search if search is not None else cfg.decode.replace(beam=1, sample=False)
    spec = SearchSpec(options.replace(nbest=1), tokenizers.specials)
    limit = max(1, cfg.model.max_positions - 1)
    sources = [list(s)[:limit] for s in data.valid_src]
    refs = [tokenizers.tgt.decode(t) for t in data.valid_tgt]

    def valid_bleu(model: nn.Module, dist: Dist | None = None) -> dict[str, float]:
        d = dist or Dist()
        rank, world = d.rank, d.world
        was_training = model.training
        model.eval()
        try:
            found = decode_ids(model, sources[rank::world], spec, scores=False)
        finally:
            model.train(was_training)
        mine = [tokenizers.tgt.text(h[0].tokens) for h in found]  # as translate() gives them
        hyps: list[str] = [""] * len(sources)
        for r, part in enumerate(d.gather_objects(mine)):  # every process's share, back in order
            hyps[r::world] = part
        return {"valid_bleu": BLEU().corpus_score(hyps, [refs]).score}

    return valid_bleu



@dataclass(frozen=True)
class ValidScore:
    """A score a task's validation adds beside NLL: ``build(cfg, data, tokenizers, search)`` makes, once per
    training, a function ``(model, dist=None) -> {name: value}``; ``words``: how a log line names it."""

    build: Callable[..., Callable[..., dict[str, float]]]
    words: str


# By the names tasks give them (:attr:`aiayn.task.Task.valid_scores`, :attr:`aiayn.task.Task.weights_scores`).
VALID_SCORES: dict[str, ValidScore] = {"bleu": ValidScore(validation_bleu_fn, "BLEU by the recipe's search")}


def validation_scores(cfg: Config, data: Any, tokenizers: TokenizerPair, names: Sequence[str],
                      search: DecodeOptions | None = None) -> Callable[..., dict[str, float]] | None:
    """One function ``(model, dist=None) -> {score: value}`` of the scores ``names`` (:data:`VALID_SCORES`, built
    now: the validation set's sources and references read once); None when ``names`` is empty."""
    scorers = [VALID_SCORES[n].build(cfg, data, tokenizers, search) for n in names]
    if not scorers:
        return None

    def scores(model: nn.Module, dist: Dist | None = None) -> dict[str, float]:
        return {k: v for scorer in scorers for k, v in scorer(model, dist).items()}

    return scores


class WeightsScores:
    """The scores the choice of a run's inference weights compares (:class:`aiayn.run.inference_weights.Scores`):
    the validation NLL of a model's weights (``validation``: :func:`evaluate_loss` under the training's autocast),
    and for a translation run the validation BLEU of their translations by the recipe's own search (``decode``: what
    the user's translations get; greedy BLEU, the training's, disagreed with beam search on runs cut early: an
    average that wins greedy can write too short beam output), greedy for a recipe that samples."""

    def __init__(self, cfg: Config, run_dir: Path, data: Any, d: Dist,
                 validation: Callable[[nn.Module, Dist], dict[str, float]]) -> None:
        self.cfg, self.run_dir, self.data, self.d, self.validation = cfg, run_dir, data, d, validation
        self._built: dict[str, Callable[..., dict[str, float]]] = {}  # built when needed, once each

    @property
    def words(self) -> str:
        """What the scores are, for the log: ``validation NLL and BLEU by the recipe's search``."""
        return " and ".join(["validation NLL", *(VALID_SCORES[n].words for n in self.cfg.kind.weights_scores)])

    def __call__(self, model: nn.Module) -> dict[str, float]:
        scores = {"valid_nll": self.validation(model, self.d)["valid_nll"]}
        for name in self.cfg.kind.weights_scores:  # what the run's task weighs beside NLL (a translation: BLEU)
            if name not in self._built:  # built once: the sources and references of the validation set
                tokenizers = TokenizerPair.load(self.run_dir / "tokenizer")
                search = None if self.cfg.decode.sample else self.cfg.decode
                self._built[name] = VALID_SCORES[name].build(self.cfg, self.data, tokenizers, search)
            device = self.d.device
            with engine.kernels(device, inference_precision(device)):  # as aiayn translate decodes
                scores.update(self._built[name](model, self.d))
        return scores
