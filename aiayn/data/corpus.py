"""Corpus readers with validation: parallel text (optionally .gz), TSV, JSONL and plain text.

Every problem with the input is a :class:`DataError` whose message is one line naming the file
(and line) at fault, which the CLI prints as is. Lines lose only their line ending ("\\n" or
"\\r\\n"); inner and leading whitespace is kept, since whether it matters is the tokenizer's call.
Lines are split on "\\n" only (not on the other characters ``str.splitlines`` breaks at, such as
U+2028 or form feed), so that parallel files stay aligned; only :func:`text_lines` (a language model's text, for its
tokenizer) splits as ``str.splitlines`` does.
"""

from __future__ import annotations

import gzip
import json
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from aiayn.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"
LONG_LINE = 1 << 20  # a line kept for the tokenizer's sample is cut here (SentencePiece skips lines over 16 KB)
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # where str.splitlines breaks


def check_file(path: str | Path) -> Path:
    """``path`` as a Path when it names a file; else one DataError saying what it is instead."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file")
    if p.is_dir():
        raise DataError(f"{p}: is a directory, expected a file")
    return p


def _read_bytes(path: str | Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip (by content, whatever its name)."""
    p = check_file(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"{p}: cannot read ({e.strerror or e})") from None
    if raw[:2] == GZIP_MAGIC:
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{p}: not a valid gzip file ({e})") from None
    return raw


def decode_utf8(data: bytes, path: str | Path, lines_before: int = 0, bom: bool = True) -> str:
    """UTF-8 text (a leading byte-order mark dropped when ``bom``); invalid bytes are an error naming the 1-based
    line (``data`` follows ``lines_before`` lines of the file) and column (never silently replaced)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = lines_before + data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        bad = data[e.start : e.start + 1].hex()
        raise DataError(f"{path}: line {line}: not valid UTF-8 (byte 0x{bad} at column {col})") from None
    return text[1:] if bom and text.startswith("\ufeff") else text


def iter_lines(path: str | Path) -> Iterator[str]:
    """The lines of a UTF-8 text file (plain or gzip, by content), without their line endings, streamed: memory
    does not grow with the file. Invalid UTF-8 is an error naming the line and column (never replaced)."""
    p = check_file(path)
    gz = False
    try:
        # Opened once and sniffed without consuming (peek): a pipe (--src <(zcat ...)) cannot be read twice.
        with open(p, "rb") as raw_file:
            gz = raw_file.peek(2)[:2] == GZIP_MAGIC
            f = gzip.GzipFile(fileobj=raw_file, mode="rb") if gz else raw_file
            for n, raw in enumerate(f, start=1):  # binary lines end at b"\n" only
                line = raw[:-1] if raw.endswith(b"\n") else raw
                if line.endswith(b"\r"):
                    line = line[:-1]
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{p}: line {n}: not valid UTF-8 (byte 0x{line[e.start:e.start + 1].hex()} at "
                                    f"column {e.start + 1})") from None
                yield text[1:] if n == 1 and text.startswith("\ufeff") else text  # drop a byte-order mark
    except OSError as e:
        if gz and not isinstance(e, FileNotFoundError):
            raise DataError(f"{p}: not a valid gzip file ({e})") from None
        raise DataError(f"{p}: cannot read ({e.strerror or e})") from None
    except (EOFError, zlib.error) as e:
        raise DataError(f"{p}: not a valid gzip file ({e})") from None


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file (plain or gzip), without their line endings."""
    return list(iter_lines(path))


def stdin_stream() -> IO:
    """Standard input as bytes when possible; a :class:`DataError` when it is closed (``<&-``)."""
    stream = sys.stdin
    if stream is None or stream.closed:
        raise DataError("no input: standard input is closed (give --input FILE)")
    return getattr(stream, "buffer", stream)


def read_stdin_lines() -> list[str]:
    """The lines of standard input (UTF-8), as :func:`read_lines` reads a file; a closed stdin is a DataError."""
    stream = stdin_stream()
    raw = stream.read()
    if isinstance(raw, str):  # a text stream without a binary buffer
        raw = raw.encode("utf-8")
    return _split_lines(decode_utf8(raw, "<stdin>"))


def _split_lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def read_text(path: str | Path) -> str:
    """A whole UTF-8 text file (plain or gzip) as one string, for language modelling."""
    text = decode_utf8(_read_bytes(path), path)
    if not text:
        raise DataError(f"{path}: empty corpus (the file has no text)")
    return text


def text_chunks(path: str | Path, size: int) -> Iterator[str]:
    """The text of ``path`` (plain or gzip, by content; a leading byte-order mark dropped, as
    :func:`read_text` reads it), streamed in pieces of about ``size`` bytes, each ending after a newline, else
    before a space (else it grows): never inside a character, a line break or a word."""
    gz = False
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == GZIP_MAGIC
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            carry, lines, first = b"", 0, True
            while True:
                block = f.read(size)
                data = carry + block if carry else block
                cut = len(data) if not block else (data.rfind(b"\n") + 1 or max(data.rfind(b" "), 0))
                if not cut:
                    if not block:
                        return
                    carry = data
                    continue
                chunk, carry = data[:cut], data[cut:]
                text = decode_utf8(chunk, path, lines, bom=first)
                lines += chunk.count(b"\n")
                first = False
                if text:
                    yield text
    except OSError as e:
        raise DataError(f"{path}: cannot read ({'not a valid gzip file: ' if gz else ''}{e.strerror or e})"
                        ) from None
    except (EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a valid gzip file ({e})") from None


def count_chars(path: str | Path, size: int) -> tuple[int, bool]:
    """The characters of a text (:func:`text_chunks`) and whether any is not whitespace."""
    n, visible = 0, False
    for text in text_chunks(path, size):
        n += len(text)
        visible = visible or not text.isspace()
    return n, visible


def text_parts(path: str | Path, split: int, size: int) -> Iterator[tuple[str, str, bool]]:
    """(split name, piece, whether the piece starts its part): the text's pieces (:func:`text_chunks` of ``size``
    bytes), the first ``split`` characters for train, the rest for valid (the piece that holds the boundary cut in
    two)."""
    pos = 0
    for text in text_chunks(path, size):
        cut = min(max(split - pos, 0), len(text))  # the piece's characters before the boundary
        if cut:
            yield "train", text[:cut], pos == 0
        if cut < len(text):
            yield "valid", text[cut:], pos + cut == split
        pos += len(text)


def text_lines(pieces: Iterable[str]) -> Iterator[str]:
    """The lines of the text ``pieces`` make, as ``text.splitlines()`` gives them (a line split over two pieces
    joined again; one longer than :data:`LONG_LINE` cut there)."""
    tail = ""
    for piece in pieces:
        lines = (tail + piece).splitlines(keepends=True)
        tail = "" if lines[-1][-1] in LINE_BREAKS else lines.pop()[:LONG_LINE]
        for line in lines:
            yield line[:-2] if line.endswith("\r\n") else line[:-1]
    if tail:
        yield tail


def text_chars(pieces: Iterable[str]) -> str:
    """Every character of the text ``pieces`` make, once each, in code point order."""
    seen = np.zeros(0x110000, dtype=bool)
    for piece in pieces:
        seen[np.frombuffer(piece.encode("utf-32-le"), dtype="<u4")] = True
    return "".join(map(chr, np.flatnonzero(seen)))


def _n_lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def iter_parallel(src_path: str | Path, tgt_path: str | Path) -> Iterator[tuple[str, str]]:
    """Sentence pairs from two line-aligned files (plain or .gz), streamed; files of different lengths are an
    error naming both counts (found when the shorter one ends)."""
    src, tgt = iter_lines(src_path), iter_lines(tgt_path)
    n = 0
    for s in src:
        t = next(tgt, None)
        if t is None:
            raise DataError(f"parallel files differ in length: {src_path} has {_n_lines(n + 1 + sum(1 for _ in src))}, "
                            f"{tgt_path} has {_n_lines(n)}")
        n += 1
        yield s, t
    rest = sum(1 for _ in tgt)
    if rest:
        raise DataError(f"parallel files differ in length: {src_path} has {_n_lines(n)}, "
                        f"{tgt_path} has {_n_lines(n + rest)}")


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> list[tuple[str, str]]:
    """Sentence pairs from two line-aligned files (plain or .gz)."""
    return read_pairs("text", src_path, tgt_path)


def iter_tsv(path: str | Path, src_field: str = "src", tgt_field: str = "tgt") -> Iterator[tuple[str, str]]:
    """Sentence pairs from a tab-separated file (plain or .gz), streamed.

    Columns are named by a header row, or, when both fields are column indices ("0", "1", ...),
    the file has no header and columns are taken by position. Fields are split on tabs only:
    no CSV quoting, as in the TSV files MT corpora ship (a quote is just a character).
    """
    lines = iter_lines(path)
    by_index = src_field.isdigit() and tgt_field.isdigit()
    if by_index:
        cols, first = (int(src_field), int(tgt_field)), 1
    else:
        header_line = next(lines, None)
        if header_line is None:
            raise DataError(f"empty corpus: {path} has no lines")
        header = header_line.split("\t")
        for f in (src_field, tgt_field):
            if f not in header:
                raise DataError(f"{path}: no column {f!r} in the header row (columns: {', '.join(header)})")
        cols, first = (header.index(src_field), header.index(tgt_field)), 2
    need = max(cols) + 1
    for n, line in enumerate(lines, start=first):
        parts = line.split("\t")
        if len(parts) < need:
            raise DataError(f"{path}: line {n}: {len(parts)} columns, expected at least {need}")
        yield parts[cols[0]], parts[cols[1]]


def read_tsv(path: str | Path, src_field: str = "src", tgt_field: str = "tgt") -> list[tuple[str, str]]:
    """Sentence pairs from a tab-separated file (plain or .gz): :func:`iter_tsv`, collected."""
    return read_pairs("tsv", path, None, src_field, tgt_field)


def _jsonl_objects(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line_number, object)`` for each non-blank line of a JSON-lines file (plain or .gz), streamed."""
    for n, line in enumerate(iter_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}: line {n}: expected a JSON object, got {type(row).__name__}")
        yield n, row


def read_jsonl_rows(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (plain or .gz), one per non-blank line."""
    rows = [row for _, row in _jsonl_objects(path)]
    if not rows:
        raise DataError(f"empty corpus: {path} has no rows")
    return rows


def iter_jsonl(path: str | Path, src_field: str = "src", tgt_field: str = "tgt") -> Iterator[tuple[str, str]]:
    """Pairs ``(row[src_field], row[tgt_field])`` from a JSON-lines file, streamed; both must be strings."""
    for n, row in _jsonl_objects(path):
        for f in (src_field, tgt_field):
            if f not in row:
                raise DataError(f"{path}: line {n}: no field {f!r} (fields: {', '.join(map(str, row))})")
            if not isinstance(row[f], str):
                raise DataError(f"{path}: line {n}: field {f!r} is {type(row[f]).__name__}, expected a string")
        yield row[src_field], row[tgt_field]


def read_jsonl(path: str | Path, src_field: str = "src", tgt_field: str = "tgt") -> list[tuple[str, str]]:
    """:func:`iter_jsonl`, collected."""
    return read_pairs("jsonl", path, None, src_field, tgt_field)


def iter_pairs(
    fmt: str, src_path: str | Path, tgt_path: str | Path | None = None, src_field: str = "src",
    tgt_field: str = "tgt",
) -> Iterator[tuple[str, str]]:
    """Dispatch on ``data.format``, streamed: ``text`` needs both paths; ``tsv`` / ``jsonl`` read ``src_path``."""
    if fmt == "text":
        if tgt_path is None:
            raise DataError(f"format text needs a target file beside {src_path}")
        return iter_parallel(src_path, tgt_path)
    if fmt == "tsv":
        return iter_tsv(src_path, src_field, tgt_field)
    if fmt == "jsonl":
        return iter_jsonl(src_path, src_field, tgt_field)
    raise DataError(f"data format {fmt!r}: expected text, tsv or jsonl")


def read_pairs(
    fmt: str, src_path: str | Path, tgt_path: str | Path | None = None, src_field: str = "src",
    tgt_field: str = "tgt",
) -> list[tuple[str, str]]:
    """:func:`iter_pairs` (the one dispatch on ``data.format``), collected: an empty corpus is one error."""
    pairs = list(iter_pairs(fmt, src_path, tgt_path, src_field, tgt_field))
    if not pairs:
        raise DataError(f"empty corpus: {src_path} and {tgt_path} have no lines" if fmt == "text"
                        else f"empty corpus: {src_path} has no rows")
    return pairs


def split_files(data: Any, split: str) -> tuple[str | Path, str | Path | None]:
    """``data.<split>_src`` and ``data.<split>_tgt`` of a config's data section (a file with both sides: no target),
    or the one error when no source file is set."""
    src, tgt = getattr(data, f"{split}_src"), getattr(data, f"{split}_tgt")
    if src is None:
        raise DataError(f"data.{split}_src is not set (and no data.dataset is named)")
    return src, tgt


def clean_pairs(
    pairs: Sequence[tuple[str, str]],
    ids: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    max_len: int | None = None,
) -> tuple[list[int], dict[str, int]]:
    """Indices of the pairs to train on, and counts of what was dropped (for the caller to log).

    A pair is dropped as ``empty`` when either side is empty or only whitespace, and as
    ``too_long`` when ``ids`` (the token ids of each side, no specials) are given and a side has
    ``len + 1 > max_len`` tokens: the + 1 is the EOS the batcher appends to the source and the
    BOS it prepends to the target, so every kept pair fits ``max_len`` positions.
    Returns ``(kept_indices, {"empty": n, "too_long": m, "kept": k})``.
    """
    if ids is not None and len(ids) != len(pairs):
        raise ValueError(f"clean_pairs: {len(pairs)} pairs but {len(ids)} token-id pairs")
    kept: list[int] = []
    empty = too_long = 0
    for i, (s, t) in enumerate(pairs):
        if not s.strip() or not t.strip():
            empty += 1
        elif max_len is not None and ids is not None and max(len(ids[i][0]), len(ids[i][1])) + 1 > max_len:
            too_long += 1
        else:
            kept.append(i)
    return kept, {"empty": empty, "too_long": too_long, "kept": len(kept)}


def describe_clean_stats(stats: dict[str, int], max_len: int | None = None) -> str:
    """One log line for :func:`clean_pairs`' counts, e.g. ``kept 990 of 1000 pairs (...)``."""
    total = stats["kept"] + stats["empty"] + stats["too_long"]
    limit = f" than {max_len} tokens" if max_len is not None else ""
    return (
        f"kept {stats['kept']} of {total} pairs (dropped {stats['empty']} with an empty side, "
        f"{stats['too_long']} longer{limit})"
    )
