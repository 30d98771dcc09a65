"""LibreTranslate's ``format: html``: the text between the tags is translated, the markup is kept as it came.

The document is split by Python's own HTML parser (:mod:`html.parser`, the standard library's tokenizer of
HTML) into markup and text nodes; each text node with words in it is translated as one sentence (its
surrounding white space kept), the text of ``<script>``, ``<style>``, ``<code>`` and ``<pre>`` is left alone, and
the pieces are joined again: start tags with their attributes (entities included), comments and declarations
come back byte for byte, end tags in lower case; text without a letter or digit is kept as it is.
LibreTranslate does the same with BeautifulSoup (``translatehtml``); a sentence split by inline tags
(``a <b>dog</b> runs``) is translated piece by piece there too.
"""

from __future__ import annotations

import html
from html.parser import HTMLParser

KEEP_TEXT_IN = ("script", "style", "code", "pre")


class _Splitter(HTMLParser):
    """Markup and text, in order: ``parts`` holds strings (markup, and text kept as it is) and ints (the index
    of a text node to translate in ``texts``)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str | int] = []
        self.texts: list[str] = []
        self.keep = 0  # inside elements whose text is not prose

    def handle_starttag(self, tag, attrs) -> None:
        self.parts.append(self.get_starttag_text() or "")
        self.keep += tag in KEEP_TEXT_IN

    def handle_startendtag(self, tag, attrs) -> None:
        self.parts.append(self.get_starttag_text() or "")

    def handle_endtag(self, tag) -> None:
        self.parts.append(f"</{tag}>")
        self.keep -= tag in KEEP_TEXT_IN and self.keep > 0

    def handle_data(self, data) -> None:
        if self.keep or not any(c.isalnum() for c in data):  # nothing to translate: spaces, punctuation
            self.parts.append(html.escape(data, quote=False) if not self.keep else data)
            return
        lead, core = data[:len(data) - len(data.lstrip())], data.strip()
        trail = data[len(lead) + len(core):]
        self.parts += [html.escape(lead, quote=False), len(self.texts), html.escape(trail, quote=False)]
        self.texts.append(core)

    def handle_comment(self, data) -> None:
        self.parts.append(f"<!--{data}-->")

    def handle_decl(self, decl) -> None:
        self.parts.append(f"<!{decl}>")

    def handle_pi(self, data) -> None:
        self.parts.append(f"<?{data}>")

    def unknown_decl(self, data) -> None:
        self.parts.append(f"<![{data}]>")


def split_html(document: str) -> tuple[list[str | int], list[str]]:
    """(parts, texts): the document as markup strings and indices into ``texts``, the text nodes to translate."""
    p = _Splitter()
    p.feed(document)
    p.close()
    return p.parts, p.texts


def join_html(parts: list[str | int], translated: list[str]) -> str:
    """The document again, each text node replaced by its translation (escaped as HTML text)."""
    return "".join(html.escape(translated[x], quote=False) if isinstance(x, int) else x for x in parts)
