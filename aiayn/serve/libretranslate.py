"""LibreTranslate's API over a translation run, so that its clients (``libretranslatepy``, LibreTranslate's web page
and plugins) work against ``aiayn serve`` unchanged. docs/serve.md's protocol table lists every difference.

===============================  ==================================================================================
``POST /translate``              ``q`` (string or list), ``source`` (the run's source language or ``auto``),
                                 ``target``, ``format`` (text; html: text nodes translated, markup kept,
                                 :mod:`aiayn.serve.markup`), ``alternatives``, ``api_key``; other fields not read,
                                 as LibreTranslate; JSON or a form, URL-encoded or multipart (a repeated form
                                 field: its first value).
                                 -> ``{"translatedText": str | [str]}`` (+ ``alternatives``)
``GET /languages``               ``[{"code", "name", "targets"}]``, the run's source language; no key asked (as
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
import urllib.parse
from email.parser import BytesParser
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiayn.config import DecodeOptions
from aiayn.data.languages import language_name
from aiayn.errors import one_line
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
    if alternatives and fmt == "html":
        raise LibreError(400, "alternatives are not supported with format html")
    single = isinstance(q, str)
    texts = [q] if single else q
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise LibreError(400, "q: expected a string or a list of strings")
    if len(texts) > limits.max_sentences:
        raise LibreError(413, f"q: {len(texts)} texts, the limit is {limits.max_sentences} per request")
    for i, t in enumerate(texts):
        if len(t) > limits.max_chars:
            raise LibreError(413, f"q[{i}]: {len(t)} characters, the limit is {limits.max_chars}")
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
        if not self.svc.kind.translates:
            raise LibreError(400, f"this server runs a {self.svc.task} run; LibreTranslate's API needs a translation "
                                  "run (language models answer /v1/completions)")

    @route("/languages", "GET", "POST", forms=True)
    async def languages(self, request: Request) -> Response:
        """LibreTranslate's ``/languages``, which it answers without a key (it has no access check there; its
        clients, and its own web page, list the languages first): whatever ``api_key`` comes is not read."""
        await request_fields(request, self.svc.limits)  # a body too large or unreadable: refused all the same
        self.need_translation()
        return JSONResponse([{"code": self.src, "name": language_name(self.src), "targets": [self.tgt]}])

    @route("/translate", "POST", forms=True)
    async def translate(self, request: Request) -> Response:
        r = libre_request(await self.fields(request), self.src, self.tgt, self.svc.limits)
        opts = self.svc.decode  # the run's search, or the one aiayn serve's flags chose (Argos')
        if r.alternatives:
            opts = opts.replace(nbest=r.alternatives + 1, beam=max(opts.beam, r.alternatives + 1))
        if r.identity:  # Argos' hypotheses of an identity pair are all the text: no alternative after filtering
            best, found = list(r.texts), [[] for _ in r.texts]
        elif r.fmt == "html":
            best, found = await self.translate_html(r.texts, opts), []
        else:
            found, _ = await self.svc.translate(r.texts, opts, field="q")
            best = [h[0].text if h else "" for h in found]
        body: dict[str, Any] = {"translatedText": best[0] if r.single else best}
        if r.source == "auto":
            detected = {"confidence": 100.0, "language": self.src}
            body["detectedLanguage"] = detected if r.single else [detected] * len(r.texts)
        if r.alternatives:
            alts = [[x.text for x in h[1:]] for h in found]  # identity: [] each, as LibreTranslate answers
            body["alternatives"] = alts[0] if r.single else alts
        return JSONResponse(body)

    async def translate_html(self, documents: list[str], opts: DecodeOptions) -> list[str]:
        """The text nodes of every document translated in one call, the markup kept."""
        docs = [split_html(t) for t in documents]
        for i, (_, doc_nodes) in enumerate(docs):  # a text node too long for the model: named by its q[i]
            source_tokens(self.svc.model, doc_nodes, f"q[{i}] text node")
        nodes = [node for _, doc_nodes in docs for node in doc_nodes]
        found, _ = await self.svc.translate(nodes, opts) if nodes else ([], None)
        out = iter(h[0].text if h else "" for h in found)
        return [join_html(parts, [next(out) for _ in doc_nodes]) for parts, doc_nodes in docs]

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
        """LibreTranslate's ``/frontend/settings``, which its web page reads first."""
        self.need_translation()
        keyed = self.svc.api_key is not None
        return JSONResponse({"charLimit": self.svc.limits.max_chars, "frontendTimeout": 500, "apiKeys": keyed,
                             "keyRequired": keyed, "suggestions": False, "filesTranslation": False,
                             "supportedFilesFormat": [],
                             "language": {"source": {"code": self.src, "name": language_name(self.src)},
                                          "target": {"code": self.tgt, "name": language_name(self.tgt)}}})
