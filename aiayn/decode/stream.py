"""Streaming translation: read lines, decode them chunk by chunk, write each chunk's output at once.

``aiayn translate`` reads its input in chunks of ``chunk`` lines (1 when stdin is a terminal: an
interactive session), translates each chunk (sorted by length into token-budget batches inside the
chunk) and writes and flushes its output before reading on, so memory stays flat on any input size
and a pipe sees output while later input is still coming. Output formats, one record per input line,
in order:

* ``text``: the best translation; with ``nbest`` N > 1, exactly N lines per input line, best first
  (empty lines fill up when fewer hypotheses exist, so line ``k * N + j`` is always hypothesis j of input k).
* ``tsv``: one row per hypothesis, ``line<TAB>rank<TAB>score<TAB>logprob<TAB>text`` (1-based line and rank;
  an empty input line has no rows).
* ``json``: one object per input line, ``{"line", "src", "hyps": [{"text", "score", "logprob", "tokens"}]}``
  (``hyps`` empty for an empty line; a score that is not a finite number is ``null``, as JSON has no NaN).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from aiayn.config import DecodeOptions
from aiayn.decode.translator import Translation, Translator
from aiayn.errors import DataError

FORMATS = ("text", "tsv", "json")


def no_newlines(text: str) -> str:
    """A model can emit a newline piece (byte fallback); one output line per input line must hold."""
    return text.replace("\r", " ").replace("\n", " ")


def _finite(x: float | None) -> float | None:
    """JSON has no NaN: a score that is not a finite number (or was not computed) is null."""
    return None if x is None or not math.isfinite(x) else float(x)


def hypothesis_json(h: Translation) -> dict[str, Any]:
    """One hypothesis as JSON: ``{"text", "score", "logprob", "tokens"}`` (``aiayn translate --format json``
    and ``aiayn serve`` write the same)."""
    return {"text": h.text, "score": _finite(h.score), "logprob": _finite(h.logprob), "tokens": h.tokens}


def format_json(line: int, src: str, hyps: list[Translation]) -> str:
    """The ``json`` record of one input line (see the module docstring)."""
    rec = {"line": line, "src": src, "hyps": [hypothesis_json(h) for h in hyps]}
    return json.dumps(rec, ensure_ascii=False, allow_nan=False)


def format_record(fmt: str, line: int, src: str, hyps: list[Translation], nbest: int) -> str:
    """The output of one input line in ``fmt``, ending with a newline."""
    if fmt == "json":
        return format_json(line, src, hyps) + "\n"
    if fmt == "tsv":
        return "".join(f"{line}\t{r}\t{h.score:.6f}\t{h.logprob:.6f}\t{no_newlines(h.text)}\n"
                       for r, h in enumerate(hyps, start=1))
    texts = [no_newlines(h.text) for h in hyps[:nbest]]
    return "".join(t + "\n" for t in texts + [""] * (nbest - len(texts)))


MAX_LINE = 16 << 20  # one sentence (or paragraph) a line: far shorter; /dev/zero as --input has no line end at all


def iter_lines(stream: IO, name: str = "<stdin>", max_line: int = MAX_LINE) -> Iterator[str]:
    """Lines of a binary or text stream without their line ending (``\\n`` or ``\\r\\n``), read one at a time.
    Bytes must be UTF-8: a bad byte is a :class:`DataError` naming the 1-based line; so is a line longer than
    ``max_line`` (read no further: an endless one, from a device, would take all memory)."""
    for n, raw in enumerate(iter(lambda: stream.readline(max_line + 1), None), start=1):
        if not raw:
            return
        if len(raw) > max_line and raw[-1:] not in ("\n", b"\n"):
            raise DataError(f"{name}: line {n}: longer than {max_line:,} characters (not one sentence a line)")
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{name}: line {n}: not valid UTF-8 (byte 0x{raw[e.start:e.start + 1].hex()} "
                                f"at column {e.start + 1})") from None
        if n == 1 and raw.startswith("\ufeff"):
            raw = raw[1:]  # a byte-order mark
        if raw.endswith("\n"):
            raw = raw[:-1]
        yield raw[:-1] if raw.endswith("\r") else raw


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass
class StreamStats:
    lines: int = 0
    translated: int = 0  # non-empty lines


def translate_stream(translator: Translator, lines: Iterable[str], write: Callable[[str], None],
                     opts: DecodeOptions, fmt: str = "text", chunk: int = 2000,
                     on_chunk: Callable[[int], None] | None = None) -> StreamStats:
    """Translate ``lines`` chunk by chunk, calling ``write`` with each chunk's formatted output (then the
    caller flushes); ``on_chunk(n)`` reports progress. Scores are computed only when the format shows them."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    stats = StreamStats()
    scores = fmt != "text" or opts.nbest > 1
    for part in _chunks(lines, max(1, chunk)):
        found = translator.search(part, opts, scores=scores, first_line=stats.lines + 1)
        write("".join(format_record(fmt, stats.lines + i + 1, src, hyps, opts.nbest)
                      for i, (src, hyps) in enumerate(zip(part, found))))
        stats.lines += len(part)
        stats.translated += sum(1 for h in found if h)
        if on_chunk is not None:
            on_chunk(len(part))
    return stats
