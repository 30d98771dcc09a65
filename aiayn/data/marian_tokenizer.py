"""Marian / OPUS-MT tokenization, as transformers' ``MarianTokenizer`` (5.23) does it, on aiayn's interface.

A Marian directory has two SentencePiece models (``source.spm``, ``target.spm``) and ``vocab.json``, which
maps piece *strings* to the model's ids (one id space for both sides; ``target_vocab.json`` as well when
the vocabularies are separate). The SentencePiece models' own ids are never used. :class:`MarianPieces` is
one side: its SentencePiece model plus the mapping, with MarianTokenizer's rules (:class:`MarianRules`):

* encode: the text is cut at the tokenizer's added tokens (its special tokens ``</s>``, ``<unk>``,
  ``<pad>``, ...: each becomes its id) unless ``split_special_tokens``; a part that starts with a
  language code ``>>xx<<`` gives that code as one token; the rest is SentencePiece-encoded to pieces,
  each looked up in vocab.json (a piece not there is ``<unk>``). MarianTokenizer sets up Moses punctuation
  normalization but never calls it, so there is none here either. No ``</s>`` is appended: the caller
  appends EOS, as MarianTokenizer's ``build_inputs_with_special_tokens`` does.
* decode, as ``decode(ids, skip_special_tokens=True)`` (what translation pipelines call): special ids
  (``<unk>`` included) are dropped, the others mapped back to pieces, the pieces decoded by SentencePiece
  (the *source* model when the vocabulary is shared, as MarianTokenizer 5.23 does), ``▁`` turned into
  spaces, surrounding whitespace stripped, then transformers' ``clean_up_tokenization`` if
  ``clean_up_tokenization_spaces`` is set.

On disk (``RUN/tokenizer/``): ``source.spm``, ``target.spm``, ``vocab.json`` (and ``target_vocab.json``),
described by ``tokenizer.json`` (kind ``marian``, the rules, and the Hugging Face tokenizer files of an
imported directory kept verbatim so an export writes them back unchanged).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sentencepiece as spm

from aiayn.errors import first_line

from ..errors import DataError
from ..files import atomic_write_bytes, atomic_write_json
from .tokenizer_base import Tokenizer

SPIECE_UNDERLINE = "\u2581"  # ▁
SOURCE_SPM, TARGET_SPM, VOCAB, TARGET_VOCAB = "source.spm", "target.spm", "vocab.json", "target_vocab.json"


@dataclass
class MarianVocab:
    """``vocab.json``: piece -> id in file order, and ``size``, the number of ids the model has."""

    ids: dict[str, int]
    size: int

    def __post_init__(self) -> None:
        if not self.ids:
            raise DataError("vocab.json is empty")
        if max(self.ids.values()) >= self.size or min(self.ids.values()) < 0:
            raise DataError(f"vocab.json has ids outside the model's {self.size} embeddings")
        named = set(self.ids.values())
        if len(named) < self.size:  # the model could produce an id with no piece: it would decode to nothing
            missing = next(i for i in range(self.size) if i not in named)
            raise DataError(f"vocab.json names {len(named)} of the model's {self.size} ids (none for id {missing}): "
                            "it does not belong to this model")
        self.pieces = {i: p for p, i in self.ids.items()}  # as MarianTokenizer inverts it: the last piece wins


@dataclass
class MarianRules:
    """The settings of a MarianTokenizer that change ids or text. ``added``: tokens cut out of the text
    before SentencePiece (content -> id; the special tokens and any added ones); ``special_ids``: the ids
    decode drops; ``decode_with_source``: decode pieces with the source model (MarianTokenizer does when
    the vocabulary is shared); ``hf_files``: tokenizer_config.json / special_tokens_map.json as read."""

    added: dict[str, int]
    special_ids: frozenset[int]
    unk_token: str = "<unk>"
    split_special_tokens: bool = False
    clean_up_tokenization_spaces: bool = False
    decode_with_source: bool = True
    hf_files: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.unk_token not in self.added:
            raise DataError(f"the unknown token {self.unk_token!r} is not one of the tokenizer's special tokens")
        # Longest first: at one position the longest added token wins, as in transformers' trie.
        alts = "|".join(re.escape(t) for t in sorted(self.added, key=len, reverse=True) if t)
        self._split = None if self.split_special_tokens or not alts else re.compile(f"({alts})")

    @property
    def unk_id(self) -> int:
        return self.added[self.unk_token]

    def parts(self, text: str) -> list[tuple[str, bool]]:
        """``text`` cut at the added tokens: (part, is an added token), empty parts left out."""
        if self._split is None:
            return [(text, False)] if text else []
        return [(p, i % 2 == 1) for i, p in enumerate(self._split.split(text)) if p]

    def to_json(self) -> dict[str, Any]:
        return {"added": self.added, "special_ids": sorted(self.special_ids), "unk_token": self.unk_token,
                "split_special_tokens": self.split_special_tokens,
                "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
                "decode_with_source": self.decode_with_source, "hf_files": self.hf_files}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MarianRules:
        return cls({str(k): int(v) for k, v in d["added"].items()}, frozenset(int(i) for i in d["special_ids"]),
                   str(d["unk_token"]), bool(d["split_special_tokens"]), bool(d["clean_up_tokenization_spaces"]),
                   bool(d["decode_with_source"]), dict(d.get("hf_files", {})))


def _language_code(text: str) -> tuple[list[str], str]:
    """MarianTokenizer.remove_language_code: a leading ``>>xx<<`` is a token of its own."""
    if text.startswith(">>") and (end := text.find("<<")) != -1:
        return [text[: end + 2]], text[end + 2 :]
    return [], text


def clean_up_tokenization(text: str) -> str:
    """transformers' ``PreTrainedTokenizerBase.clean_up_tokenization`` (English spacing before punctuation)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _processor(proto: bytes, what: str) -> spm.SentencePieceProcessor:
    try:
        return spm.SentencePieceProcessor(model_proto=proto)
    except (RuntimeError, OSError) as e:
        raise DataError(f"{what}: not a readable SentencePiece model ({first_line(e)})") from None


class MarianPieces(Tokenizer):
    """One side of a Marian tokenizer: ``model_proto`` (its SentencePiece model) encodes, ``vocab`` maps
    pieces to ids, ``decode_proto`` (the source model when the vocabulary is shared) decodes."""

    kind = "marian"

    def __init__(self, model_proto: bytes, vocab: MarianVocab, rules: MarianRules, decode_proto: bytes | None = None,
                 name: str = SOURCE_SPM) -> None:
        self.model_proto, self.vocab, self.rules, self.name = model_proto, vocab, rules, name
        self.decode_proto = model_proto if decode_proto is None else decode_proto
        self.sp = _processor(model_proto, name)
        self.decode_sp = self.sp if self.decode_proto == model_proto else _processor(self.decode_proto, name)
        self._added_pieces = {i: t for t, i in rules.added.items()}
        for token, i in rules.added.items():
            if not 0 <= i < vocab.size:
                raise DataError(f"the tokenizer's token {token!r} has id {i}, outside the model's {vocab.size} ids")

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def suffix(self) -> str:
        return ".spm"

    @property
    def lowercases(self) -> bool:
        return self.sp.encode("AZ") == self.sp.encode("az")

    def same_ids(self, other: Tokenizer) -> bool:
        return isinstance(other, MarianPieces) and (other.vocab is self.vocab or other.vocab.ids == self.vocab.ids)

    def _id(self, token: str) -> int:
        r = self.rules
        if token in r.added:
            return r.added[token]
        return self.vocab.ids.get(token, r.unk_id)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part, is_added in self.rules.parts(text):
            if is_added:
                out.append(self.rules.added[part])
                continue
            code, rest = _language_code(part)
            out.extend(self._id(t) for t in code + self.sp.encode(rest, out_type=str))
        return out

    def id_to_piece(self, i: int) -> str:
        i = int(i)
        if i in self._added_pieces:
            return self._added_pieces[i]
        piece = self.vocab.pieces.get(i)
        if piece is None and 0 <= i < self.decode_sp.get_piece_size():
            piece = self.decode_sp.id_to_piece(i)  # MarianTokenizer falls back to SentencePiece's own id
        return piece or self.rules.unk_token

    def decode(self, ids: Iterable[int]) -> str:
        skip = self.rules.special_ids
        pieces = [self.id_to_piece(i) for i in ids if int(i) not in skip]
        text = self.decode_sp.decode_pieces(pieces).replace(SPIECE_UNDERLINE, " ").strip()
        return clean_up_tokenization(text) if self.rules.clean_up_tokenization_spaces else text

    def save(self, directory: str | Path, name: str = "source") -> Path:
        path = Path(directory) / f"{name}{self.suffix}"
        atomic_write_bytes(path, self.model_proto)
        return path


def save_marian_pair(src: MarianPieces, tgt: MarianPieces, directory: Path) -> dict[str, Any]:
    """Write source.spm, target.spm, vocab.json (and target_vocab.json) into ``directory``; return the
    entries of ``tokenizer.json`` that describe them."""
    if not isinstance(tgt, MarianPieces):
        raise DataError("a Marian source tokenizer needs a Marian target tokenizer")
    src.save(directory, Path(SOURCE_SPM).stem)
    tgt.save(directory, Path(TARGET_SPM).stem)
    atomic_write_json(directory / VOCAB, src.vocab.ids, indent=2)
    shared = src.same_ids(tgt)
    if not shared:
        atomic_write_json(directory / TARGET_VOCAB, tgt.vocab.ids, indent=2)
    return {"src": SOURCE_SPM, "tgt": TARGET_SPM, "vocab": VOCAB, "target_vocab": None if shared else TARGET_VOCAB,
            "marian": src.rules.to_json()}


def load_marian_pair(directory: Path, meta: dict[str, Any]) -> tuple[MarianPieces, MarianPieces]:
    """The two sides described by ``tokenizer.json``'s ``meta`` (see :func:`save_marian_pair`)."""
    d = Path(directory)

    def read(name: str) -> bytes:
        path = d / name
        if not path.is_file():
            raise DataError(f"{path}: no such file (the Marian tokenizer needs it)")
        return path.read_bytes()

    def vocab(name: str, size: int) -> MarianVocab:
        try:
            ids = json.loads(read(name).decode("utf-8"))
            return MarianVocab({str(k): int(v) for k, v in ids.items()}, size)
        except (ValueError, AttributeError, TypeError) as e:
            raise DataError(f"{d / name}: not a vocabulary file ({first_line(e)})") from None

    try:
        rules = MarianRules.from_json(meta["marian"])
        src_size, tgt_size = int(meta["src_vocab_size"]), int(meta["tgt_vocab_size"])
        src_name, tgt_name, target_vocab = str(meta["src"]), str(meta["tgt"]), meta.get("target_vocab")
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise DataError(f"{d / 'tokenizer.json'}: not a valid Marian tokenizer description ({first_line(e)})") from None
    src_proto, tgt_proto = read(src_name), read(tgt_name)
    src_vocab = vocab(str(meta.get("vocab", VOCAB)), src_size)
    tgt_vocab = src_vocab if not target_vocab else vocab(str(target_vocab), tgt_size)
    decode_proto = src_proto if rules.decode_with_source else None
    src = MarianPieces(src_proto, src_vocab, rules, decode_proto, src_name)
    tgt = MarianPieces(tgt_proto, tgt_vocab, rules, decode_proto, tgt_name)
    return src, tgt
