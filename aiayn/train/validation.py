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


def validation_bleu_fn(cfg: Config, data: Any, tokenizers: TokenizerPair
                       ) -> Callable[..., dict[str, float]]:
    """A function ``(model, dist=None) -> {"valid_bleu": sacreBLEU}`` that greedy-decodes ``data.valid_src`` (id
    lists without specials) and scores the detokenized output against the decoded ``data.valid_tgt``. With a
    :class:`~aiayn.train.trainer.Dist` of several processes each decodes every world-th sentence and the
    hypotheses are gathered, so no process waits on the others inside a collective while one decodes them all
    (every process gets the score). The model is put in eval mode for the decoding and returned to its previous
    mode; the caller's autocast applies."""
    spec = SearchSpec(cfg.decode.replace(beam=1, nbest=1, sample=False), tokenizers.specials)
    limit = max(1, cfg.model.max_positions - 1)
    sources = [list(s)[:limit] for s in data.valid_src]
    refs = [tokenizers.tgt.decode(t) for t in data.valid_tgt]

    def valid_bleu(model, dist: Any = None) -> dict[str, float]:
        rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
        was_training = model.training
        model.eval()
        try:
            found = decode_ids(model, sources[rank::world], spec, scores=False)
        finally:
            model.train(was_training)
        mine = [tokenizers.tgt.text(h[0].tokens) for h in found]  # as translate() gives them
        hyps = mine if world == 1 else _gather_strided(mine, world, len(sources))
        return {"valid_bleu": BLEU().corpus_score(hyps, [refs]).score}

    return valid_bleu


def _gather_strided(mine: list[str], world: int, n: int) -> list[str]:
    """Every process's ``items[rank::world]`` put back in order on every process (one all-gather)."""
    import torch.distributed as dist

    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    out: list[str] = [""] * n
    for rank, part in enumerate(parts):
        out[rank::world] = part
    return out
