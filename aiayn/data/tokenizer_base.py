"""The :class:`Tokenizer` interface every tokenizer implements (SentencePiece BPE, characters, Moses in front
of either, Marian's vocab.json-mapped pieces), apart from the modules that implement it so they can all
build on it without importing each other."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class Tokenizer:
    """Text <-> ids. ``encode`` adds no BOS/EOS (the batcher does); ``decode`` drops pad/bos/eos."""

    kind: str = ""
    lowercases: bool = False  # whether encode lowercases (only a BPE model trained with lowercase=True)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def text(self, ids: Iterable[int]) -> str:
        """What a user reads: :meth:`decode` without surrounding whitespace (a model may emit a lone ``\u2581``
        piece first or last; every detokenizer users compare with - Hugging Face's, sacremoses, CTranslate2's -
        strips it). Every path that hands a translation out (translate, serve, the Python API, eval) uses this."""
        return self.decode(ids).strip()

    def pieces(self, text: str) -> list[str]:
        """The pieces ``encode`` would produce, as strings (for inspection and attention plots)."""
        return [self.id_to_piece(i) for i in self.encode(text)]

    def id_to_piece(self, i: int) -> str:
        raise NotImplementedError

    @property
    def suffix(self) -> str:
        """File suffix of the saved model: ``.model`` (SentencePiece), ``.json`` (char), ``.spm`` (Marian)."""
        raise NotImplementedError

    def save(self, directory: str | Path, name: str = "tokenizer") -> Path:
        """Write ``directory/name`` + :attr:`suffix`; return the path."""
        raise NotImplementedError

    def same_ids(self, other: Tokenizer) -> bool:
        """Whether ``other`` maps text to the same id space (one vocabulary for both sides of a pair)."""
        return self is other


