"""Text in, text out: tokenize, batch by length, search on ids, detokenize, restore the input order.

``aiayn.load(RUN)`` gives a :class:`Translator` for a translation or summarization run::

    tr = aiayn.load("runs/multi30k")                         # device="auto": the GPU when there is one
    tr.translate(["A dog runs.", "Two men talk."])            # -> ["Ein Hund läuft.", ...]
    tr.translate_hypotheses(["A dog runs."], nbest=4)[0][0]   # -> Translation(text, score, logprob, ...)
    tr.translate(["A dog runs."], sample=True, top_p=0.9, seed=1)

Decoding options are one :class:`~aiayn.config.DecodeOptions`: the run's ``decode`` section, then what
the call gives (an ``options`` object and/or keyword overrides; None keeps the run's value).

Conventions (also those of ``aiayn translate``):

* The source fed to the model is ``tokens + [EOS]``; the decoder starts from the run's decoder-start id
  (BOS for aiayn's own runs), with the run tokenizer's special ids (:class:`~aiayn.data.tokenizer.SpecialIds`).
* An empty (or whitespace-only) input gives an empty output and is not decoded.
* A source longer than the model's positions (``model.max_positions``, EOS included) is cut to its
  first ``max_positions - 1`` tokens, with a warning naming its 1-based line (its index + 1).
* Sentences are sorted by length and cut into batches whose ``source tokens x beam`` (padding and the
  EOS included) stays within the token budget (``max_tokens``, by default chosen by device); results
  come back in the input order.
* ``score`` is the length-penalized score the search ranks by, ``logprob`` the summed token
  log-probabilities (the EOS included when the hypothesis ended with one). Greedy search does not
  track them; when they are asked for, one teacher-forced pass over the found tokens computes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from aiayn.config import DecodeOptions
from aiayn.decode.loaded import LoadedRun, text_list
from aiayn.search import SearchSpec, decode_ids

log = logging.getLogger("aiayn.translate")


@dataclass
class Translation:
    """One hypothesis as text (never starting or ending with whitespace): ``tokens`` are its pieces, ``ids``
    their ids (no BOS/EOS)."""

    text: str
    score: float
    logprob: float
    tokens: list[str]
    ids: list[int]


class Translator(LoadedRun):
    """A translation (or summarization) run: its model with its tokenizers and decoding defaults."""

    @property
    def max_source_tokens(self) -> int:
        """Source tokens that fit the model's positions once EOS is appended."""
        return max(1, self.cfg.model.max_positions - 1)

    def encode_sources(self, texts: Sequence[str], first_line: int | None = None
                       ) -> tuple[list[list[int] | None], list[int]]:
        """Token ids of each text (None for an empty or whitespace-only one) and the indices of the
        texts cut to :attr:`max_source_tokens`. With ``first_line`` (the line number of ``texts[0]``),
        one warning per cut text is logged; None logs nothing."""
        ids: list[list[int] | None] = []
        cut: list[int] = []
        limit = self.max_source_tokens
        for i, text in enumerate(texts):
            if not text.strip():
                ids.append(None)
                continue
            toks = self.tokenizers.src.encode(text)
            if len(toks) > limit:
                cut.append(i)
                if first_line is not None:
                    log.warning("line %d: %d source tokens do not fit the model's %d positions (with EOS); "
                                "translating the first %d", first_line + i, len(toks), self.cfg.model.max_positions,
                                limit)
                toks = toks[:limit]
            ids.append(toks)
        return ids, cut

    def warm_up(self) -> None:
        self.search(["warm up"], self.options(beam=1, nbest=1), scores=False)

    def search(self, texts: Iterable[str], opts: DecodeOptions, scores: bool = True, first_line: int = 1,
               progress: Callable[[int], None] | None = None, stop: Callable[[], bool] | None = None
               ) -> list[list[Translation]]:
        """Up to ``opts.nbest`` :class:`Translation` per text, best first; [] for an empty text.
        ``first_line`` numbers the warnings of cut texts (a stream passes its position); ``progress`` is called
        with the number of texts each batch decoded (empty texts count at the start); ``stop`` is asked once per
        decoding step, and True ends the search with :class:`~aiayn.search.SearchStopped`. ``texts`` may be any
        iterable of strings (read once); anything else is a TypeError (:func:`~aiayn.decode.loaded.text_list`)."""
        texts = text_list(texts)
        ids, _ = self.encode_sources(texts, first_line=first_line)
        todo = [i for i, s in enumerate(ids) if s is not None]
        if progress is not None and len(todo) < len(texts):
            progress(len(texts) - len(todo))
        spec = SearchSpec(opts, self.tokenizers.specials, stop)
        with self.kernels():
            found = decode_ids(self.model, [ids[i] for i in todo], spec, scores, progress)
        out: list[list[Translation]] = [[] for _ in texts]
        tgt = self.tokenizers.tgt
        for i, hyps in zip(todo, found):
            out[i] = [Translation(tgt.text(h.tokens), h.score, h.logprob, [tgt.id_to_piece(t) for t in h.tokens],
                                  list(h.tokens)) for h in hyps]
        return out

    def translate_hypotheses(self, texts: Iterable[str], options: DecodeOptions | None = None, **overrides
                             ) -> list[list[Translation]]:
        """Up to ``nbest`` :class:`Translation` per text, best first, with scores; [] for an empty text."""
        return self.search(texts, self.options(options, **overrides))

    def translate(self, texts: str | Iterable[str], options: DecodeOptions | None = None, **overrides
                  ) -> str | list[str] | list[list[str]]:
        """Translate a list (or any iterable) of texts: one string per text (nbest 1) or a list of up to ``nbest``
        strings, best first (nbest > 1). A single string in gives a single string (or list) out."""
        if isinstance(texts, str):
            return self.translate([texts], options, **overrides)[0]
        opts = self.options(options, **overrides)
        found = self.search(texts, opts, scores=opts.nbest > 1 or opts.sample)
        if opts.nbest == 1:
            return [hyps[0].text if hyps else "" for hyps in found]
        return [[h.text for h in hyps] for hyps in found]
