"""The ecosystem's protocols beside aiayn's own API: LibreTranslate for translation runs, OpenAI completions for
language-model runs, so their clients (``libretranslatepy``, LibreTranslate plugins, the ``openai`` package and
the tools built on it) work against ``aiayn serve`` unchanged.

===============================  ==================================================================================
``POST /translate``              LibreTranslate: ``q`` (string or list), ``source`` (the run's source language or
                                 ``auto``), ``target``, ``format`` (text; html is translated as text),
                                 ``alternatives``, ``api_key``; JSON or form-encoded, as its clients send.
                                 -> ``{"translatedText": str | [str]}`` (+ ``alternatives``); errors
                                 ``{"error": message}``
``GET /languages``               LibreTranslate: ``[{"code", "name", "targets"}]``, the run's source language
``GET /v1/models``               OpenAI: the served run as one model
``POST /v1/completions``         OpenAI completions (language-model runs): ``prompt`` (string or list),
                                 ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``stream``
                                 (server-sent events ending in ``data: [DONE]``); ``usage`` in tokens; errors
                                 ``{"error": {"message", "type", "param", "code"}}``
===============================  ==================================================================================

Translation runs answer ``/v1/completions`` too: the prompt is the sentence to translate, the completion its
translation (beam search with the run's options; ``temperature`` > 0 samples instead).

API key (``aiayn serve --api-key KEY`` or ``$AIAYN_API_KEY``; off by default): every API request must then
carry it, as ``Authorization: Bearer KEY`` (OpenAI's clients, aiayn's own ``/v1/*``) or as the ``api_key`` field
(LibreTranslate's); compared in constant time. A missing or wrong key is 403 in the protocol's error shape.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import secrets
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
from aiayn.serve.schemas import ApiError, parse_body, read_body, source_tokens
from aiayn.serve.streams import EventStream

FORM_PATHS = ("/translate", "/languages")  # LibreTranslate's clients post forms, not JSON
OPENAI_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "user",
                 "echo", "logprobs", "presence_penalty", "frequency_penalty", "best_of", "suffix", "logit_bias",
                 "stream_options")
MAX_STOPS = 4  # as OpenAI


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
        # a repeated q is a list of texts (LibreTranslate's JSON list, sent as a form)
        params.update({k: (v if k == "q" and len(v) > 1 else v[-1]) for k, v in form.items()})
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
    """``/translate`` and ``/languages`` for a translation run (other runs: 400 naming the endpoint they have)."""
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
        unknown = sorted(set(fields) - {"q", "source", "target", "format", "api_key", "alternatives"})
        if unknown:
            raise LibreError(400, f"unknown parameter {unknown[0]!r}")
        for name in ("q", "source", "target"):
            if fields.get(name) in (None, ""):
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

    return [Route("/languages", _libre(languages), methods=["GET", "POST"]),
            Route("/translate", _libre(translate), methods=["POST"])]


# OpenAI completions ----------------------------------------------------------------------------------------


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


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

    prompts: list[str]
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    options: DecodeOptions | None = None  # the decoding options, checked before any answer (completion_options)


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


def completion_request(body: dict[str, Any], limits) -> Completion:
    """The checked fields of an OpenAI completions request (unknown fields refused by name)."""
    unknown = sorted(set(body) - set(OPENAI_FIELDS))
    if unknown:
        raise OpenAIError(400, f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    # Accepted only at the value that asks for nothing: a request for what this server does not do is refused,
    # not silently ignored (echo=true would otherwise get no prompt back, logprobs=1 no log-probabilities).
    for name, neutral in (("echo", (None, False)), ("logprobs", (None,)), ("best_of", (None, 1)),
                          ("suffix", (None, "")), ("logit_bias", (None, {}))):
        value = body.get(name)
        if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            raise OpenAIError(400, f"{name} is not supported by this server", param=name, code="unsupported")
    prompt = body.get("prompt", "")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise OpenAIError(400, "prompt: expected a string or a non-empty list of strings", param="prompt",
                          code="invalid_type")
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
    return Completion(prompts, _number(body, "max_tokens", 16, 1, limits.max_new_tokens, integer=True),
                      float(_number(body, "temperature", 1.0, 0.0, 2.0)), float(_number(body, "top_p", 1.0, 0.0, 1.0)),
                      n, tuple(stops), seed, stream)


def completion_options(c: Completion, base: DecodeOptions, language_model: bool) -> Completion:
    """``c`` with its decoding options on the run's ``base``: sampling at ``temperature`` > 0 (0: greedy for a
    language model, the run's search for a translation run), ``top_p`` below 1. Every sampling number goes through
    :class:`DecodeOptions`, the one validator of the command line, the recipes and every route; one it refuses
    (``top_p`` 0, a ``temperature`` below 1e-6) is a 400 naming the field, before any streamed 200 is sent."""
    overrides: dict[str, Any] = {"top_p": c.top_p if c.top_p < 1 else None}
    if c.temperature > 0:
        overrides.update(sample=True, temperature=c.temperature)
    elif language_model:
        overrides["sample"] = False
    if language_model:
        overrides["max_new_tokens"] = c.max_tokens
    try:
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
        """Every choice of a completion on a translation run: the run's search (temperature 0: every choice of
        a prompt is the same translation, decoded once) or a draw (temperature > 0), through the batcher;
        ``cancelled`` (a stream's) stops the search at its next step once the client went away."""
        tr = svc.model
        base = c.options.replace(nbest=1)
        if c.temperature == 0:
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

    async def completions(request: Request) -> Response:
        authorize(request)
        body = parse_body(await read_body(request, svc.limits), svc.limits)
        c = completion_request(body, svc.limits)
        if svc.task == "summarization":
            raise OpenAIError(400, "this server runs a summarization run; completions need a language model or "
                                   "a translation run", code="wrong_task")
        c = completion_options(c, svc.model.cfg.decode, language_model=svc.task == "lm")
        rid, when = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        jobs = choices_for(c)
        translation = svc.task == "translation"
        # Before batching (one request's bad prompt must not fail the others in its batch) and before a stream's 200.
        if translation:
            source_tokens(svc.model, c.prompts, "prompt")
        else:
            from aiayn.decode.generate import check_prompt_fits, prompt_ids

            for prompt in c.prompts:
                check_prompt_fits(svc.model.cfg, prompt_ids(svc.model.cfg, svc.model.tokenizers.src, prompt))
        if not c.stream:
            if translation:
                results = await translate_choices(c, jobs)
            else:
                results = await svc.batcher.run(lm_group(c), [(p, s, c, None, None) for _, p, s in jobs],
                                                lm_cost(c, jobs), run_lm)
            usage = {"prompt_tokens": sum(r["prompt_tokens"] for r, (i, _, _) in zip(results, jobs)
                                          if i % c.n == 0),
                     "completion_tokens": sum(r["completion_tokens"] for r in results)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            return JSONResponse({"id": rid, "object": "text_completion", "created": when, "model": model_id,
                                 "choices": [{"text": r["text"], "index": i, "logprobs": None,
                                              "finish_reason": r["finish_reason"]}
                                             for r, (i, _, _) in zip(results, jobs)],
                                 "usage": usage})
        stream = EventStream(svc.batcher.stats)

        def chunk(index: int, text: str, finish: str | None) -> bytes:
            return ("data: " + json.dumps({"id": rid, "object": "text_completion", "created": when,
                                           "model": model_id, "choices": [{"text": text, "index": index,
                                                                           "logprobs": None,
                                                                           "finish_reason": finish}]},
                                          ensure_ascii=False) + "\n\n").encode("utf-8")

        async def generated() -> None:  # each token as it is decoded, from a batch shared with other requests
            items = [(prompt, seed, c, lambda t, i=index: stream.push(chunk(i, t, None)), stream.cancelled)
                     for index, prompt, seed in jobs]
            results = await svc.batcher.run(lm_group(c), items, lm_cost(c, jobs), run_lm)
            for r, (index, _, _) in zip(results, jobs):  # after every piece: the worker queued those first
                stream.push(chunk(index, "", r["finish_reason"]))

        async def translated() -> None:  # a translation is decoded whole: each choice comes as one event
            for r, (index, _, _) in zip(await translate_choices(c, jobs, stream.cancelled), jobs):
                for text, finish in ((r["text"], None), ("", r["finish_reason"])):
                    if text or finish:
                        stream.push(chunk(index, text, finish))

        def error_event(e: BaseException) -> bytes:  # the headers are sent: say it in the stream, as OpenAI does
            return ("data: " + json.dumps({"error": {"message": one_line(f"{type(e).__name__}: {e}"),
                                                     "type": "server_error", "param": None, "code": None}})
                    + "\n\n").encode("utf-8")

        return await stream.response(translated() if translation else generated(), error_event)

    return [Route("/v1/models", _openai(models), methods=["GET"]),
            Route("/v1/completions", _openai(completions), methods=["POST"])]


def protocol_routes(svc, run_translation, key: str | None) -> list[Route]:
    """Every route of this module for ``svc`` (the server's shared model, batcher and limits)."""
    return [*libre_routes(svc, run_translation, key), *openai_routes(svc, run_translation, key)]
