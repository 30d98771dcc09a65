"""The stream kind of the token store (:mod:`aiayn.data.store`): ``task: lm``'s text (UTF-8, plain or .gz, any size)
as ``train.bin`` and ``valid.bin``, read by windows (:class:`aiayn.data.batching.LMData`, the nanoGPT way); prepared
in passes of :data:`READ_BYTES` pieces: count (nanoGPT's split), train the tokenizer, encode (:class:`PieceEncoder`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import Config
from aiayn.data.corpus import count_chars, text_chars, text_lines, text_parts
from aiayn.data.registry import dataset_of
from aiayn.data.store import PARALLEL_BYTES, STREAM_KIND, IdWriter, Recipe, note, storage_dtype
from aiayn.data.tokenizer import UNK_ID, CharTokenizer, SentencePieceTokenizer, TokenizerPair
from aiayn.engine import worker_pool
from aiayn.errors import DataError
from aiayn.progress import ItemProgress

SPLITS = ("train", "valid")
READ_BYTES = 4 << 20  # text read (and encoded) at a time


class PieceEncoder:
    """Encodes the pieces of one text so that their ids, back to back, are those of encoding the text in one call:
    a char tokenizer through a code-point table; a SentencePiece model encodes a piece that continues its part as
    ``"\\n" + piece`` and drops the ids of that newline and of the word-boundary prefix in front of it (no piece of
    a model trained on lines holds a newline, so nothing merges across it); any other tokenizer per piece."""

    def __init__(self, tokenizer_dir: str | Path) -> None:
        self.tok = TokenizerPair.load(tokenizer_dir).src
        self.table: np.ndarray | None = None
        self.head: list[int] | None = None
        if isinstance(self.tok, CharTokenizer):
            codes = [ord(c) for c in self.tok.chars]
            self.table = np.full(max(codes, default=0) + 2, UNK_ID, dtype=np.int64)  # the last: every code past it
            self.table[codes] = [self.tok.stoi[c] for c in self.tok.chars]
        elif isinstance(self.tok, SentencePieceTokenizer) and not any(
                "\n" in self.tok.id_to_piece(i) for i in range(self.tok.vocab_size)):
            self.head = self.tok.encode("\n")

    def __call__(self, part: tuple[str, str, bool]) -> tuple[str, np.ndarray, int]:
        """(split name, the piece's ids (n,) int64, its characters)."""
        name, text, starts = part
        return name, self.encode(text, starts), len(text)

    def encode(self, text: str, starts: bool) -> np.ndarray:
        """(n,) int64: the ids of ``text``, a piece that ``starts`` its part or continues it."""
        if self.table is not None:
            codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
            return self.table[np.minimum(codes, len(self.table) - 1)]
        if self.head is None or starts:
            return np.asarray(self.tok.encode(text), dtype=np.int64)
        ids = self.tok.encode("\n" + text)
        if ids[: len(self.head)] != self.head:  # pragma: no cover (a newline after text never merges with it)
            raise DataError("the tokenizer merged a newline with the text after it: it cannot encode a stream")
        return np.asarray(ids[len(self.head) :], dtype=np.int64)


@dataclass
class StreamRecipe(Recipe):
    """The stream store of ``task: lm``'s text ``path`` (``inputs``: what it is, for the key)."""

    kind = STREAM_KIND
    path: Path
    inputs: dict[str, str]

    def kind_settings(self) -> dict[str, Any]:
        return {"kind": STREAM_KIND, "valid_fraction": self.cfg.data.valid_fraction}

    def _train(self, tdir: Path, split: int) -> None:
        """As a training without a store would: on the training part's lines (BPE) or characters (char)."""
        train_parts = takewhile(lambda part: part[0] == "train", text_parts(self.path, split, READ_BYTES))
        pieces = (piece for _, piece, _ in train_parts)
        texts: Iterable[str] = ([text_chars(pieces)] if self.cfg.data.tokenizer == "char"
                                else (ln for ln in text_lines(pieces) if ln.strip()))
        self.train_tokenizer_on(tdir, texts, [], f"the first {split:,} characters")

    def build_into(self, stage: Path) -> dict[str, Any]:
        note("preparing it: counting the text's characters")
        chars, visible = count_chars(self.path, READ_BYTES)
        if not visible:
            raise DataError(f"{self.path}: the language-modelling corpus is empty (no text)")
        split = int(chars * (1 - self.cfg.data.valid_fraction))  # nanoGPT's: the first 90% train, the rest valid
        tdir, tok = self.place_tokenizer(stage, lambda t: self._train(t, split))
        dtype = storage_dtype(tok.src.vocab_size)
        big = tok.src.kind != "char" and os.path.getsize(self.path) >= PARALLEL_BYTES
        with contextlib.ExitStack() as held:
            files = {name: held.enter_context(contextlib.closing(IdWriter(stage / f"{name}.bin", dtype)))
                     for name in SPLITS}
            progress = ItemProgress(chars, "char", "prepare")
            held.callback(progress.close)
            note("preparing it: encoding the text")
            encode = held.enter_context(worker_pool(self.workers, big, PieceEncoder, (str(tdir),)))
            for name, ids, n_chars in encode(text_parts(self.path, split, READ_BYTES)):
                files[name].add(ids)
                progress.update(n_chars)
        return self.manifest(dtype, tok.src.vocab_size, chars={"train": split, "valid": chars - split},
                             splits={name: {"tokens": files[name].tokens} for name in SPLITS})


def stream_recipe(cfg: Config, tokenizer: Path | None = None, workers: int | None = None) -> StreamRecipe:
    """The stream store of a ``task: lm`` config (its text: the dataset registry's)."""
    path, inputs = dataset_of(cfg).text(cfg.data)
    return StreamRecipe(cfg, path, inputs, tokenizer=tokenizer, workers=workers)
