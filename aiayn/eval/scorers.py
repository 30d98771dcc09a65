"""Scorers of decoded text against references: sacreBLEU, chrF, lowercased-tokenized BLEU, ROUGE, perplexity.
Thin wrappers, no own BLEU.

* :func:`sacrebleu_scores`: sacreBLEU's BLEU (default 13a tokenization, cased) and chrF (chrF2) on
  detokenized text, with their signatures: the numbers to compare across papers and toolkits.
* :func:`bleu_lc_tok`: the Multi30k literature's BLEU. Its reference files (``tok/``) are lowercased
  Moses tokens, and papers score lowercased Moses-tokenized output against them with
  ``multi-bleu.perl``. We lowercase hypotheses and references, Moses-tokenize them with sacremoses (in
  the target language) and score with sacreBLEU's ``tokenize='none'``. It is usually a few points
  above sacreBLEU: always report it under its own name.
* :func:`rouge_scores`: ROUGE-1/2/L F1 of the ``rouge-score`` package with Porter stemming (as the
  summarization literature reports it), averaged over sentences, in percent.
* :func:`perplexity`: exp of the mean negative log-likelihood per token (nats).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from sacrebleu.metrics import BLEU, CHRF

BLEU_LC_TOK_DESCRIPTION = (
    "BLEU of lowercased, Moses-tokenized hypotheses and references (sacremoses, lang={lang}) scored by "
    "sacreBLEU with tokenize=none, as the Multi30k literature scores (multi-bleu.perl on tok/ files); "
    "not comparable with sacreBLEU"
)


def _check(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")


def sacrebleu_scores(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU (13a, cased) and chrF of detokenized text, one reference per hypothesis.

    Returns ``{"bleu", "chrf", "bleu_signature", "chrf_signature", "bleu_detail"}``; scores in percent.
    """
    _check(hyps, refs)
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(list(hyps), [list(refs)])
    c = chrf.corpus_score(list(hyps), [list(refs)])
    return {
        "bleu": b.score,
        "chrf": c.score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_detail": str(b),  # n-gram precisions, brevity penalty, lengths
    }


def lowercase_moses(texts: Sequence[str], lang: str) -> list[str]:
    """Lowercase, then Moses-tokenize (sacremoses, no XML escaping) each text."""
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(t.lower(), escape=False, return_str=True) for t in texts]


class LcTokBleu(NamedTuple):
    """What :func:`bleu_lc_tok` returns."""

    score: float
    description: str  # the procedure, ending with sacreBLEU's signature (tok:none)
    detail: str  # sacreBLEU's breakdown: n-gram precisions, brevity penalty, lengths (as multi-bleu prints)


def bleu_lc_tok(hyps: Sequence[str], refs: Sequence[str], lang: str) -> LcTokBleu:
    """(score, description, detail) of BLEU on lowercased, Moses-tokenized text (see the module docstring).

    Escaping (``&apos;`` etc.) does not change the score, as it maps tokens to tokens one to one.
    """
    _check(hyps, refs)
    bleu = BLEU(tokenize="none", force=True)  # force: the input is tokenized on purpose
    res = bleu.corpus_score(lowercase_moses(hyps, lang), [lowercase_moses(refs, lang)])
    return LcTokBleu(res.score, f"{BLEU_LC_TOK_DESCRIPTION.format(lang=lang)}; {bleu.get_signature()}", str(res))


def rouge_scores(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1, ROUGE-2 and ROUGE-L F1 (in percent) over hypothesis/reference pairs.

    Uses Google's ``rouge-score`` package with its default tokenizer (lowercased, non-alphanumeric
    characters removed) and Porter stemming (``use_stemmer=True``), as XSum/CNN-DM papers report.
    """
    from rouge_score import rouge_scorer

    _check(hyps, refs)
    keys = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(keys), use_stemmer=True)
    totals = dict.fromkeys(keys, 0.0)
    for h, r in zip(hyps, refs):
        s = scorer.score(r, h)  # score(target, prediction)
        for k in keys:
            totals[k] += s[k].fmeasure
    n = max(len(hyps), 1)
    return {k: 100.0 * v / n for k, v in totals.items()}


def perplexity(nll_per_token: float) -> float:
    """exp(mean negative log-likelihood per token, in nats); inf when that overflows."""
    try:
        return math.exp(nll_per_token)
    except OverflowError:
        return math.inf
