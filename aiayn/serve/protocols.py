"""The ecosystem's protocols beside aiayn's own API: LibreTranslate for translation runs, OpenAI's completions and
chat completions (with vLLM's tokenizer routes) for language models, so their clients (``libretranslatepy``,
LibreTranslate's web page and plugins, the ``openai`` package, lm-evaluation-harness and the tools built on them)
work against ``aiayn serve`` unchanged. docs/serve.md's protocol table lists every difference from the originals.

===============================  ==================================================================================
``POST /translate``              LibreTranslate: ``q`` (string or list), ``source`` (the run's source language or
                                 ``auto``), ``target``, ``format`` (text; html: text nodes translated, markup kept,
                                 :mod:`aiayn.serve.markup`), ``alternatives``, ``api_key``; other fields not read,
                                 as LibreTranslate; JSON or form-encoded (a repeated form field: its first value).
                                 -> ``{"translatedText": str | [str]}`` (+ ``alternatives``)
``GET /languages``               LibreTranslate: ``[{"code", "name", "targets"}]``, the run's source language
``POST /detect``                 LibreTranslate: the run's source language, confidence 100 (nothing is detected)
``GET /frontend/settings``       LibreTranslate's web page settings
``GET /v1/models``               OpenAI: the served run as one model (another ``model`` named: 404)
``POST /v1/completions``         OpenAI completions: ``prompt`` (strings or token ids), ``max_tokens``,
                                 ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``stream`` (server-sent
                                 events ending in ``data: [DONE]``), ``stream_options.include_usage``, ``echo`` and
                                 ``logprobs`` (:mod:`aiayn.serve.scores`); ``usage`` in tokens
``POST /v1/chat/completions``    OpenAI chat completions, through one template (:mod:`aiayn.serve.chat`)
``/tokenize``, ``/detokenize``,  vLLM's tokenizer routes, as lm-evaluation-harness's remote tokenizer reads them
``GET /tokenizer_info``
===============================  ==================================================================================

Errors come in each protocol's shape: ``{"error": message}`` on LibreTranslate's routes, ``{"error": {"message",
"type", "param", "code"}}`` on OpenAI's, also for what is refused before a route (:func:`error_response`).
What the server does not do is refused, never silently ignored; LibreTranslate's unread fields are the exception,
as LibreTranslate itself ignores them.

Translation runs answer both completions APIs too: the prompt (or the last user message) is the sentence to
translate, the completion its translation by the run's own search, unless the request asks for sampling
(``temperature`` > 0 given, or ``top_p`` without it).

API key (``aiayn serve --api-key KEY`` or ``$AIAYN_API_KEY``; off by default): every API request must then
carry it, as ``Authorization: Bearer KEY`` (OpenAI's clients, aiayn's own ``/v1/*``) or as the ``api_key`` field
(LibreTranslate's); compared in constant time. A missing or wrong key is 403 in the protocol's error shape.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aiayn.config import DecodeOptions
from aiayn.data.languages import language_name
from aiayn.errors import ConfigError, UserError, one_line
from aiayn.serve.batcher import Closed, QueueFull
from aiayn.serve.chat import ChatShape, Shape, TextShape, chat_prompt
from aiayn.serve.markup import join_html, split_html
from aiayn.serve.schemas import ApiError, parse_body, read_body, source_tokens
from aiayn.serve.scores import MAX_LOGPROBS, check_scored, encode_with_specials, scored_choice, tokenizer_info
from aiayn.serve.streams import EventStream

FORM_PATHS = ("/translate", "/languages", "/detect")  # LibreTranslate's clients post forms, not JSON
LIBRE_PATHS = (*FORM_PATHS, "/frontend/settings", "/suggest", "/translate_file")  # LibreTranslate's error shape
# OpenAI's (and vLLM's) routes beside /v1/...: their refusals come in OpenAI's error shape
OPENAI_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
OPENAI_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "user",
                 "echo", "logprobs", "presence_penalty", "frequency_penalty", "best_of", "suffix", "logit_bias",
                 "stream_options")
# OpenAI takes 4 stop strings; lm-evaluation-harness sends a task's every `until` string (vLLM takes any number)
MAX_STOPS = 64


NATIVE_PATHS = ("/v1/translate", "/v1/generate", "/v1/attention", "/v1/model")  # aiayn's own API (serve.app)


def error_response(path: str, status: int, code: str, message: str, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """A refusal made before any route's handler (no such route or method, media type, host, origin) in the
    error shape of the protocol ``path`` belongs to: LibreTranslate's ``{"error": message}`` on its routes,
    OpenAI's on ``/v1/...`` (but aiayn's own routes) and vLLM's tokenizer routes, aiayn's elsewhere."""
    if path in LIBRE_PATHS:
        body: dict[str, Any] = {"error": message}
    elif path in OPENAI_PATHS or (path.startswith("/v1/") and path not in NATIVE_PATHS):
        body = OpenAIError(status, message, code=code, kind="server_error" if status >= 500 else
                           "invalid_request_error").body()
    else:
        body = {"error": {"code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def key_matches(given: str | None, key: str | None) -> bool:
    """Whether ``given`` is the server's key (always, when the server has none); constant time."""
    if key is None:
        return True
    return given is not None and hmac.compare_digest(given.encode("utf-8"), key.encode("utf-8"))


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def check_key(request: Request, key: str | None) -> None:
    """aiayn's own API: the key as a bearer token (403 ``invalid_api_key`` else)."""
    if not key_matches(bearer(request), key):
        raise ApiError(403, "invalid_api_key", "this server needs an API key: Authorization: Bearer KEY")


# LibreTranslate --------------------------------------------------------------------------------------------


class LibreError(Exception):
    """A LibreTranslate-shaped refusal: ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def _libre_fields(request: Request, svc) -> dict[str, Any]:
    """The request's fields: a JSON object, a form, or (GET) the query string."""
    params: dict[str, Any] = dict(request.query_params)
    # libretranslatepy sends its api_key in a form body even on GET /languages
    has_body = request.method == "POST" or request.headers.get("content-length", "0") not in ("", "0")
    raw = await read_body(request, svc.limits) if has_body else b""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if raw and ctype == "application/json":
        params.update(parse_body(raw, svc.limits))
    elif raw:
        try:
            form = urllib.parse.parse_qs(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=False,
                                         max_num_fields=svc.limits.max_sentences + 16)
        except (UnicodeDecodeError, ValueError) as e:
            raise LibreError(400, f"cannot read the form: {one_line(e)}") from None
        # a repeated field counts once, its first value, as LibreTranslate (Flask's request.values.get) reads it
        params.update({k: v[0] for k, v in form.items()})
    return params


def _libre_key(request: Request, fields: dict[str, Any], key: str | None) -> None:
    """LibreTranslate's ``api_key`` field: a string in the body (JSON or form), or 403. A key in the URL's query
    string is refused even where it is right (400): URLs end up in access logs, proxies and browser histories."""
    if "api_key" in request.query_params:
        raise LibreError(400, "api_key: send it in the request body (JSON or form), not in the URL, which logs keep")
    given = fields.get("api_key")
    if given is not None and not isinstance(given, str):
        raise LibreError(400, f"api_key: expected a string, got {type(given).__name__}")
    if not key_matches(given, key):
        raise LibreError(403, "Invalid API key")


def _libre(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except LibreError as e:
            status, message = e.status, e.message
        except ApiError as e:
            status, message = (400 if e.status == 422 else e.status), e.message
        except UserError as e:
            status, message = 400, str(e)
        except (QueueFull, Closed) as e:
            status, message = 429 if isinstance(e, QueueFull) else 503, f"{e}: retry later"
        except Exception as e:  # the model failed: answer, keep serving
            status, message = 500, one_line(f"{type(e).__name__}: {e}")
        return JSONResponse({"error": message}, status_code=status)

    return wrapped


def libre_routes(svc, run_translation, key: str | None) -> list[Route]:
    """``/translate``, ``/languages``, ``/detect`` and ``/frontend/settings`` for a translation run (other runs:
    400 naming the endpoint they have)."""
    cfg = svc.model.cfg
    src, tgt = cfg.data.src_lang, cfg.data.tgt_lang

    def need_translation() -> None:
        if svc.task != "translation":
            raise LibreError(400, f"this server runs a {svc.task} run; LibreTranslate's API needs a translation "
                                  "run (language models answer /v1/completions)")

    async def languages(request: Request) -> Response:
        fields = await _libre_fields(request, svc)
        _libre_key(request, fields, key)
        need_translation()
        return JSONResponse([{"code": src, "name": language_name(src), "targets": [tgt]}])

    async def translate(request: Request) -> Response:
        fields = await _libre_fields(request, svc)
        _libre_key(request, fields, key)
        need_translation()
        # Other fields (LibreTranslate's `secret`, a client's extras) are not read, as LibreTranslate ignores them.
        for name in ("q", "source", "target"):
            if fields.get(name) in (None, "", []):
                raise LibreError(400, f"Invalid request: missing {name} parameter")
        q, source, target = fields["q"], fields["source"], fields["target"]
        if not isinstance(source, str) or source not in (src, "auto"):
            raise LibreError(400, f"{source} is not supported: this model translates {src} to {tgt}")
        if not isinstance(target, str) or target != tgt:
            raise LibreError(400, f"{target} is not supported: this model translates {src} to {tgt}")
        fmt = fields.get("format", "text")
        if fmt not in ("text", "html"):
            raise LibreError(400, f"format {fmt!r}: expected text or html")
        alternatives = fields.get("alternatives", 0)
        try:
            alternatives = int(alternatives)
        except (TypeError, ValueError):
            raise LibreError(400, f"alternatives: expected an integer, got {alternatives!r}") from None
        if not 0 <= alternatives < svc.limits.max_nbest:
            raise LibreError(400, f"alternatives: expected 0 to {svc.limits.max_nbest - 1}")
        if alternatives and fmt == "html":
            raise LibreError(400, "alternatives are not supported with format html")
        single = isinstance(q, str)
        texts = [q] if single else q
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise LibreError(400, "q: expected a string or a list of strings")
        if len(texts) > svc.limits.max_sentences:
            raise LibreError(413, f"q: {len(texts)} texts, the limit is {svc.limits.max_sentences} per request")
        for i, t in enumerate(texts):
            if len(t) > svc.limits.max_chars:
                raise LibreError(413, f"q[{i}]: {len(t)} characters, the limit is {svc.limits.max_chars}")
        opts = cfg.decode
        if alternatives:
            opts = opts.replace(nbest=alternatives + 1, beam=max(opts.beam, alternatives + 1))
        if fmt == "html":  # the text nodes of every document in one call, the markup kept
            docs = [split_html(t) for t in texts]
            for i, (_, doc_nodes) in enumerate(docs):  # a text node too long for the model: named by its q[i]
                source_tokens(svc.model, doc_nodes, f"q[{i}] text node")
            nodes = [node for _, doc_nodes in docs for node in doc_nodes]
            found, _ = await run_translation(nodes, opts) if nodes else ([], None)
            out = iter(h[0].text if h else "" for h in found)
            best = [join_html(parts, [next(out) for _ in doc_nodes]) for parts, doc_nodes in docs]
        else:
            found, _ = await run_translation(texts, opts, field="q")
            best = [h[0].text if h else "" for h in found]
        body: dict[str, Any] = {"translatedText": best[0] if single else best}
        if source == "auto":
            body["detectedLanguage"] = ({"confidence": 100.0, "language": src} if single
                                        else [{"confidence": 100.0, "language": src}] * len(texts))
        if alternatives:
            alts = [[x.text for x in h[1:]] for h in found]
            body["alternatives"] = alts[0] if single else alts
        return JSONResponse(body)

    async def detect(request: Request) -> Response:
        """LibreTranslate's ``/detect``: a translation model reads one language, so that is the answer (at
        confidence 100): no detection is run."""
        fields = await _libre_fields(request, svc)
        _libre_key(request, fields, key)
        need_translation()
        q = fields.get("q")
        if q in (None, "", []):
            raise LibreError(400, "Invalid request: missing q parameter")
        if not isinstance(q, (str, list)) or (isinstance(q, list) and not all(isinstance(t, str) for t in q)):
            raise LibreError(400, "q: expected a string or a list of strings")
        found = [{"confidence": 100.0, "language": src}]
        return JSONResponse(found if isinstance(q, str) else [found] * len(q))

    async def frontend_settings(request: Request) -> Response:
        """LibreTranslate's ``/frontend/settings``, which its web page reads first."""
        need_translation()
        return JSONResponse({"charLimit": svc.limits.max_chars, "frontendTimeout": 500, "apiKeys": key is not None,
                             "keyRequired": key is not None, "suggestions": False, "filesTranslation": False,
                             "supportedFilesFormat": [],
                             "language": {"source": {"code": src, "name": language_name(src)},
                                          "target": {"code": tgt, "name": language_name(tgt)}}})

    return [Route("/languages", _libre(languages), methods=["GET", "POST"]),
            Route("/translate", _libre(translate), methods=["POST"]),
            Route("/detect", _libre(detect), methods=["POST"]),
            Route("/frontend/settings", _libre(frontend_settings), methods=["GET"])]


# OpenAI completions ----------------------------------------------------------------------------------------


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _openai(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except OpenAIError as e:
            return e.response()
        except ApiError as e:
            return OpenAIError(400 if e.status == 422 else e.status, e.message, code=e.code).response()
        except UserError as e:
            return OpenAIError(400, str(e)).response()
        except QueueFull as e:
            return OpenAIError(429, f"{e}: retry later", kind="rate_limit_error").response()
        except Closed as e:
            return OpenAIError(503, str(e), kind="server_error").response()
        except Exception as e:
            return OpenAIError(500, one_line(f"{type(e).__name__}: {e}"), kind="server_error").response()

    return wrapped


@dataclasses.dataclass(frozen=True)
class Completion:
    """A checked ``/v1/completions`` request."""

    prompts: list[str] | list[list[int]]  # texts, or token ids (a client that tokenizes, as lm-eval does)
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    echo: bool = False
    logprobs: int | None = None  # top log-probabilities per token (None: no logprobs object)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    sample_asked: bool = False  # temperature or top_p given: a translation run samples only then
    options: DecodeOptions | None = None  # the decoding options, checked before any answer (completion_options)

    @property
    def scored(self) -> bool:
        """Whether the answer needs the log-probability path (:mod:`aiayn.serve.scores`)."""
        return self.echo or self.logprobs is not None


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        value = default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise OpenAIError(400, f"{name}: expected {'an integer' if integer else 'a number'}", param=name,
                          code="invalid_type")
    if not low <= value <= high:
        raise OpenAIError(400, f"{name}={value}: expected {low:g} to {high:g}", param=name, code="out_of_range")
    return value


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prompts(prompt: Any) -> list[str] | list[list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of token ids, a list of lists of ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_id(i) for i in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(
                isinstance(p, list) and p and all(_is_id(i) for i in p) for p in prompt):
            return prompt
    raise OpenAIError(400, "prompt: expected a string, a list of strings, a list of token ids or a list of such "
                           "lists (none empty)", param="prompt", code="invalid_type")


def completion_request(body: dict[str, Any], limits) -> Completion:
    """The checked fields of an OpenAI completions request (unknown fields refused by name)."""
    unknown = sorted(set(body) - set(OPENAI_FIELDS))
    if unknown:
        raise OpenAIError(400, f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    # Accepted only at the value that asks for nothing: a request for what this server does not do is refused,
    # not silently ignored (a penalty of 1.5 would otherwise give the text of 0).
    for name, neutral in (("best_of", (None, 1)), ("suffix", (None, "")), ("logit_bias", (None, {})),
                          ("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0))):
        value = body.get(name)
        if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            raise OpenAIError(400, f"{name} is not supported by this server", param=name, code="unsupported")
    prompts = _prompts(body.get("prompt", ""))
    if len(prompts) > limits.max_sentences:
        raise OpenAIError(400, f"prompt: {len(prompts)} prompts, the limit is {limits.max_sentences}",
                          param="prompt", code="out_of_range")
    for p in prompts:
        if len(p) > limits.max_chars:
            raise OpenAIError(400, f"prompt: {len(p)} characters, the limit is {limits.max_chars}",
                              param="prompt", code="out_of_range")
    stop = body.get("stop")
    stops = () if stop is None else ((stop,) if isinstance(stop, str) else stop)
    if (not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise OpenAIError(400, f"stop: expected a string or up to {MAX_STOPS} non-empty strings", param="stop",
                          code="invalid_type")
    n = _number(body, "n", 1, 1, limits.max_nbest, integer=True)
    if n * len(prompts) > limits.max_sentences:
        raise OpenAIError(400, f"n x prompts = {n * len(prompts)} completions, the limit is {limits.max_sentences}",
                          param="n", code="out_of_range")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise OpenAIError(400, "seed: expected a non-negative integer", param="seed", code="invalid_type")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError(400, "stream: expected a boolean", param="stream", code="invalid_type")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise OpenAIError(400, "stream_options: only with stream true, and only {'include_usage': bool}",
                          param="stream_options", code="invalid_type")
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise OpenAIError(400, "echo: expected a boolean", param="echo", code="invalid_type")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _number(body, "logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    if (echo or logprobs is not None) and (stream or stops):
        name = "stream" if stream else "stop"
        raise OpenAIError(400, f"echo and logprobs are not supported with {name} by this server", param=name,
                          code="unsupported")
    # max_tokens 0 asks for the prompt's log-probabilities only (echo), as lm-evaluation-harness may
    max_tokens = _number(body, "max_tokens", 16, 0 if echo else 1, limits.max_new_tokens, integer=True)
    asked = body.get("temperature") is not None or body.get("top_p") is not None
    return Completion(prompts, max_tokens, float(_number(body, "temperature", 1.0, 0.0, 2.0)),
                      float(_number(body, "top_p", 1.0, 0.0, 1.0)), n, tuple(stops), seed, stream, echo, logprobs,
                      bool(options and options.get("include_usage")), asked)


def completion_options(c: Completion, base: DecodeOptions, language_model: bool) -> Completion:
    """``c`` with its decoding options on the run's ``base``. A language model samples at ``temperature`` > 0 (0:
    greedy); a translation run keeps its own search unless the request asks for sampling (``c.sample_asked`` and a
    ``temperature`` > 0: OpenAI's default temperature of 1 does not count). ``top_p`` below 1 filters a draw. Every
    sampling number goes through :class:`DecodeOptions`, the one validator of the command line, the recipes and
    every route, whether this request samples or not; one it refuses (``top_p`` 0, a ``temperature`` below 1e-6)
    is a 400 naming the field, before any streamed 200 is sent."""
    top_p = c.top_p if c.top_p < 1 else None
    sample = c.temperature > 0 and (language_model or c.sample_asked)
    overrides: dict[str, Any] = {}
    if sample:
        overrides.update(sample=True, temperature=c.temperature, top_p=top_p)
    elif language_model:
        overrides.update(sample=False, top_p=top_p)
    if language_model:
        overrides["max_new_tokens"] = c.max_tokens
    try:
        base.replace(temperature=c.temperature, top_p=top_p)  # checked even where the run's own search ignores them
        return dataclasses.replace(c, options=base.replace(**overrides))
    except ConfigError as e:
        message = str(e).removeprefix("decode.")
        param = next((p for p in ("temperature", "top_p") if message.startswith(p)), None)
        raise OpenAIError(400, message, param=param, code="out_of_range") from None


class StopScan:
    """Text pieces in, the part that is final out: cut at the first stop string, and hold back a tail that may
    still become one (a stream must never show text that a stop sequence would have removed)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.held, self.stopped = stops, "", False

    def add(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self.held = True, ""
            return text[:min(cuts)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


class CompletionText:
    """One completion's text as a language model's pieces come (its tokens' text, then the held-back tail):
    cut at its stop strings, each final part passed to ``emit`` (a stream) as soon as it is final."""

    def __init__(self, c: Completion, emit: Callable[[str], None] | None,
                 cancelled: threading.Event | None = None) -> None:
        self.scan, self.emit, self.limit = StopScan(c.stop), emit, c.max_tokens
        self.cancelled = cancelled  # set when a streamed answer's client went away (aiayn.serve.streams)
        self.parts: list[str] = []
        self.pieces = 0

    @property
    def done(self) -> bool:
        """Whether no more pieces are wanted: a stop string was reached, or the client went away."""
        return self.scan.stopped or (self.cancelled is not None and self.cancelled.is_set())

    def add(self, piece: str) -> None:
        if self.done:
            return
        self.pieces += 1
        self._out(self.scan.add(piece))

    def _out(self, text: str) -> None:
        if text:
            self.parts.append(text)
            if self.emit:
                self.emit(text)

    def result(self, prompt_tokens: int) -> dict[str, Any]:
        """The completion's choice fields and token counts (call once, after the last piece)."""
        tokens = self.pieces - (0 if self.scan.stopped else 1)  # the last piece is the held-back tail
        self._out(self.scan.finish())
        finish = "stop" if self.scan.stopped or tokens < self.limit else "length"
        return {"text": "".join(self.parts), "finish_reason": finish, "prompt_tokens": prompt_tokens,
                "completion_tokens": max(tokens, 0)}


def openai_routes(svc, run_translation, key: str | None) -> list[Route]:
    """``/v1/models`` and ``/v1/completions``. On a translation run a completion is the prompt's translation,
    through ``run_translation``: the batcher merges it with concurrent requests of every API that decode with the
    same options (LibreTranslate's, aiayn's /v1/translate, other completions)."""
    model_id = svc.run.path.name
    created = int(time.time())

    def authorize(request: Request) -> None:
        if not key_matches(bearer(request), key):
            raise OpenAIError(401, "Incorrect API key provided", code="invalid_api_key",
                              kind="invalid_request_error")

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                                         "owned_by": "aiayn"}]})

    def choices_for(c: Completion) -> list[tuple[int, str, int | None]]:
        """(choice index, prompt, seed) of every completion: n per prompt, in OpenAI's order."""
        out = []
        for p_i, prompt in enumerate(c.prompts):
            for k in range(c.n):
                seed = None if c.seed is None else c.seed + p_i * c.n + k
                out.append((p_i * c.n + k, prompt, seed))
        return out

    def lm_group(c: Completion) -> tuple:
        """Completions that may share a batch: the same sampling options (seeds, limits and stops are per row)."""
        return ("completion", c.temperature, c.top_p)

    def lm_cost(c: Completion, jobs: list[tuple[int, str, int | None]]) -> int:
        """What the rows hold in a batch (the batcher's --max-batch-tokens bounds merged requests): prompt
        characters as an upper bound of their tokens, plus the new tokens."""
        return sum(len(p) + 1 + c.max_tokens for _, p, _ in jobs)

    def lm_pieces(prompt: str, c: Completion, seed: int | None):
        """(pieces iterator, prompt tokens) of one completion by a language model (runs on the worker thread)."""
        from aiayn.decode.generate import prompt_ids

        gen = svc.model
        return gen.stream(prompt, c.options.replace(seed=seed)), len(prompt_ids(gen.cfg, gen.tokenizers.src, prompt))

    def run_one(prompt: str, c: Completion, seed: int | None, emit: Callable[[str], None] | None,
                cancelled: threading.Event | None) -> dict[str, Any]:
        """Generate one completion by a language model alone (worker thread; the sliding window when the text
        outgrows the context); ``emit`` gets each final piece as it comes; ``cancelled`` stops it at the next
        token (the generator decodes one token per piece asked for)."""
        out = CompletionText(c, emit, cancelled)
        pieces, prompt_tokens = lm_pieces(prompt, c, seed)
        for piece in pieces:
            out.add(piece)
            if out.done:
                break
        return out.result(prompt_tokens)

    def run_lm(items: list[tuple[str, int | None, Completion, Any, Any]]) -> list[dict[str, Any]]:
        """Completions of concurrent requests by a language model in one batch (worker thread): items are
        (prompt, seed, request, emit or None, cancelled event or None); rows too long for a batch (they need the
        sliding window) run alone. Each row's text, stop and token count are what :func:`run_one` gives it alone.
        The batch decodes until every row is done: ended, stopped, or cancelled by its client."""
        from aiayn.decode.generate import fits_in_batch, prompt_ids, stream_rows

        gen = svc.model
        results: list[dict[str, Any] | None] = [None] * len(items)
        rows = [k for k, (p, _, c, _, _) in enumerate(items) if fits_in_batch(gen.run, p, c.max_tokens)]
        if rows:
            opts = items[rows[0]][2].options  # one group: the same temperature and top_p
            outs = [CompletionText(items[k][2], items[k][3], items[k][4]) for k in rows]
            for pieces in stream_rows(gen.run, [items[k][0] for k in rows], opts,
                                      [items[k][2].max_tokens for k in rows], [items[k][1] for k in rows]):
                for out, piece in zip(outs, pieces):
                    if piece is not None:
                        out.add(piece)
                if all(out.done for out in outs):
                    break
            for out, k in zip(outs, rows):
                results[k] = out.result(len(prompt_ids(gen.cfg, gen.tokenizers.src, items[k][0])))
        for k, (p, seed, c, emit, cancelled) in enumerate(items):  # after the batch: those that need the window
            if results[k] is None:
                results[k] = run_one(p, c, seed, emit, cancelled)
        return results

    async def translate_choices(c: Completion, jobs: list[tuple[int, str, int | None]],
                                cancelled: threading.Event | None = None) -> list[dict[str, Any]]:
        """Every choice of a completion on a translation run: the run's own search (every choice of a prompt is
        the same translation, decoded once) unless the request asks for sampling (a temperature > 0, or a top_p,
        given: OpenAI's default temperature of 1 does not count, since its clients send none), through the
        batcher; ``cancelled`` (a stream's) stops the search at its next step once the client went away."""
        tr = svc.model
        base = c.options.replace(nbest=1)  # completion_options: the run's own search unless sampling is asked
        if not (c.sample_asked and c.temperature > 0):
            prompts = list(dict.fromkeys(p for _, p, _ in jobs))
            found, _ = await run_translation(prompts, base, cancelled=cancelled)
            by_prompt = dict(zip(prompts, found))
            hyps = [by_prompt[p] for _, p, _ in jobs]
        else:
            # unseeded draws: one call for all, each row its own draw; seeded ones: one job whose draws each run
            # alone (a seeded draw must not depend on its batch), so the request's n choices take one queue place
            seeds = None if c.seed is None else [seed for _, _, seed in jobs]
            hyps, _ = await run_translation([p for _, p, _ in jobs], base, seeds=seeds, cancelled=cancelled)
        out = []
        for (_, prompt, _), h in zip(jobs, hyps):
            scan = StopScan(c.stop)
            text = scan.add(h[0].text if h else "") + scan.finish()
            out.append({"text": text, "finish_reason": "stop", "completion_tokens": len(h[0].ids) if h else 0,
                        "prompt_tokens": len(tr.tokenizers.src.encode(prompt)) + 1})
        return out

    def run_scored(items: list[tuple[str | list[int], int | None, Completion]]) -> list[dict[str, Any]]:
        """Echo / logprobs choices (worker thread), one after the other (:func:`aiayn.serve.scores.scored_choice`)."""
        gen = svc.model
        out = []
        for prompt, seed, c in items:
            out.append(scored_choice(gen.run, prompt, c.options.replace(seed=seed), c.max_tokens, c.echo,
                                     c.logprobs))
        return out

    def check_model(body: dict[str, Any]) -> None:
        """The ``model`` a request names must be the one /v1/models lists (none named: that one)."""
        name = body.get("model")
        if name is not None and name != model_id:
            raise OpenAIError(404, f"The model `{name}` does not exist (this server serves `{model_id}`: "
                                   "GET /v1/models)", param="model", code="model_not_found")

    def check_prompts(c: Completion) -> None:
        """Before batching, so that one request's bad prompt does not fail the others in its batch."""
        translation = svc.task == "translation"
        ids = [p for p in c.prompts if not isinstance(p, str)]
        if translation and (ids or c.scored):
            what = "token-id prompts" if ids else "echo and logprobs"
            raise OpenAIError(400, f"{what} need a language-model run; this server runs a translation run",
                              code="unsupported")
        if translation:  # a prompt too long for the model: 413 prompt[i], before a stream's 200
            source_tokens(svc.model, c.prompts, "prompt")
            return
        from aiayn.decode.generate import check_prompt_fits, prompt_ids

        vocab = svc.model.tokenizers.src.vocab_size
        for p in ids:
            if max(p) >= vocab:
                raise OpenAIError(400, f"prompt: token id {max(p)} is not in the model's vocabulary of {vocab}",
                                  param="prompt", code="out_of_range")
        for prompt in c.prompts:
            if c.scored:
                check_scored(svc.model.run, prompt, c.max_tokens)
            else:
                check_prompt_fits(svc.model.cfg, prompt_ids(svc.model.cfg, svc.model.tokenizers.src, prompt))

    def usage_of(c: Completion, results: list[dict[str, Any]], jobs: list[tuple[int, Any, int | None]]
                 ) -> dict[str, int]:
        """Tokens read (each prompt once, however many choices) and written."""
        usage = {"prompt_tokens": sum(r["prompt_tokens"] for r, (i, _, _) in zip(results, jobs) if i % c.n == 0),
                 "completion_tokens": sum(r["completion_tokens"] for r in results)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage

    async def respond(c: Completion, shape: Shape) -> Response:
        """The answer to a checked completion in ``shape``'s protocol: whole, or streamed as server-sent events."""
        if svc.task == "summarization":
            raise OpenAIError(400, "this server runs a summarization run; completions need a language model or "
                                   "a translation run", code="wrong_task")
        # Every sampling number checked (completion_options), and the prompts: before batching (one request's bad
        # prompt must not fail the others in its batch) and before a stream's 200.
        c = completion_options(c, svc.model.cfg.decode, language_model=svc.task == "lm")
        check_prompts(c)
        rid, when = shape.new_id(), int(time.time())
        jobs = choices_for(c)
        translation = svc.task == "translation"
        if not c.stream:
            if translation:
                results = await translate_choices(c, jobs)
            elif c.scored:
                results = await svc.batcher.run(None, [(p, s, c) for _, p, s in jobs], lm_cost(c, jobs), run_scored)
            else:
                results = await svc.batcher.run(lm_group(c), [(p, s, c, None, None) for _, p, s in jobs],
                                                lm_cost(c, jobs), run_lm)
            return JSONResponse({"id": rid, "object": shape.object, "created": when, "model": model_id,
                                 "choices": [shape.choice(i, r) for r, (i, _, _) in zip(results, jobs)],
                                 "usage": usage_of(c, results, jobs)})
        stream = EventStream(svc.batcher.stats)  # the one cancellation path of streamed answers

        def event(body: dict[str, Any]) -> bytes:
            return ("data: " + json.dumps(body, ensure_ascii=False) + "\n\n").encode("utf-8")

        def chunk(choice: dict[str, Any]) -> bytes:
            body = {"id": rid, "object": shape.chunk_object, "created": when, "model": model_id, "choices": [choice]}
            return event({**body, "usage": None} if c.include_usage else body)  # OpenAI's chunks, with usage asked

        filters = {index: shape.text_filter() for index, _, _ in jobs}
        for index, _, _ in jobs:
            opening = shape.opening(index)
            if opening is not None:
                stream.push(chunk(opening))

        def text_chunk(index: int, text: str) -> None:  # worker thread: each final piece of a choice's text
            text = filters[index](text)
            if text:
                stream.push(chunk(shape.delta(index, text, None)))

        async def generated() -> list[dict[str, Any]]:  # each token as it is decoded, from a shared batch
            items = [(prompt, seed, c, lambda t, i=index: text_chunk(i, t), stream.cancelled)
                     for index, prompt, seed in jobs]
            return await svc.batcher.run(lm_group(c), items, lm_cost(c, jobs), run_lm)

        async def translated() -> list[dict[str, Any]]:  # a translation is decoded whole: one event per choice
            results = await translate_choices(c, jobs, stream.cancelled)
            for r, (index, _, _) in zip(results, jobs):
                text_chunk(index, r["text"])
            return results

        async def answered() -> None:
            results = await (translated() if translation else generated())
            for r, (index, _, _) in zip(results, jobs):  # after every piece: the worker queued those first
                stream.push(chunk(shape.delta(index, "", r["finish_reason"])))
            if c.include_usage:  # OpenAI's last chunk: no choices, the usage of the whole request
                stream.push(event({"id": rid, "object": shape.chunk_object, "created": when, "model": model_id,
                                   "choices": [], "usage": usage_of(c, results, jobs)}))

        def error_event(e: BaseException) -> bytes:  # the headers are sent: say it in the stream, as OpenAI does
            return event({"error": {"message": one_line(f"{type(e).__name__}: {e}"), "type": "server_error",
                                    "param": None, "code": None}})

        return await stream.response(answered(), error_event)

    async def completions(request: Request) -> Response:
        authorize(request)
        body = parse_body(await read_body(request, svc.limits), svc.limits)
        c = completion_request(body, svc.limits)
        check_model(body)
        return await respond(c, TextShape())

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = parse_body(await read_body(request, svc.limits), svc.limits)
        prompt, fields = chat_prompt(body, svc.task)
        c = completion_request({**fields, "prompt": prompt}, svc.limits)
        check_model(body)
        return await respond(c, ChatShape(strip_leading_space=svc.task == "lm"))

    async def tokenize(request: Request) -> Response:
        """vLLM's ``POST /tokenize``: ``{"prompt"}`` -> ``{"tokens", "count", "max_model_len"}``."""
        authorize(request)
        need_lm("/tokenize")
        body = parse_body(await read_body(request, svc.limits), svc.limits)
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or len(prompt) > svc.limits.max_chars:
            raise OpenAIError(400, f"prompt: expected a string of at most {svc.limits.max_chars} characters",
                              param="prompt", code="invalid_type")
        if body.get("add_special_tokens"):  # aiayn's language models read no BOS or EOS around a text
            raise OpenAIError(400, "add_special_tokens: this server adds none", param="add_special_tokens",
                              code="unsupported")
        ids = encode_with_specials(svc.model.run, prompt)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": info()["model_max_length"]})

    async def detokenize(request: Request) -> Response:
        """vLLM's ``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``."""
        authorize(request)
        need_lm("/detokenize")
        body = parse_body(await read_body(request, svc.limits), svc.limits)
        ids = body.get("tokens")
        vocab = svc.model.tokenizers.src.vocab_size
        if not isinstance(ids, list) or not all(_is_id(i) and i < vocab for i in ids):
            raise OpenAIError(400, f"tokens: expected a list of token ids below {vocab}", param="tokens",
                              code="invalid_type")
        return JSONResponse({"prompt": svc.model.tokenizers.src.decode(ids)})

    async def tokenizer(request: Request) -> Response:
        authorize(request)
        need_lm("/tokenizer_info")
        return JSONResponse(info())

    def info() -> dict[str, Any]:
        return tokenizer_info(svc.model.run, model_id)

    def need_lm(path: str) -> None:
        if svc.task != "lm":
            raise OpenAIError(400, f"{path} needs a language-model run; this server runs a {svc.task} run",
                              code="wrong_task")

    return [Route("/v1/models", _openai(models), methods=["GET"]),
            Route("/v1/completions", _openai(completions), methods=["POST"]),
            Route("/v1/chat/completions", _openai(chat_completions), methods=["POST"]),
            Route("/tokenize", _openai(tokenize), methods=["POST"]),
            Route("/detokenize", _openai(detokenize), methods=["POST"]),
            Route("/tokenizer_info", _openai(tokenizer), methods=["GET"])]


def protocol_routes(svc, run_translation, key: str | None) -> list[Route]:
    """Every route of this module for ``svc`` (the server's shared model, batcher and limits)."""
    return [*libre_routes(svc, run_translation, key), *openai_routes(svc, run_translation, key)]
