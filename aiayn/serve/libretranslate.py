"""LibreTranslate's API over a translation run, so that its clients (``libretranslatepy``, LibreTranslate's web page
and plugins) work against ``aiayn serve`` unchanged. docs/serve.md's protocol table lists every difference.

===============================  ==================================================================================
``POST /translate``              ``q`` (string or list), ``source`` (the run's source language or ``auto``),
                                 ``target``, ``format`` (text; html: text nodes translated, markup kept,
                                 :mod:`aiayn.serve.markup`), ``alternatives``, ``api_key``; other fields not read,
                                 as LibreTranslate; JSON or a form, URL-encoded or multipart (a repeated form
                                 field: its first value). Each text is translated as Argos Translate does it,
                                 sentence by sentence (:func:`~aiayn.interop.sentence_splitter.argos_paragraphs`),
                                 and formatted as LibreTranslate formats it (:func:`libre_format`).
                                 -> ``{"translatedText": str | [str]}`` (+ ``alternatives``)
``GET /languages``               ``[{"code", "name", "targets"}]``, both of the run's languages with the pairs
                                 served (the identity pairs too, as Argos adds them); no key asked (as
                                 LibreTranslate: a client lists languages before it has one)
``POST /detect``                 the run's source language, confidence 100 (nothing is detected)
``GET /frontend/settings``       LibreTranslate's web page settings
===============================  ==================================================================================

Errors come in LibreTranslate's shape, ``{"error": message}`` (:mod:`aiayn.serve.errors`). The API key is
LibreTranslate's ``api_key`` field (:mod:`aiayn.serve.service`).
"""

from __future__ import annotations

import dataclasses
import email.policy
import html
import urllib.parse
from collections import Counter
from email.parser import BytesParser
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiayn.config import DecodeOptions
from aiayn.data.languages import language_name
from aiayn.errors import one_line
from aiayn.interop.paragraphs import joined, plan_texts, regroup
from aiayn.serve.errors import LibreError
from aiayn.serve.markup import join_html, split_html
from aiayn.serve.routes import RouteTable, route
from aiayn.serve.schemas import Limits, parse_body, read_body, source_tokens
from aiayn.serve.service import Service


async def request_fields(request: Request, limits: Limits) -> dict[str, Any]:
    """The request's fields: a JSON object, a form (URL-encoded or multipart, as ``curl -F`` sends it), or (GET) the
    query string."""
    params: dict[str, Any] = dict(request.query_params)
    # libretranslatepy sends its api_key in a form body even on GET /languages
    has_body = request.method == "POST" or request.headers.get("content-length", "0") not in ("", "0")
    raw = await read_body(request, limits) if has_body else b""
    header = request.headers.get("content-type", "")
    ctype = header.split(";", 1)[0].strip().lower()
    if raw and ctype == "application/json":
        params.update(parse_body(raw, limits))
    elif raw and ctype == "multipart/form-data":
        params.update(multipart_fields(raw, header, limits.max_sentences + 16))
    elif raw:
        try:
            form = urllib.parse.parse_qs(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False,
                                         max_num_fields=limits.max_sentences + 16)
        except (UnicodeDecodeError, ValueError) as e:
            raise LibreError(400, f"cannot read the form: {one_line(e)}") from None
        # a repeated field counts once, its first value, as LibreTranslate (Flask's request.values.get) reads it
        params.update({k: v[0] for k, v in form.items()})
    if raw and ctype != "application/json" and isinstance(params.get("q"), str):
        # LibreTranslate reads a form's line ends as LF only (RFC 2046 sends CRLF), before its limits
        params["q"] = "\n".join(params["q"].splitlines())
    return params


def multipart_fields(raw: bytes, content_type: str, max_fields: int) -> dict[str, str]:
    """The text fields of a ``multipart/form-data`` body, by the standard library's MIME parser: each name's first
    value, as LibreTranslate (Flask's ``request.values``) reads them; file parts are not read (LibreTranslate's
    ``/translate_file`` takes those)."""
    try:
        head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1")
    except UnicodeEncodeError:
        raise LibreError(400, "cannot read the form: its Content-Type header is not Latin-1") from None
    message = BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    if not message.is_multipart() or message.defects:
        raise LibreError(400, "cannot read the form: not a multipart/form-data body with its boundary")
    parts = list(message.iter_parts())
    if len(parts) > max_fields:
        raise LibreError(400, f"cannot read the form: {len(parts)} fields, the limit is {max_fields}")
    fields: dict[str, str] = {}
    for part in parts:
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or part.get_filename() is not None:
            continue
        data = part.get_payload(decode=True) or b""
        try:
            fields.setdefault(name, data.decode(part.get_content_charset() or "utf-8"))
        except (UnicodeDecodeError, LookupError) as e:
            raise LibreError(400, f"cannot read the form: field {name!r}: {one_line(e)}") from None
    return fields


@dataclasses.dataclass(frozen=True)
class LibreRequest:
    """A checked ``/translate`` request: ``texts`` (``single``: ``q`` was one string), the ``source`` as given
    (the run's or ``auto``), ``fmt`` (text or html), how many ``alternatives``, and whether it is an identity pair
    (``identity``: the target is the source language, answered with the text as it is)."""

    texts: list[str]
    single: bool
    source: str
    fmt: str
    alternatives: int
    identity: bool = False


def libre_request(fields: dict[str, Any], src: str, tgt: str, limits: Limits) -> LibreRequest:
    """The checked fields of a ``/translate`` request for a ``src`` to ``tgt`` model. Other fields
    (LibreTranslate's ``secret``, a client's extras) are not read, as LibreTranslate ignores them."""
    for name in ("q", "source", "target"):
        if fields.get(name) in (None, "", []):
            raise LibreError(400, f"Invalid request: missing {name} parameter")
    q, source, target = fields["q"], fields["source"], fields["target"]
    # Identity pairs, as Argos (IdentityTranslation) and so LibreTranslate answer them: each of the run's two
    # languages "translates" into itself, unchanged (auto reads as the run's source language).
    identity = isinstance(target, str) and target in (src, tgt) and target == (src if source == "auto" else source)
    if not isinstance(source, str) or (source not in (src, "auto") and not identity):
        raise LibreError(400, f"{source} is not supported: this model translates {src} to {tgt}")
    if not isinstance(target, str) or (target != tgt and not identity):
        raise LibreError(400, f"{target} is not supported: this model translates {src} to {tgt}")
    fmt = fields.get("format", "text")
    if fmt not in ("text", "html"):
        raise LibreError(400, f"format {fmt!r}: expected text or html")
    alternatives = fields.get("alternatives", 0)
    try:
        alternatives = int(alternatives)
    except (TypeError, ValueError):
        raise LibreError(400, f"alternatives: expected an integer, got {alternatives!r}") from None
    if not 0 <= alternatives < limits.max_nbest:
        raise LibreError(400, f"alternatives: expected 0 to {limits.max_nbest - 1}")
    single = isinstance(q, str)
    texts = [q] if single else q
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise LibreError(400, "q: expected a string or a list of strings")
    # LibreTranslate's own limits and messages (--batch-limit, --char-limit; -1, its default: none)
    if not single and limits.batch_limit != -1 and len(texts) > limits.batch_limit:
        raise LibreError(400, f"Invalid request: request ({len(texts)}) exceeds text limit ({limits.batch_limit})")
    for t in texts:
        if limits.char_limit != -1 and len(t) > limits.char_limit:
            raise LibreError(400, f"Invalid request: request ({len(t)}) exceeds text limit ({limits.char_limit})")
    return LibreRequest(texts, single, source, fmt, alternatives, identity)


class LibreTranslate(RouteTable):
    """LibreTranslate's routes over ``svc`` (other runs than translation: 400 naming the endpoint they have)."""

    protocol = "libretranslate"
    claims = ("/suggest", "/translate_file")  # LibreTranslate's, not served here: their 404 in its shape

    def __init__(self, svc: Service) -> None:
        self.svc = svc
        self.src, self.tgt = svc.model.cfg.data.src_lang, svc.model.cfg.data.tgt_lang

    async def fields(self, request: Request) -> dict[str, Any]:
        """The request's fields, once its key is checked and the run is a translation run."""
        fields = await request_fields(request, self.svc.limits)
        self.check_key(request, fields)
        self.need_translation()
        return fields

    def check_key(self, request: Request, fields: dict[str, Any]) -> None:
        """LibreTranslate's ``api_key`` field: a string in the body (JSON or form), or 403. A key in the URL's query
        string is refused even where it is right (400): URLs end up in access logs, proxies and browser histories."""
        if "api_key" in request.query_params:
            raise LibreError(400, "api_key: send it in the request body (JSON or form), not in the URL, which logs "
                                  "keep")
        given = fields.get("api_key")
        if given is not None and not isinstance(given, str):
            raise LibreError(400, f"api_key: expected a string, got {type(given).__name__}")
        if not self.svc.key_matches(given):
            raise LibreError(403, "Invalid API key")

    def need_translation(self) -> None:
        why = self.svc.kind.refusal("libretranslate")
        if why is not None:
            raise LibreError(400, why)

    @route("/languages", "GET", "POST", forms=True)
    async def languages(self, request: Request) -> Response:
        """LibreTranslate's ``/languages``, which it answers without a key (it has no access check there; its
        clients, and its own web page, list the languages first): whatever ``api_key`` comes is not read. Both of
        the run's languages, each with the targets it is served to (sorted, as LibreTranslate lists them): the
        source to the target and to itself, the target to itself (the identity pairs Argos adds to every
        language, which ``/translate`` answers)."""
        await request_fields(request, self.svc.limits)  # a body too large or unreadable: refused all the same
        self.need_translation()
        pairs = {self.src: sorted({self.src, self.tgt}), self.tgt: [self.tgt]}
        return JSONResponse([{"code": code, "name": language_name(code), "targets": targets}
                             for code, targets in pairs.items()])

    @route("/translate", "POST", forms=True)
    async def translate(self, request: Request) -> Response:
        r = libre_request(await self.fields(request), self.src, self.tgt, self.svc.limits)
        opts = self.svc.decode  # the run's search, or the one aiayn serve's flags chose (Argos')
        n = 1 if r.fmt == "html" else r.alternatives + 1  # LibreTranslate has no alternatives for html
        if n > 1:
            opts = opts.replace(nbest=n, beam=max(opts.beam, n))
        if r.fmt == "html":
            found = [[t] for t in r.texts] if r.identity else [[t] for t in await self.translate_html(r.texts, opts)]
        elif r.identity:  # Argos' identity pair: every hypothesis is the text itself
            found = [[t] * n for t in r.texts]
        else:
            found = await self.hypotheses(r.texts, opts, n)
        best, alts = [], []
        for text, hyps in zip(r.texts, found):
            out = [self.finish(text, h) if r.fmt == "text" else h for h in hyps]
            best.append(out[0])
            seen = {out[0], ""}  # LibreTranslate's filter_unique: no repeat, not the best, not empty
            alts.append([h for h in out[1:] if not (h in seen or seen.add(h))])
        body: dict[str, Any] = {"translatedText": best[0] if r.single else best}
        if r.source == "auto":
            detected = {"confidence": 100.0, "language": self.src}
            body["detectedLanguage"] = detected if r.single else [detected] * len(r.texts)
        if r.alternatives:
            body["alternatives"] = alts[0] if r.single else alts
        return JSONResponse(body)

    def finish(self, source: str, translation: str) -> str:
        """A text's translation as LibreTranslate answers it (:func:`libre_format`, then HTML entities resolved),
        unless ``aiayn serve --no-libre-formatting``."""
        return html.unescape(libre_format(source, translation)) if self.svc.choices.libre_formatting else translation

    async def hypotheses(self, texts: list[str], opts: DecodeOptions, n: int, names: list[str] | None = None
                         ) -> list[list[str]]:
        """Up to ``n`` translations of each text, best first. Each text is read as Argos reads it, paragraphs
        (lines) of sentences, each sentence translated alone and the translations joined as Argos joins them
        (the k-th hypothesis: every sentence's k-th, or its last when it has fewer); or, with ``aiayn serve
        --no-split-sentences``, each text translated as one sentence. A sentence too long for the model is a 413
        naming its text (``names[i]``, default ``q[i]``) and its place in it."""
        names = names or [f"q[{i}]" for i in range(len(texts))]
        if not self.svc.choices.split_sentences:
            for name, text in zip(names, texts):
                source_tokens(self.svc.model, [text], name + " sentence")
            found, _ = await self.svc.translate(texts, opts)
            return [[h.text for h in hyps] or [""] for hyps in found]
        plans, sentences = plan_texts(texts)
        for name, plan in zip(names, plans):  # named by its text, not by its place among all the sentences
            source_tokens(self.svc.model, [s for p in plan for s in p], name + " sentence")
        found = (await self.svc.translate(sentences, opts))[0] if sentences else []
        return [joined(grouped, n, str) for grouped in regroup(plans, [[h.text for h in x] or [""] for x in found])]

    async def translate_html(self, documents: list[str], opts: DecodeOptions) -> list[str]:
        """The text nodes of every document translated in one call (each as a text, sentence by sentence, as
        Argos translates the strings LibreTranslate's html reader hands it), the markup kept."""
        docs = [split_html(t) for t in documents]
        nodes = [node for _, doc_nodes in docs for node in doc_nodes]
        names = [f"q[{i}] text node {j}" for i, (_, doc_nodes) in enumerate(docs) for j in range(len(doc_nodes))]
        found = iter(await self.hypotheses(nodes, opts, 1, names) if nodes else [])
        return [join_html(parts, [next(found)[0] for _ in doc_nodes]) for parts, doc_nodes in docs]

    @route("/detect", "POST", forms=True)
    async def detect(self, request: Request) -> Response:
        """LibreTranslate's ``/detect``: a translation model reads one language, so that is the answer (at
        confidence 100): no detection is run."""
        q = (await self.fields(request)).get("q")
        if q in (None, "", []):
            raise LibreError(400, "Invalid request: missing q parameter")
        if not isinstance(q, (str, list)) or (isinstance(q, list) and not all(isinstance(t, str) for t in q)):
            raise LibreError(400, "q: expected a string or a list of strings")
        found = [{"confidence": 100.0, "language": self.src}]
        return JSONResponse(found if isinstance(q, str) else [found] * len(q))

    @route("/frontend/settings", "GET")
    async def frontend_settings(self, request: Request) -> Response:
        """LibreTranslate's ``/frontend/settings``, which its web page reads first: as LibreTranslate's defaults
        (``charLimit`` -1 unless ``--char-limit``, source ``auto``), but ``filesTranslation`` off: aiayn serves no
        ``/translate_file``."""
        self.need_translation()
        keyed = self.svc.api_key is not None
        return JSONResponse({"charLimit": self.svc.limits.char_limit, "frontendTimeout": 500, "apiKeys": keyed,
                             "keyRequired": keyed, "suggestions": False, "filesTranslation": False,
                             "supportedFilesFormat": [],
                             "language": {"source": {"code": "auto", "name": "Auto Detect"},
                                          "target": {"code": self.tgt, "name": language_name(self.tgt)}}})


PUNCTUATION = "!?.,;\u3002"  # the marks LibreTranslate carries from the source's end to the translation's


def libre_format(source: str, translation: str) -> str:
    """A translation as LibreTranslate formats it (``improve_translation_formatting``): the source's final mark
    carried over (in place of the translation's own, which goes when the source ends without one), a one-word
    source's translation that repeats one word many times cut to its first word, and the source's case: all lower
    or all upper case carried over, else the case of its first letter. An empty source gives "", an empty
    translation the source (both read without the source's surrounding white space)."""
    source = source.strip()
    if not source:
        return ""
    if not translation:
        return source
    end = source[-1]
    if end in PUNCTUATION and translation[-1] != end:
        translation = (translation[:-1] if translation[-1] in PUNCTUATION else translation) + end
    elif end not in PUNCTUATION and translation[-1] in PUNCTUATION:
        translation = translation[:-1]
    if len(source) < 20 and " " not in source and " " in translation:  # LibreTranslate's "word salad" guard
        words = translation.split()
        counts = Counter(words)
        if any(c / len(counts) >= 2 for c in counts.values()):
            translation = words[0]
    if source.islower():
        return translation.lower()
    if source.isupper():
        return translation.upper()
    if not translation:
        return source
    if source[0].islower():
        return translation[0].lower() + translation[1:]
    if source[0].isupper():
        return translation[0].upper() + translation[1:]
    return translation
