"""Validation BLEU during training (``train.eval_bleu``): greedy decoding of the validation sources.

It lives beside the trainer and uses only the id-level search (:mod:`aiayn.decode.search`, which knows
nothing of runs or text), so training does not depend on the inference layers above it. It decodes
exactly as ``Translator.translate(..., beam=1)`` does: length-sorted batches within the run's decoding
token budget, the run's length limits, the tokenizer's special ids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sacrebleu.metrics import BLEU

from aiayn.config import Config
from aiayn.data.batching import pad_batch, token_batches
from aiayn.data.tokenizer import TokenizerPair
from aiayn.decode.search import BannedTokens, greedy_search


def validation_bleu_fn(cfg: Config, data: Any, tokenizers: TokenizerPair) -> Callable[[Any], dict[str, float]]:
    """A function model -> {"valid_bleu": sacreBLEU} that greedy-decodes ``data.valid_src`` (id lists without
    specials) and scores the detokenized output against the decoded ``data.valid_tgt``. The model is put in
    eval mode for the decoding and returned to its previous mode."""
    dec, sp = cfg.decode, tokenizers.specials
    limit = max(1, cfg.model.max_positions - 1)
    sources = [list(s)[:limit] for s in data.valid_src]
    refs = [tokenizers.tgt.decode(t) for t in data.valid_tgt]

    def valid_bleu(model) -> dict[str, float]:
        device = next(model.parameters()).device
        found: list[list[int]] = [[] for _ in sources]
        was_training = model.training
        model.eval()
        searched = BannedTokens(model, [sp.pad]) if dec.ban_pad else model
        try:
            for idx in token_batches([len(s) for s in sources], None, dec.batch_tokens(device.type), shuffle=False):
                src = pad_batch([sources[i] + [sp.eos] for i in idx], sp.pad).to(device)
                out = greedy_search(searched, src, src != sp.pad, max_len_a=dec.max_len_a, max_len_b=dec.max_len_b,
                                    bos_id=sp.decoder_start, eos_id=sp.eos, pad_id=sp.pad)
                for i, toks in zip(idx, out):
                    found[i] = toks
        finally:
            model.train(was_training)
        hyps = [tokenizers.tgt.decode(t) for t in found]
        return {"valid_bleu": BLEU().corpus_score(hyps, [refs]).score}

    return valid_bleu
