"""Summarization data: the XSum sample split three ways, and "document <sep> summary" LM sequences.

The same data is summarized two ways (``aiayn summarize`` handles both):

(a) ``task: lm``, a decoder-only LM trained on one sequence per article (the course's recipe)::

        BOS  document  <sep>  summary  EOS

    then asked for a summary by priming it with ``BOS document <sep>`` and decoding to EOS.
(b) ``task: summarization``, the encoder-decoder Transformer on (document, summary) pairs.

Decisions, and why:

* Split of ``xsum-1000.jsonl``, in file order, the same for both ways: rows 0-799 train, 800-899 valid
  (early stopping / perplexity), 900-999 test (ROUGE). :data:`XSUM_SPLITS`.
* Text is put on one line (every whitespace run becomes one space) for training and inference alike:
  XSum documents have one sentence per line, and ``aiayn summarize`` reads one document per line.
* One article per LM sequence, never packed with others. When it is longer than ``block_size + 1``
  tokens the *document* is cut (its end is dropped: XSum's summary is mostly about the opening),
  never the separator or the summary, so every training sequence teaches the summary. An article
  whose summary alone does not fit is dropped, and counted in the log.
* The loss covers every token, document included, as the course trains it: with 800 articles the
  documents are most of the text the model can learn English from (about 95% of the tokens); the
  summary tokens alone would be some 20k tokens. Validation perplexity is therefore over whole
  sequences.
* The separator (``data.separator``, default ``" <sep> "``) is one user-defined piece of the BPE
  model (``<sep>``; SentencePiece's word-initial space supplies the blanks around it), or its
  characters spelt out by a char tokenizer. Either way ``decode(sequence) == document + separator +
  summary`` (see :func:`lm_sequence`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import Config, ConfigError
from aiayn.data.batching import Batch, pad_batch, plan_batches
from aiayn.data.corpus import DataError
from aiayn.data.store import PairRecipe, Split
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from aiayn.task import collapse_whitespace

XSUM_SIZE = 1000
XSUM_SPLITS = {"train": (0, 800), "valid": (800, 900), "test": (900, 1000)}


def xsum_split(split: str) -> list[dict]:
    """Rows ``{"document", "summary", "id"}`` of ``split`` (train | valid | test) of the XSum sample."""
    from aiayn.data.datasets import xsum_rows

    if split not in XSUM_SPLITS:
        raise DataError(f"xsum has no split {split!r} (splits: {', '.join(XSUM_SPLITS)})")
    rows = xsum_rows()
    if len(rows) != XSUM_SIZE:
        raise DataError(f"the xsum sample has {len(rows)} rows, expected {XSUM_SIZE}")
    start, end = XSUM_SPLITS[split]
    return rows[start:end]


def xsum_pairs(split: str) -> list[tuple[str, str]]:
    """(document, summary) pairs of an XSum split, each put on one line."""
    return [(collapse_whitespace(r["document"]), collapse_whitespace(r["summary"])) for r in xsum_split(split)]


def lead_1(document: str) -> str:
    """The lead-1 baseline: the document's first sentence (XSum documents hold one sentence per line;
    text without line breaks is cut after the first ``.``, ``!`` or ``?`` followed by a space)."""
    for line in document.splitlines():
        if line.strip():
            return collapse_whitespace(line)
    text = collapse_whitespace(document)
    return re.split(r"(?<=[.!?])\s+", text, maxsplit=1)[0] if text else ""


# "document <sep> summary" sequences ------------------------------------------------------------------


def separator_ids(tok: Tokenizer, separator: str) -> list[int]:
    """The ids the separator contributes between the document and summary ids.

    SentencePiece prefixes every ``encode`` call with a word boundary, so the document, the stripped
    separator and the summary are encoded apart and the boundaries supply the blanks: the ids equal
    ``encode(document + " <sep> " + summary)``. A char tokenizer spells the separator out as given.
    """
    ids = tok.encode(separator.strip() if tok.kind == "bpe" else separator)
    if not ids or UNK_ID in ids:
        raise DataError(f"separator {separator!r} is not in the tokenizer's vocabulary")
    return ids


def lm_sequence(tok: Tokenizer, document: str, summary: str, sep_ids: list[int], block_size: int
                ) -> list[int] | None:
    """``[BOS] + document + separator + summary + [EOS]`` in at most ``block_size + 1`` ids (a block's
    input and target), cutting the end of the document when it is too long; None when the summary
    alone does not fit."""
    return lm_sequence_ids(tok.encode(document), tok.encode(summary), sep_ids, block_size)


def lm_sequence_ids(doc_ids: list[int], summ_ids: list[int], sep_ids: list[int], block_size: int
                    ) -> list[int] | None:
    """:func:`lm_sequence` of a document and a summary already encoded."""
    room = block_size + 1 - (2 + len(sep_ids) + len(summ_ids))
    if room < 1:
        return None
    return [BOS_ID] + doc_ids[:room] + sep_ids + summ_ids + [EOS_ID]


def rows_prompt(tok: Tokenizer, prompt: str) -> list[int]:
    """The ids a "document <sep> summary" language model continues ``prompt`` from: its rows start with BOS, so
    its prompts do too."""
    return [BOS_ID] + tok.encode(prompt)


def lm_prompt(tok: Tokenizer, document: str, sep_ids: list[int], max_len: int) -> list[int]:
    """``[BOS] + document + separator`` in at most ``max_len`` ids (the end of the document is cut)."""
    room = max(0, max_len - 1 - len(sep_ids))
    return [BOS_ID] + tok.encode(document)[:room] + sep_ids


def summary_lm_recipe(cfg: Config, sources: dict[str, Callable[[], Iterator[tuple[str, str]]]],
                      inputs: dict[str, str], tokenizer: Path | None = None, workers: int | None = None) -> PairRecipe:
    """The store of a summary LM's (document, summary) pairs: the ids of the one shared tokenizer, trained (when
    none is given) as a training without a store trains it, on the documents and summaries in corpus order and
    the separator (a BPE model keeps it as one piece); pairs with an empty side dropped, none for its length
    (the rows are cut to ``block_size + 1`` when collated)."""
    from aiayn.data.tokenizer import TokenizerSpec, train_tokenizer_pair

    sep = cfg.data.separator
    if not sep.strip():
        raise ConfigError("data.separator must contain a visible symbol, e.g. ' <sep> '")
    symbols = [sep.strip()] if cfg.data.tokenizer == "bpe" else []

    def train(tdir: Path) -> None:  # the char tokenizer must know the separator's characters
        texts = chain((t for pair in sources["train"]() for t in pair), [sep])
        train_tokenizer_pair(texts, [], tdir, TokenizerSpec.from_config(cfg, symbols))

    return PairRecipe(cfg=cfg, sources=sources, inputs=inputs, tokenizer=tokenizer, workers=workers,
                      train_tokenizer=train, length_filter=False,
                      extra={"kind": "summary_lm", "separator": sep})


class SummaryRows:
    """The "document <sep> summary" rows of one split of a pair store, built when asked: the pairs whose summary
    leaves room for a document token (the others are dropped), each row's length known from the store's
    offsets alone (its document cut to fit ``block_size + 1`` ids)."""

    def __init__(self, split: Split, sep_ids: list[int], block_size: int) -> None:
        self.split, self.sep_ids, self.block_size = split, list(sep_ids), block_size
        doc, summ = split.src.lengths().astype(np.int64), split.tgt.lengths().astype(np.int64)
        room = block_size + 1 - (2 + len(self.sep_ids) + summ)
        self.pairs = np.flatnonzero(room >= 1)  # (rows,) the store's pair of each row
        self.lengths = (2 + len(self.sep_ids) + summ + np.minimum(doc, room))[self.pairs]  # (rows,)
        self.cut = int((doc > room)[self.pairs].sum())
        self.dropped = len(split) - len(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def rows(self, indices: np.ndarray) -> list[list[int]]:
        """The id lists of rows ``indices`` (:func:`lm_sequence_ids`), read in one gather per side."""
        pairs = self.pairs[np.asarray(indices, dtype=np.int64)]
        (doc, doc_lens), (summ, summ_lens) = self.split.src.gather(pairs), self.split.tgt.gather(pairs)
        docs = np.split(doc, np.cumsum(doc_lens)[:-1]) if len(pairs) else []
        summs = np.split(summ, np.cumsum(summ_lens)[:-1]) if len(pairs) else []
        return [lm_sequence_ids(d.tolist(), s.tolist(), self.sep_ids, self.block_size) for d, s in zip(docs, summs)]

    def batch(self, indices: np.ndarray) -> Batch:
        """The padded batch of rows ``indices``: ``tgt_in`` = row[:-1], ``tgt_out`` = row[1:], (B, longest)."""
        padded = pad_batch(self.rows(indices), PAD_ID)  # (B, L + 1)
        tgt_out = padded[:, 1:]
        return Batch(None, padded[:, :-1], tgt_out, int((tgt_out != PAD_ID).sum()), np.asarray(indices).tolist())


@dataclass
class SummaryLMData:
    """One padded row per article, read from a pair store and built when collated; batches of similar length
    within ``batch_size * (block_size + 1)`` tokens, in a new order every epoch. Rows are right-padded: with
    causal attention the padding only follows the real tokens, and the loss ignores it."""

    train: Split
    valid: Split
    sep_ids: list[int]
    block_size: int
    batch_size: int
    seed: int

    def __post_init__(self) -> None:
        self._valid: list[Batch] | None = None
        self.rows = {"train": SummaryRows(self.train, self.sep_ids, self.block_size),
                     "valid": SummaryRows(self.valid, self.sep_ids, self.block_size)}
        for name, rows in self.rows.items():
            if not len(rows):
                raise DataError(f"{name}: no usable document/summary pairs")

    def __getstate__(self) -> dict[str, Any]:
        # the splits pickle as their file names; the row lengths are read again from their offsets
        return {k: getattr(self, k) for k in ("train", "valid", "sep_ids", "block_size", "batch_size", "seed")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def _plan(self, rows: SummaryRows, epoch: int, shuffle: bool) -> list[np.ndarray]:
        # token_batches adds one to each length (it counts an EOS): lengths here already hold theirs.
        return plan_batches(rows.lengths - 1, None, self.batch_size * (self.block_size + 1), self.seed, epoch,
                            shuffle=shuffle)

    def epoch_plan(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches as arrays of row indices (from the rows' lengths alone)."""
        return self._plan(self.rows["train"], epoch, shuffle=True)

    def plan_tokens(self, indices: np.ndarray) -> int:
        """The target tokens of a planned batch: each row's ids but its first."""
        return int((self.rows["train"].lengths[indices] - 1).sum())

    def collate_plan(self, indices: np.ndarray) -> Batch:
        return self.rows["train"].batch(indices)

    @property
    def valid_batches(self) -> list[Batch]:
        if self._valid is None:
            rows = self.rows["valid"]
            self._valid = [rows.batch(idx) for idx in self._plan(rows, 0, shuffle=False)]
        return self._valid
