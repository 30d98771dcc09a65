"""Texts translated as Argos Translate (and LibreTranslate on it) translates them: each text read as paragraphs of
sentences (:func:`~aiayn.interop.sentence_splitter.argos_paragraphs`, the splitter an Argos package of the run
ships), every sentence translated alone, and the translations joined as Argos joins them. ``aiayn translate
--split-sentences`` (:class:`SentenceTranslator`) and ``aiayn serve``'s LibreTranslate routes both work so."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from aiayn.config import DecodeOptions
from aiayn.decode.loaded import text_list
from aiayn.decode.translator import Translation, Translator
from aiayn.interop.sentence_splitter import argos_join, argos_paragraphs

T = TypeVar("T")
Plan = list[list[str]]  # a text's paragraphs, each its sentences


def plan_texts(texts: Sequence[str]) -> tuple[list[Plan], list[str]]:
    """Each text's plan (paragraphs of sentences) and every sentence of all texts in order: what to translate."""
    plans = [argos_paragraphs(t) for t in texts]
    return plans, [s for plan in plans for p in plan for s in p]


def regroup(plans: list[Plan], found: Sequence[T]) -> list[list[list[T]]]:
    """``found`` (one item per sentence, in the order of :func:`plan_texts`) grouped back: per text, per
    paragraph, its sentences' items."""
    it = iter(found)
    return [[[next(it) for _ in p] for p in plan] for plan in plans]


def joined(grouped: list[list[list[T]]], n: int, text: Callable[[T], str]) -> list[str]:
    """The k-th translation of one text (k < n) from its sentences' hypotheses (``grouped``: per paragraph, per
    sentence, a non-empty list): every sentence's k-th hypothesis, or its last when it has fewer, joined as Argos
    joins them (Argos' k-th hypothesis of a text is its sentences' k-th)."""
    return [argos_join([[text(h[min(k, len(h) - 1)]) for h in p] for p in grouped]) for k in range(n)]


class SentenceTranslator:
    """A :class:`~aiayn.decode.translator.Translator` whose ``search`` translates each text sentence by sentence
    and joins the hypotheses as Argos does (a hypothesis' score, log-probability, pieces and ids: its sentences'
    summed and concatenated, as Argos sums its sentences' scores). An empty text has no hypothesis, as in the
    translator's own search. Warnings of cut sentences are numbered by sentence, not by line."""

    def __init__(self, translator: Translator) -> None:
        self.translator = translator

    def search(self, texts: Iterable[str], opts: DecodeOptions, scores: bool = True, first_line: int = 1,
               **kwargs) -> list[list[Translation]]:
        plans, sentences = plan_texts(text_list(texts))
        found = self.translator.search(sentences, opts, scores=scores, **kwargs) if sentences else []
        out: list[list[Translation]] = []
        for grouped in regroup(plans, found):
            hyps = [h for p in grouped for h in p]
            if not hyps or not all(hyps):
                out.append([])  # an empty text (or a sentence with no hypothesis: none can be joined)
                continue
            n = max(len(h) for h in hyps)
            texts_k = joined(grouped, n, lambda h: h.text)
            out.append([Translation(text=texts_k[k], score=sum(h[min(k, len(h) - 1)].score for h in hyps),
                                    logprob=sum(h[min(k, len(h) - 1)].logprob for h in hyps),
                                    tokens=[t for h in hyps for t in h[min(k, len(h) - 1)].tokens],
                                    ids=[i for h in hyps for i in h[min(k, len(h) - 1)].ids]) for k in range(n)])
        return out
