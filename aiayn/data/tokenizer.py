"""Tokenizers: SentencePiece BPE (the paper's byte-pair encoding, section 5.1) and characters.

The tokenizers trained here use the same special ids: PAD_ID=0, UNK_ID=1, BOS_ID=2, EOS_ID=3. A run
imported from Marian keeps Marian's ids; code that builds model inputs reads them from
``TokenizerPair.specials`` (:class:`SpecialIds`).

BPE models are trained losslessly (no normalization, whitespace kept, byte fallback on by
default), so ``decode(encode(x)) == x`` for any text, including scripts never seen in training.
That departs from SentencePiece's default NFKC normalization: what a user reads back from
``translate`` is exactly what the model produced, and cleaning text is left to data preparation.
The one opt-in exception is ``lowercase=True``: the model file then carries a per-character
lowercasing rule (every Unicode letter with a lowercase form, nothing else), so every encode - training
data, evaluation sources, ``translate`` input, exported engines that run the SentencePiece model -
lowercases, and decode returns lowercase text. The Multi30k literature trains on lowercased text.

A second opt-in, ``pretokenize="moses"``, puts the Moses pipeline that the Multi30k literature runs
before its BPE in front of the model (:class:`MosesPretokenized`: sacremoses punctuation normalization
and tokenization in the side's language, after lowercasing when the model lowercases); decode
detokenizes. It lives outside the SentencePiece model, so engines that run only the ``.model`` file
(CTranslate2) need the same step in front of them (the export's README says so).

On disk (``RUN/tokenizer/``)::

    tokenizer.json                  {"kind", "shared", "src", "tgt", vocab sizes, "pretokenize"}
    shared.model                    one SentencePiece model for both sides, or
    src.model + tgt.model           one per side (char tokenizers: *.json), or
    source.spm + target.spm + vocab.json   a Marian / OPUS-MT tokenizer (:mod:`.marian_tokenizer`), whose
                                    special ids are Marian's (``special_ids`` in tokenizer.json)
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece as spm

from aiayn.errors import first_line

from ..config import PRETOKENIZERS, Config
from ..errors import DataError
from ..files import atomic_write_bytes, read_json
from .marian_tokenizer import MarianPieces, load_marian_pair, save_marian_pair
from .tokenizer_base import Tokenizer

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SPECIAL_PIECES = ("<pad>", "<unk>", "<s>", "</s>")
N_BYTES = 256  # byte-fallback pieces <0x00>..<0xFF>
UNK_TEXT = "\u2047"  # what SentencePiece prints for an unknown piece: ⁇

# SentencePiece skips training sentences longer than this many bytes; raised from its default
# (4192) so that long documents (XSum) still count, while bounding memory.
_MAX_SENTENCE_BYTES = 16384
PAIR_FILE = "tokenizer.json"



def tokenizer_files(tokenizer_dir: str | Path) -> list[Path]:
    """The files that define a tokenizer directory (its model files and tokenizer.json): what a store's key hashes
    and what makes two tokenizers the same."""
    return sorted(p for p in Path(tokenizer_dir).iterdir() if p.is_file() and not p.name.startswith("."))

class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (BPE), kept in memory as its serialized protobuf."""

    kind = "bpe"

    def __init__(self, model_proto: bytes) -> None:
        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        specials = [self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()]
        if specials != [PAD_ID, UNK_ID, BOS_ID, EOS_ID]:
            raise DataError(f"SentencePiece model has special ids {specials}, expected [0, 1, 2, 3]")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def suffix(self) -> str:
        return ".model"

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids if int(i) not in (PAD_ID, BOS_ID, EOS_ID)])

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    @property
    def lowercases(self) -> bool:
        """Whether encoding lowercases (trained with ``lowercase=True``). Without that rule the model
        normalizes nothing, so two different strings never share ids."""
        return self.sp.encode("AZ") == self.sp.encode("az")

    def save(self, directory: str | Path, name: str = "tokenizer") -> Path:
        path = Path(directory) / f"{name}{self.suffix}"
        atomic_write_bytes(path, self.model_proto)
        return path


class CharTokenizer(Tokenizer):
    """One id per character: the specials, then the training characters in sorted order."""

    kind = "char"

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = sorted(set(chars))
        if any(len(c) != 1 for c in self.chars):
            raise DataError("char tokenizer: every vocabulary entry must be one character")
        self.itos = list(SPECIAL_PIECES) + self.chars
        self.stoi = {c: i + len(SPECIAL_PIECES) for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    @property
    def suffix(self) -> str:
        return ".json"

    def encode(self, text: str) -> list[int]:
        get = self.stoi.get
        return [get(c, UNK_ID) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in (PAD_ID, BOS_ID, EOS_ID):
                continue
            out.append(UNK_TEXT if i == UNK_ID or not 0 <= i < len(self.itos) else self.itos[i])
        return "".join(out)

    def id_to_piece(self, i: int) -> str:
        return self.itos[int(i)]

    def save(self, directory: str | Path, name: str = "tokenizer") -> Path:
        path = Path(directory) / f"{name}{self.suffix}"
        payload = json.dumps({"kind": "char", "chars": self.chars}, ensure_ascii=False)
        atomic_write_bytes(path, payload.encode("utf-8"))
        return path


class MosesSteps:
    """The Moses steps the Multi30k literature prepares its text with (``normalize-punctuation.perl``
    then ``tokenizer.perl``; here sacremoses in language ``lang``), and the detokenizer that undoes them.
    ``lowercase``: lowercase first, as the literature does (Moses' non-breaking prefixes are
    case-sensitive)."""

    def __init__(self, lang: str, lowercase: bool) -> None:
        from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer  # a core dependency
        self.lang, self.lowercase = lang, lowercase
        self._norm = MosesPunctNormalizer(lang=lang)
        self._tok = MosesTokenizer(lang=lang)
        self._detok = MosesDetokenizer(lang=lang)

    def __call__(self, text: str) -> str:
        """``text`` lowercased (if asked), punctuation normalized and tokenized (no XML escaping),
        tokens joined by single spaces."""
        if self.lowercase:
            text = text.lower()
        return self._tok.tokenize(self._norm.normalize(text), escape=False, return_str=True)

    def detokenize(self, text: str) -> str:
        return self._detok.detokenize(text.split())


class MosesPretokenized(Tokenizer):
    """A BPE or char model behind :class:`MosesSteps` in language ``lang``, lowercasing first when the
    inner model lowercases. ``decode`` runs the inner model's decode, then Moses detokenization, so
    callers get plain text back. Lossy by design: quotes and some spacing are normalized.
    """

    def __init__(self, inner: Tokenizer, lang: str) -> None:
        if isinstance(inner, MosesPretokenized):
            raise DataError("a tokenizer can be Moses-pretokenized once")
        self.inner, self.lang = inner, lang
        self.kind = inner.kind
        # Asked once: SentencePieceTokenizer.lowercases encodes a probe, too costly per sentence.
        self.pretokenize = MosesSteps(lang, inner.lowercases)

    @property
    def lowercases(self) -> bool:
        return self.inner.lowercases

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def suffix(self) -> str:
        return self.inner.suffix

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(self.pretokenize(text))

    def decode(self, ids: Iterable[int]) -> str:
        return self.pretokenize.detokenize(self.inner.decode(ids))

    def id_to_piece(self, i: int) -> str:
        return self.inner.id_to_piece(i)

    def save(self, directory: str | Path, name: str = "tokenizer") -> Path:
        # Only the inner model is a file; that it is Moses-pretokenized is recorded in tokenizer.json.
        return self.inner.save(directory, name)


def _inner(tok: Tokenizer) -> Tokenizer:
    return tok.inner if isinstance(tok, MosesPretokenized) else tok


def load_tokenizer(directory: str | Path, name: str = "tokenizer") -> Tokenizer:
    """Load ``directory/name.model`` (BPE) or ``directory/name.json`` (char)."""
    base = Path(directory) / name
    model, chars = base.with_suffix(".model"), base.with_suffix(".json")
    if model.is_file():
        try:
            return SentencePieceTokenizer(model.read_bytes())
        except (RuntimeError, OSError) as e:
            raise DataError(f"{model}: not a readable SentencePiece model ({first_line(e)})") from None
    if chars.is_file():
        try:
            data = read_json(chars)
            return CharTokenizer(data["chars"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{chars}: not a char tokenizer file ({first_line(e)})") from None
    raise DataError(f"no tokenizer {name} in {directory} (expected {model.name} or {chars.name})")


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """What tokenizer to train: ``kind`` bpe (SentencePiece BPE, ``vocab_size`` pieces at most: a soft limit, a
    small corpus gives fewer) or char (every character seen; ``vocab_size`` ignored); at most ``max_sentences``
    texts, a uniform sample drawn with ``seed``, so training is repeatable; ``user_defined_symbols`` (BPE only)
    become single pieces that are never split, e.g. the ``<sep>`` of summarization as language modelling (a char
    tokenizer spells them out); ``lowercase`` (BPE only): the model lowercases everything it encodes. For pairs:
    one ``shared`` tokenizer or one per side, and ``pretokenize`` (``moses``: each side Moses-processed in its
    language of ``langs``, source and target). ``threads``: SentencePiece's training threads."""

    kind: str = "bpe"
    vocab_size: int = 8000
    byte_fallback: bool = True
    max_sentences: int = 2_000_000
    seed: int = 1
    user_defined_symbols: tuple[str, ...] = ()
    lowercase: bool = False
    shared: bool = True
    pretokenize: str = "none"
    langs: tuple[str, str] = ("en", "de")
    threads: int = 2

    @classmethod
    def from_config(cls, cfg: Config, user_defined_symbols: Sequence[str] = ()) -> TokenizerSpec:
        """The tokenizer a config asks for (its ``data`` section, ``train.seed``)."""
        d = cfg.data
        return cls(kind=d.tokenizer, vocab_size=d.vocab_size, byte_fallback=d.byte_fallback,
                   max_sentences=d.tokenizer_sample, seed=cfg.train.seed,
                   user_defined_symbols=tuple(user_defined_symbols), lowercase=d.lowercase, shared=d.shared_vocab,
                   pretokenize=d.pretokenize, langs=(d.src_lang, d.tgt_lang))


def train_tokenizer(texts: Iterable[str], out_dir: str | Path | None = None, spec: TokenizerSpec | None = None,
                    name: str = "tokenizer", **options: Any) -> Tokenizer:
    """Train a tokenizer on ``texts`` (one sentence each) as ``spec`` says, with ``options`` replacing its fields
    (``train_tokenizer(texts, vocab_size=400)``), and save it to ``out_dir`` when given."""
    spec = dataclasses.replace(spec or TokenizerSpec(), **options)
    kind, lowercase = spec.kind, spec.lowercase
    if kind == "char":
        if lowercase:
            raise DataError("lowercase needs a BPE tokenizer (a char tokenizer has no normalization rule)")
        seen: set[str] = set()
        for t in texts:
            seen.update(t)
        if not seen:
            raise DataError("cannot train a char tokenizer: the training text is empty")
        tok: Tokenizer = CharTokenizer(seen)
    elif kind == "bpe":
        tok = _train_bpe(texts, spec.vocab_size, spec.byte_fallback, spec.max_sentences, spec.seed, spec.threads,
                         spec.user_defined_symbols, lowercase)
    else:
        raise DataError(f"tokenizer kind {kind!r}: expected bpe or char")
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tok.save(out_dir, name)
    return tok


def _check_vocab_size(vocab_size: int, byte_fallback: bool, symbols: list[str]) -> None:
    """Refuse (DataError) a ``vocab_size`` without room for the specials, the byte pieces (with
    ``byte_fallback``), the user-defined ``symbols`` and one piece more."""
    min_vocab = len(SPECIAL_PIECES) + (N_BYTES if byte_fallback else 0) + len(symbols) + 1
    if vocab_size < min_vocab:
        need = "the 4 specials + 256 byte pieces + 1" if byte_fallback else "the 4 specials + 1"
        raise DataError(
            f"vocab_size={vocab_size} is too small for a BPE tokenizer"
            f"{' with byte_fallback' if byte_fallback else ''}: it needs at least {min_vocab} ({need})"
        )


def _training_error(e: RuntimeError, vocab_size: int, byte_fallback: bool) -> DataError:
    """SentencePiece's training failure ``e`` as one line: a vocabulary too small for the corpus' alphabet
    says how large it must be."""
    msg = first_line(e)
    m = re.search(r"required_chars\. (\d+) vs (\d+)", msg)
    if m:
        # character_coverage=1.0 keeps every character, so the corpus alphabet must fit.
        return DataError(
            f"vocab_size={vocab_size} is too small for this corpus: the specials"
            f"{', 256 byte pieces' if byte_fallback else ''} and its distinct characters "
            f"need at least {m.group(2)}"
        )
    return DataError(f"SentencePiece training failed: {msg}")


def _train_bpe(
    texts: Iterable[str], vocab_size: int, byte_fallback: bool, max_sentences: int, seed: int, threads: int,
    user_defined_symbols: Sequence[str] = (), lowercase: bool = False,
) -> SentencePieceTokenizer:
    """A SentencePiece BPE model of up to ``vocab_size`` pieces (fewer from a small corpus), trained on a seeded
    sample of ``texts``: lossless, or lowercasing with ``lowercase``."""
    symbols = [s for s in dict.fromkeys(user_defined_symbols) if s]
    _check_vocab_size(vocab_size, byte_fallback, symbols)
    sample = [t for t in _sample(texts, max_sentences, seed) if t.strip()]
    if not sample:
        raise DataError("cannot train a BPE tokenizer: the training text is empty")
    writer = io.BytesIO()
    rules = _lowercase_rules_file() if lowercase else None
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=writer,
            model_type="bpe",
            vocab_size=vocab_size,
            hard_vocab_limit=False,  # a small corpus yields fewer pieces instead of an error
            byte_fallback=byte_fallback,
            character_coverage=1.0,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_piece=SPECIAL_PIECES[PAD_ID],
            unk_piece=SPECIAL_PIECES[UNK_ID],
            bos_piece=SPECIAL_PIECES[BOS_ID],
            eos_piece=SPECIAL_PIECES[EOS_ID],
            **({"user_defined_symbols": symbols} if symbols else {}),
            # Lossless: no NFKC, keep repeated/leading whitespace, so decode(encode(x)) == x
            # (or == x lowercased, with the opt-in rule).
            **({"normalization_rule_tsv": str(rules)} if rules else {"normalization_rule_name": "identity"}),
            remove_extra_whitespaces=False,
            # We sampled above; SentencePiece's own sampling would add a second, unseeded shuffle.
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=max(1, min(threads, os.cpu_count() or 1)),
            minloglevel=2,
        )
    except RuntimeError as e:
        raise _training_error(e, vocab_size, byte_fallback) from None
    finally:
        if rules is not None:
            rules.unlink(missing_ok=True)
    return SentencePieceTokenizer(writer.getvalue())


def _lowercase_rules_file() -> Path:
    """A SentencePiece normalization TSV mapping each Unicode character that has a different lowercase
    form to it (per character: a final capital sigma becomes a plain sigma; no NFKC); the caller deletes it.
    Lines are ``source code points<TAB>target code points`` in hex, as SentencePiece reads them."""
    import tempfile

    rows = []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:  # surrogates are not characters
            continue
        c = chr(cp)
        low = c.lower()
        if low != c:
            rows.append(f"{cp:X}\t{' '.join(f'{ord(x):X}' for x in low)}")
    fd, name = tempfile.mkstemp(prefix="aiayn-lowercase-", suffix=".tsv")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(rows) + "\n")
    return Path(name)


def _sample(texts: Iterable[str], k: int, seed: int) -> list[str]:
    """A seeded uniform sample of at most ``k`` texts (reservoir sampling), in corpus order."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    for n, t in enumerate(texts):
        if n < k:
            reservoir.append((n, t))
        else:
            j = rng.randint(0, n)
            if j < k:
                reservoir[j] = (n, t)
    reservoir.sort()
    return [t for _, t in reservoir]


@dataclass(frozen=True)
class SpecialIds:
    """The ids a model reserves. aiayn's tokenizers use PAD_ID, UNK_ID, BOS_ID, EOS_ID and start the decoder
    from BOS; a run imported from another toolkit keeps that toolkit's ids (Marian: eos 0, unk 1, pad last,
    decoder start = pad). Code that builds model inputs takes them from ``TokenizerPair.specials``."""

    pad: int = PAD_ID
    unk: int = UNK_ID
    bos: int = BOS_ID
    eos: int = EOS_ID
    decoder_start: int = BOS_ID  # the decoder's first input (teacher forcing and search)

    def to_json(self) -> dict[str, int]:
        return {"pad": self.pad, "unk": self.unk, "bos": self.bos, "eos": self.eos, "decoder_start": self.decoder_start}

    @classmethod
    def from_json(cls, d: dict) -> SpecialIds:
        """Read ``tokenizer.json``'s ``special_ids`` (files written before ``decoder_start``: it is ``bos``)."""
        ids = {k: int(d[k]) for k in ("pad", "unk", "bos", "eos")}
        return cls(**ids, decoder_start=int(d.get("decoder_start", ids["bos"])))


@dataclass
class TokenizerPair:
    """Source and target tokenizers; ``src is tgt`` when the vocabulary is shared. ``specials``: the ids
    the model reserves (aiayn's by default)."""

    src: Tokenizer
    tgt: Tokenizer
    specials: SpecialIds = SpecialIds()

    @property
    def shared(self) -> bool:
        """One id space for both sides (one vocabulary: the model may share its embeddings). Moses-pretokenized
        sides share one model but tokenize in their own language; Marian's two SentencePiece models map
        through one vocab.json."""
        return _inner(self.src).same_ids(_inner(self.tgt))

    @property
    def pretokenize(self) -> str:
        """``"moses"`` when both sides are :class:`MosesPretokenized`, else ``"none"``."""
        return "moses" if isinstance(self.src, MosesPretokenized) else "none"

    def save(self, directory: str | Path) -> Path:
        """Write the model file(s) and ``tokenizer.json`` into ``directory`` (RUN/tokenizer)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if isinstance(self.src, MosesPretokenized) != isinstance(self.tgt, MosesPretokenized):
            raise DataError("both sides of a tokenizer pair must be Moses-pretokenized, or neither")
        if self.pretokenize == "moses":
            meta_langs = {"src_lang": self.src.lang, "tgt_lang": self.tgt.lang}
        else:
            meta_langs = {}
        if isinstance(self.src, MarianPieces):
            files = save_marian_pair(self.src, self.tgt, d)
        elif self.shared:
            name = self.src.save(d, "shared").name
            files = {"src": name, "tgt": name}
        else:
            files = {"src": self.src.save(d, "src").name, "tgt": self.tgt.save(d, "tgt").name}
        meta = {
            "kind": self.src.kind,
            "shared": self.shared,
            **files,
            "src_vocab_size": self.src.vocab_size,
            "tgt_vocab_size": self.tgt.vocab_size,
            "lowercase": self.src.lowercases,
            "pretokenize": self.pretokenize,
            **meta_langs,
            "special_ids": self.specials.to_json(),
        }
        atomic_write_bytes(d / PAIR_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
        return d

    @classmethod
    def load(cls, directory: str | Path) -> TokenizerPair:
        """Read what :meth:`save` wrote; a missing or broken file is a one-line :class:`DataError`."""
        d = Path(directory)
        meta_path = d / PAIR_FILE
        if not meta_path.is_file():
            raise DataError(f"{meta_path}: no such file (not a tokenizer directory)")
        try:
            meta = read_json(meta_path)
            src_name, tgt_name = Path(meta["src"]).stem, Path(meta["tgt"]).stem
            pretokenize = meta.get("pretokenize", "none")  # files written before the option: none
            if pretokenize not in PRETOKENIZERS:
                raise ValueError(f"pretokenize {pretokenize!r}, expected one of {', '.join(PRETOKENIZERS)}")
            langs = (str(meta["src_lang"]), str(meta["tgt_lang"])) if pretokenize == "moses" else None
            specials = SpecialIds.from_json(meta["special_ids"]) if "special_ids" in meta else SpecialIds()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{meta_path}: not a valid tokenizer description ({first_line(e)})") from None
        if meta.get("kind") == MarianPieces.kind:
            return cls(*load_marian_pair(d, meta), specials)
        src = load_tokenizer(d, src_name)
        tgt = src if meta.get("shared") or src_name == tgt_name else load_tokenizer(d, tgt_name)
        if langs is not None:
            src, tgt = MosesPretokenized(src, langs[0]), MosesPretokenized(tgt, langs[1])
        return cls(src, tgt, specials)


def tokenizer_plan(kind: str, vocab_size: int, shared: bool) -> str:
    """What a tokenizer training is asked for, in words: a char tokenizer's vocabulary is the characters the
    text holds, whatever ``data.vocab_size`` says."""
    size = "one piece per character of the text" if kind == "char" else f"vocab {vocab_size}"
    return f"a {kind} tokenizer ({size}, {'shared' if shared else 'separate'})"


def train_tokenizer_pair(src_texts: Iterable[str], tgt_texts: Iterable[str], out_dir: str | Path | None = None,
                         spec: TokenizerSpec | None = None, **options: Any) -> TokenizerPair:
    """Train one shared tokenizer on both sides (the paper's shared source-target BPE) or one per side, as ``spec``
    says with ``options`` replacing its fields, and save the pair to ``out_dir`` when given.

    With ``shared``, ``max_sentences`` bounds the source and target texts together. ``pretokenize="moses"``: each
    side's text is Moses-processed in its language before the model trains on it, and the pair returned does the
    same on every encode (:class:`MosesPretokenized`).
    """
    spec = dataclasses.replace(spec or TokenizerSpec(), **options)
    pretokenize, langs, lowercase = spec.pretokenize, spec.langs, spec.lowercase
    if pretokenize not in PRETOKENIZERS:
        raise DataError(f"pretokenize {pretokenize!r}: expected one of {', '.join(PRETOKENIZERS)}")
    if pretokenize == "moses":
        src_steps, tgt_steps = MosesSteps(langs[0], lowercase), MosesSteps(langs[1], lowercase)
        src_texts = [src_steps(t) for t in src_texts]
        tgt_texts = [tgt_steps(t) for t in tgt_texts]
    if spec.shared:
        tok = train_tokenizer(_chain(src_texts, tgt_texts), spec=spec)
        src, tgt = tok, tok
    else:
        src = train_tokenizer(src_texts, spec=spec)
        tgt = train_tokenizer(tgt_texts, spec=spec)
    if pretokenize == "moses":
        src, tgt = MosesPretokenized(src, langs[0]), MosesPretokenized(tgt, langs[1])
    pair = TokenizerPair(src, tgt)
    if out_dir is not None:
        pair.save(out_dir)
    return pair


def _chain(*parts: Iterable[str]) -> Iterator[str]:
    for p in parts:
        yield from p
