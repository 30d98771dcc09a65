"""A rule-based sentence splitter in MiniSBD's model format, so that an Argos Translate package splits text into
sentences offline.

Argos Translate (1.10+) splits a paragraph into sentences with MiniSBD before it translates sentence by sentence;
MiniSBD runs an ONNX model that labels each character of the paragraph (0: inside a token, 1: token end,
2: sentence end) and reads its vocabulary and settings from the model's metadata. Without a model in the package
it downloads a trained one for the source language on first use, which an offline machine cannot do. This module
writes a small model that needs no training, so an exported package works without a network:

    sentence end at character i  <=>  i is a sentence-final mark (. ! ? ...), or a closing quote or bracket
                                      right after one, followed by whitespace and then a sentence start (an
                                      upper-case letter, a digit, an opening quote or bracket, or a letter of a
                                      script without case)
                                  or  i is a full-width mark (。！？) or a danda (।), whatever follows;
    the last character of a paragraph always ends a sentence (MiniSBD's own rule).

That is the rule of Moses' split-sentences.perl without its lists of non-breaking prefixes, so "Dr. Smith" is
split after "Dr."; a trained MiniSBD model (``aiayn export argos --sentence-model``) knows such abbreviations.

:func:`split_sentences` is the same rule in Python, read as MiniSBD reads its model (white space runs collapsed,
1,000-unit windows): what ``aiayn serve``'s LibreTranslate routes and ``aiayn translate --split-sentences`` split
with, so that they split as an exported package does in Argos (tests/test_sentence_split.py runs both on the same
texts). The graph (ONNX opset 13) is five table lookups and shifts: no weights to learn. It is serialized here with
a few lines of protocol-buffer encoding, so aiayn needs no ``onnx`` package to write it.
"""

from __future__ import annotations

import json
import struct
import unicodedata

# MiniSBD's vocabulary starts with these units (stanza's VOCAB_PREFIX without the two it never uses).
PAD, UNK = "<PAD>", "<UNK>"
END_MARKS = ".!?\u2026\u203d"  # . ! ? … ‽ : a sentence ends here when whitespace and a sentence start follow
ALWAYS_END = "\u3002\uff01\uff1f\u0964\u0965\u061f\u06d4"  # 。！？ । ॥ ؟ ۔ : end a sentence whatever follows
CLOSERS = "\"')]}\u00bb\u203a\u2019\u201d"  # a mark followed by one of these ends a sentence after it: 'Hi." Then'
OPENERS = "\"'([{\u00ab\u00bb\u2018\u201a\u201c\u201e\u2039\u203a\u00bf\u00a1-\u2013\u2014"  # may open a sentence
# Letters whose case the rule reads: Latin, Greek, Cyrillic, Armenian and Georgian. Characters outside the
# vocabulary map to <UNK>, which counts as a sentence start (most are letters of scripts without case).
CASED_RANGES = ((0x0041, 0x024F), (0x0370, 0x03FF), (0x0400, 0x052F), (0x0531, 0x058F), (0x10A0, 0x10FF),
                (0x1E00, 0x1FFF))
MAX_SEQLEN = 1000  # MiniSBD labels a paragraph in windows of this many units (its config's max_seqlen)
LABELS = 5  # MiniSBD reads argmax over 5 classes: 0 none, 1 token end, 2 sentence end, 3-4 multi-word tokens


def _units() -> list[str]:
    """The model's vocabulary: id -> character (0 <PAD>, 1 <UNK>, then every character a table gives a role)."""
    chars = {" "} | set(END_MARKS) | set(ALWAYS_END) | set(OPENERS) | set(CLOSERS) | set("0123456789")
    for lo, hi in CASED_RANGES:
        chars.update(chr(c) for c in range(lo, hi + 1) if unicodedata.category(chr(c)).startswith("L"))
    return [PAD, UNK] + sorted(chars)


def _starts_sentence(unit: str) -> bool:
    if unit in (PAD, UNK):
        return True  # the end of the paragraph, or a character of a script without case
    return unit.isupper() or unit.istitle() or unit.isdigit() or unit in OPENERS or unit.upper() == unit.lower()


def _unit(c: str, vocab: frozenset[str]) -> str:
    """The unit MiniSBD feeds the model for character ``c``: any white space reads as a space (its tokenizer's
    rule), a character outside the vocabulary as <UNK>."""
    c = " " if c.isspace() else c
    return c if c in vocab else UNK


_VOCAB = frozenset(_units()[2:])


def sentence_ends(text: str) -> list[int]:
    """The offsets of the characters of ``text`` that end a sentence under the module's rule (the ONNX graph's label
    2), the last character always included. MiniSBD reads a run of white space as one space, so the rule is read
    on the text so collapsed: a character ends a sentence when it is a mark that always ends one, or a mark that may
    (or a closer right after one) followed by a space and then a sentence start."""
    units, where = [], []  # the units MiniSBD feeds the model, and the offset in ``text`` of each
    for i, c in enumerate(text):
        u = _unit(c, _VOCAB)
        if u == " " and units and units[-1] == " ":
            continue
        units.append(u)
        where.append(i)

    ends, i = [], 0
    while i < len(units):  # MiniSBD labels a long paragraph in windows of MAX_SEQLEN units
        window = units[i:i + MAX_SEQLEN]
        found = _window_ends(window)
        # a window that stops short of the end goes on after its last sentence end (MiniSBD's ``predict``)
        advance = len(window) if not found or i >= len(units) - MAX_SEQLEN else found[-1] + 1
        ends.extend(where[i + j] for j in found if j < advance)
        i += advance
    if text and (not ends or ends[-1] != len(text) - 1):
        ends.append(len(text) - 1)
    return ends


def _window_ends(units: list[str]) -> list[int]:
    """The units of one window that the graph labels as sentence ends (past the window: padding)."""

    def at(j: int) -> str:
        return units[j] if j < len(units) else PAD  # MiniSBD's padding reads as a space and a sentence start

    found = []
    for j, u in enumerate(units):
        ending = u in END_MARKS or (u in CLOSERS and j > 0 and units[j - 1] in END_MARKS)
        if u in ALWAYS_END or (ending and at(j + 1) in (" ", PAD) and _starts_sentence(at(j + 2))):
            found.append(j)
    return found


def split_sentences(paragraph: str) -> list[str]:
    """The sentences of one paragraph as MiniSBD gives them with this module's model (and so Argos Translate
    before it translates): the text between sentence ends, without white space at either end; none for a
    paragraph of white space only. Argos splits a text into paragraphs at each newline first."""
    out, start = [], 0
    for end in sentence_ends(paragraph):
        sentence = paragraph[start:end + 1].strip()
        if sentence:
            out.append(sentence)
        start = end + 1
    return out


# --- a minimal protocol-buffer writer (only what an ONNX ModelProto of this graph needs) -----------------------

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields are two's complement on the wire
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _int(field: int, n: int) -> bytes:
    return _key(field, 0) + _varint(n)


def _bytes(field: int, data: bytes | str) -> bytes:
    data = data.encode("utf-8") if isinstance(data, str) else data
    return _key(field, 2) + _varint(len(data)) + data


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    """(value, next offset) of the varint at ``data[i:]``; ValueError past the end or longer than 10 bytes."""
    n = shift = 0
    while shift < 70:
        if i >= len(data):
            raise ValueError("truncated")
        b = data[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7
    raise ValueError("varint too long")


def onnx_problem(data: bytes) -> str | None:
    """Why ``data`` is not an ONNX model (a ModelProto), or None when it is one as far as a cheap look can tell:
    its top-level protocol-buffer fields are read through to the last byte (the graph itself is skipped, not
    parsed), and an ``ir_version`` (field 1) and a ``graph`` (field 7) must be among them. A text file, an archive
    or a truncated model fails here, in microseconds per megabyte."""
    seen: set[tuple[int, int]] = set()
    i = 0
    try:
        while i < len(data):
            key, i = _read_varint(data, i)
            field, wire = key >> 3, key & 7
            if field == 0 or wire not in (0, 1, 2, 5):
                raise ValueError("bad field key")
            if wire == 0:
                _, i = _read_varint(data, i)
            else:
                size, i = _read_varint(data, i) if wire == 2 else ({1: 8, 5: 4}[wire], i)
                i += size
                if i > len(data):
                    raise ValueError("truncated")
            seen.add((field, wire))
    except ValueError:
        return "not an ONNX model (its bytes are not a whole protocol buffer)"
    if (1, 0) not in seen or (7, 2) not in seen:
        return "not an ONNX model (no " + ("ir_version" if (1, 0) not in seen else "graph") + ")"
    return None


FLOAT, INT64 = 1, 7  # TensorProto.DataType


def _tensor(name: str, dtype: int, values: list, dims: list[int]) -> bytes:
    raw = struct.pack(f"<{len(values)}{'f' if dtype == FLOAT else 'q'}", *values)
    return b"".join(_int(1, d) for d in dims) + _int(2, dtype) + _bytes(8, name) + _bytes(9, raw)


def _value_info(name: str, dtype: int, dims: list[str | int]) -> bytes:
    shape = b"".join(_bytes(1, _int(1, d) if isinstance(d, int) else _bytes(2, d)) for d in dims)
    return _bytes(1, name) + _bytes(2, _bytes(1, _int(1, dtype) + _bytes(2, shape)))


def _node(op: str, inputs: list[str], outputs: list[str]) -> bytes:
    return (b"".join(_bytes(1, i) for i in inputs) + b"".join(_bytes(2, o) for o in outputs) + _bytes(3, outputs[0])
            + _bytes(4, op))


def _initializers(units: list[str]) -> list[bytes]:
    """The graph's constants (TensorProto): a 0/1 table over the vocabulary ``units`` (V,) for each class of
    character the rule asks about, the slicing and padding constants, and the label scores' weight and bias."""
    end = [1.0 if u in END_MARKS else 0.0 for u in units]
    always = [1.0 if u in ALWAYS_END else 0.0 for u in units]
    closer = [1.0 if u in CLOSERS else 0.0 for u in units]
    space = [1.0 if u in (" ", PAD) else 0.0 for u in units]  # PAD: the text ended
    start = [1.0 if _starts_sentence(u) else 0.0 for u in units]
    V = len(units)
    big = 2**62
    return [
        _tensor("end_table", FLOAT, end, [V]), _tensor("always_table", FLOAT, always, [V]),
        _tensor("space_table", FLOAT, space, [V]),
        _tensor("closer_table", FLOAT, closer, [V]), _tensor("start_table", FLOAT, start, [V]),
        _tensor("zero", INT64, [0], [1]), _tensor("minus_one", INT64, [-1], [1]),
        _tensor("one", INT64, [1], [1]), _tensor("stop", INT64, [big], [1]),
        _tensor("axis1", INT64, [1], [1]), _tensor("axis2", INT64, [2], [1]),
        # pads, in ONNX's order (axis 0 begin, axis 1 begin, axis 0 end, axis 1 end)
        _tensor("pad_left", INT64, [0, 1, 0, 0], [4]), _tensor("pad1", INT64, [0, 0, 0, 1], [4]),
        _tensor("pad_value", FLOAT, [1.0], []), _tensor("zero_value", FLOAT, [0.0], []),
        # label scores = M * w + b: M = 0 -> label 0 (score 1 against 0), M >= 1 -> label 2 (score >= 10)
        _tensor("w", FLOAT, [0.0, 0.0, 10.0, 0.0, 0.0], [LABELS]),
        _tensor("b", FLOAT, [1.0, 0.0, 0.0, 0.0, 0.0], [LABELS]),
    ]


def _nodes() -> list[bytes]:
    """The graph's nodes (NodeProto): a character ends a sentence (label 2) when it is a mark that always ends
    one, or a mark (or a closer after one) followed by whitespace and then a sentence start."""
    return [
        _node("Gather", ["end_table", "units"], ["end"]),          # (B, T): a mark that may end a sentence
        _node("Gather", ["always_table", "units"], ["always"]),    # (B, T): a mark that always ends one
        _node("Gather", ["closer_table", "units"], ["closer"]),
        _node("Gather", ["space_table", "units"], ["space"]),
        _node("Gather", ["start_table", "units"], ["start"]),
        _node("Slice", ["space", "one", "stop", "axis1"], ["space_after_cut"]),  # space[:, 1:]
        _node("Pad", ["space_after_cut", "pad1", "pad_value"], ["space_after"]),  # whitespace at i + 1
        _node("Slice", ["start", "one", "stop", "axis1"], ["start_next_cut"]),    # shifted by one, twice (a
        _node("Pad", ["start_next_cut", "pad1", "pad_value"], ["start_next"]),    # single shift by two would
        _node("Slice", ["start_next", "one", "stop", "axis1"], ["start_after_cut"]),  # grow a 1-char text)
        _node("Pad", ["start_after_cut", "pad1", "pad_value"], ["start_after"]),  # a sentence start at i + 2
        _node("Slice", ["end", "zero", "minus_one", "axis1"], ["end_before_cut"]),  # end[:, :-1]
        _node("Pad", ["end_before_cut", "pad_left", "zero_value"], ["end_before"]),  # a mark at i - 1
        _node("Mul", ["closer", "end_before"], ["closes_end"]),
        _node("Add", ["end", "closes_end"], ["ending"]),
        _node("Mul", ["ending", "space_after"], ["end_space"]),
        _node("Mul", ["end_space", "start_after"], ["ends_here"]),
        _node("Add", ["ends_here", "always"], ["m"]),
        _node("Unsqueeze", ["m", "axis2"], ["m3"]),  # (B, T, 1)
        _node("Mul", ["m3", "w"], ["mw"]),
        _node("Add", ["mw", "b"], ["scores"]),      # (B, T, 5)
    ]


def sentence_splitter_onnx(lang: str) -> bytes:
    """The splitter as the bytes of an ONNX model file in MiniSBD's format (inputs ``units`` (B, T) int64 and
    ``features`` (B, T, 0) float; output (B, T, 5) label scores; vocabulary and settings in its metadata)."""
    units = _units()
    inits, nodes = _initializers(units), _nodes()
    graph = (b"".join(_bytes(1, n) for n in nodes) + _bytes(2, "aiayn_sentence_splitter")
             + b"".join(_bytes(5, t) for t in inits)
             + _bytes(11, _value_info("units", INT64, ["batch", "chars"]))
             + _bytes(11, _value_info("features", FLOAT, ["batch", "chars", "features"]))
             + _bytes(12, _value_info("scores", FLOAT, ["batch", "chars", LABELS])))
    vocab = {"lang": lang, "idx": 0, "cutoff": 0, "lower": False, "_id2unit": units,
             "_unit2id": {u: i for i, u in enumerate(units)}}
    config = {"skip_newline": False, "max_seqlen": MAX_SEQLEN, "no_ssplit": False, "batch_size": 32, "feat_funcs": [],
              "use_dictionary": False, "num_dict_feat": 0}
    metadata = {"lang_code": lang, "config": json.dumps(config), "vocab": json.dumps(vocab),
                "lexicon": json.dumps(None)}
    return (_int(1, 8)  # ir_version 8 (onnxruntime 1.10 and later read it)
            + _bytes(2, "aiayn") + _bytes(7, graph)
            + _bytes(8, _bytes(1, "") + _int(2, 13))  # opset_import: the default domain, opset 13
            + b"".join(_bytes(14, _bytes(1, k) + _bytes(2, v)) for k, v in metadata.items()))


# --- how Argos Translate reads a text and joins its translation ---------------------------------------------------

def argos_paragraphs(text: str) -> list[list[str]]:
    """A text as Argos Translate translates it: its paragraphs (cut at every newline), each as its sentences
    (:func:`split_sentences`; none for an empty paragraph)."""
    return [split_sentences(p) for p in text.split("\n")]


def argos_join(paragraphs: list[list[str]]) -> str:
    """The translation of a text from those of its paragraphs' sentences, joined as Argos joins them: the sentences
    of a paragraph by a space (SentencePiece decodes their pieces one after another, each sentence's first piece
    starting a word), the paragraphs by a newline, newlines at the start dropped (Argos' ``lstrip("\\n")``)."""
    return "\n".join(" ".join(s for s in sentences if s) for sentences in paragraphs).lstrip("\n")
