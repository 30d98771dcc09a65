"""LibreTranslate's ``format: html``: the text between the tags is translated, the markup is kept as it came.

The document is split by Python's own HTML parser (:mod:`html.parser`, the standard library's tokenizer of
HTML) into markup and text nodes; each text node with words in it is translated as one sentence (its
surrounding white space kept), the text of ``<script>``, ``<style>``, ``<code>`` and ``<pre>`` is left alone, and
the pieces are joined again. Everything but the translated text comes back byte for byte: the parser says where
each piece starts (``getpos``), and a piece's source is the document from there to the next piece's start, so tags
keep their case and attributes, and comments, CDATA sections, declarations and processing instructions their
exact text (the parser's callbacks hand some of them over cut: a CDATA section without its ``]]>``). Text
without a letter or digit is kept as it is. LibreTranslate does the same with BeautifulSoup (``translatehtml``);
a sentence split by inline tags (``a <b>dog</b> runs``) is translated piece by piece there too.
"""

from __future__ import annotations

import html
from html.parser import HTMLParser

KEEP_TEXT_IN = ("script", "style", "code", "pre")


class _Splitter(HTMLParser):
    """The document's pieces in order, each ``(start, kind, text)``: ``kind`` is ``"data"`` (``text``: the
    character data, entities resolved), ``"keep"`` (data inside ``KEEP_TEXT_IN`` elements) or ``"markup"``;
    ``start`` is the piece's offset in the document."""

    def __init__(self, document: str) -> None:
        super().__init__(convert_charrefs=True)
        self.document = document
        self.line_starts = [0] + [i + 1 for i, c in enumerate(document) if c == "\n"]
        self.pieces: list[tuple[int, str, str]] = []
        self.keep = 0  # inside elements whose text is not prose

    def _offset(self) -> int:
        line, col = self.getpos()  # where the piece being handed over starts (lines counted from 1)
        return self.line_starts[line - 1] + col

    def _markup(self) -> None:
        self.pieces.append((self._offset(), "markup", ""))

    def handle_starttag(self, tag, attrs) -> None:
        self._markup()
        self.keep += tag in KEEP_TEXT_IN

    def handle_startendtag(self, tag, attrs) -> None:
        self._markup()

    def handle_endtag(self, tag) -> None:
        self._markup()
        self.keep -= tag in KEEP_TEXT_IN and self.keep > 0

    def handle_data(self, data) -> None:
        self.pieces.append((self._offset(), "keep" if self.keep else "data", data))

    def handle_comment(self, data) -> None:
        self._markup()

    def handle_decl(self, decl) -> None:
        self._markup()

    def handle_pi(self, data) -> None:
        self._markup()

    def unknown_decl(self, data) -> None:
        self._markup()


def _data_source(source: str, data: str) -> tuple[str, str]:
    """A data piece's source cut in two: its own text, and what follows it before the next piece (what the parser
    skipped without a callback, e.g. ``</>``; kept as markup). Data never holds a ``<`` but a lone one."""
    if data == "<" or "<" not in source:
        cut = len(data) if data == "<" else len(source)
    else:
        cut = source.index("<")
    return source[:cut], source[cut:]


def split_html(document: str) -> tuple[list[str | int], list[str]]:
    """(parts, texts): the document as source strings and indices into ``texts``, the text nodes to translate
    (entities resolved); ``"".join`` of the parts with each index replaced by its text's source is the document."""
    p = _Splitter(document)
    p.feed(document)
    p.close()
    starts = [start for start, _, _ in p.pieces] + [len(document)]
    parts: list[str | int] = []
    texts: list[str] = []
    run: list[tuple[str, str]] = []  # adjacent data pieces (the parser may hand one text over in several)

    def flush() -> None:
        if not run:
            return
        data, source = "".join(d for d, _ in run), "".join(s for _, s in run)
        run.clear()
        if not any(c.isalnum() for c in data):  # nothing to translate: spaces, punctuation
            parts.append(source)
            return
        lead, core = data[:len(data) - len(data.lstrip())], data.strip()
        trail = data[len(lead) + len(core):]
        parts.extend([html.escape(lead, quote=False), len(texts), html.escape(trail, quote=False)])
        texts.append(core)

    for i, (start, kind, data) in enumerate(p.pieces):
        source = document[start:starts[i + 1]]
        if kind == "data":
            own, rest = _data_source(source, data)
            run.append((data, own))
            if rest:
                flush()
                parts.append(rest)
            continue
        flush()
        parts.append(source)
    flush()
    if p.pieces and p.pieces[0][0] > 0:  # never: the parser hands over the document from its first character
        parts.insert(0, document[:p.pieces[0][0]])
    return parts, texts


def join_html(parts: list[str | int], translated: list[str]) -> str:
    """The document again, each text node replaced by its translation (escaped as HTML text)."""
    return "".join(html.escape(translated[x], quote=False) if isinstance(x, int) else x for x in parts)
