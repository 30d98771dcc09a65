"""Validation BLEU during training (``train.eval_bleu``): greedy decoding of the validation sources.

It decodes through the id-level :func:`aiayn.search.decode_ids`, exactly as ``aiayn translate --beam 1`` does
(the same batches, the run's length limits, ``min_len``, n-gram blocking and banned ids, the tokenizer's
special ids), so the BLEU the training reports is the BLEU of the translations a user gets from that run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sacrebleu.metrics import BLEU

from aiayn.config import Config
from aiayn.data.tokenizer import TokenizerPair
from aiayn.search import SearchSpec, decode_ids


def validation_bleu_fn(cfg: Config, data: Any, tokenizers: TokenizerPair) -> Callable[[Any], dict[str, float]]:
    """A function model -> {"valid_bleu": sacreBLEU} that greedy-decodes ``data.valid_src`` (id lists without
    specials) and scores the detokenized output against the decoded ``data.valid_tgt``. The model is put in
    eval mode for the decoding and returned to its previous mode."""
    spec = SearchSpec(cfg.decode.replace(beam=1, nbest=1, sample=False), tokenizers.specials)
    limit = max(1, cfg.model.max_positions - 1)
    sources = [list(s)[:limit] for s in data.valid_src]
    refs = [tokenizers.tgt.decode(t) for t in data.valid_tgt]

    def valid_bleu(model) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            found = decode_ids(model, sources, spec, scores=False)
        finally:
            model.train(was_training)
        hyps = [tokenizers.tgt.decode(h[0].tokens) for h in found]
        return {"valid_bleu": BLEU().corpus_score(hyps, [refs]).score}

    return valid_bleu
