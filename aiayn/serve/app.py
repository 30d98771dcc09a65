"""The ASGI application of ``aiayn serve`` (Starlette): JSON endpoints, the attention explorer page.

==========================  ========================================================================
``GET /``                   the attention explorer page (static/, served by the package, no CDN)
``GET /health``             {"status": "ok", "queued", "jobs", "calls", "items", "cancelled"} (batcher counters)
``GET /v1/model``           task, run, device, precision, parameters, config, limits, batching
``POST /v1/translate``      {"text": [...], any DecodeOptions field} -> {"translations": [...]}, in order
``POST /v1/generate``       language-model runs: {"prompt", "max_new_tokens", "temperature", ...}
``POST /v1/attention``      {"text", "target"?} -> tokens and attention probabilities (L x H x Q x K)
``POST /translate``, ...    LibreTranslate's and OpenAI's APIs, each with its error shape (:mod:`aiayn.serve.protocols`)
==========================  ========================================================================

Every error is JSON, ``{"error": {"code", "message"}}`` (codes: :mod:`aiayn.serve.schemas`): a bad
request gets its 4xx, a full queue 503, a failing model 500, and the server goes on serving.
All model work runs on the batcher's worker thread (:mod:`aiayn.serve.batcher`).

Who may call it (:class:`Access`): a request whose ``Host`` header names none of the allowed hosts is refused
(403 ``host_not_allowed``): a page on another site that rebinds its DNS name to this machine cannot use the
server. A POST must say ``Content-Type: application/json`` (else 415; LibreTranslate's routes also take forms,
as its clients send them): browsers then ask before sending one
from another origin, and no CORS header answers them unless ``--cors ORIGIN`` names that origin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from aiayn.decode.generate import Generator
from aiayn.decode.stream import hypothesis_json
from aiayn.decode.translator import Translation, Translator
from aiayn.errors import UserError, one_line
from aiayn.model.transformer import count_parameters
from aiayn.run_dir import Run
from aiayn.serve.batcher import Batcher, Closed, QueueFull
from aiayn.serve.protocols import FORM_PATHS, check_key, error_response, protocol_routes
from aiayn.serve.schemas import (
    ApiError,
    Limits,
    attention_request,
    generate_request,
    parse_body,
    read_body,
    source_tokens,
    translate_request,
)
from aiayn.viz.attention import KINDS, attention_data

log = logging.getLogger("aiayn.serve")

STATIC = Path(__file__).resolve().parent / "static"
TASK_NAMES = {"translation": "translation", "summarization": "summarization", "lm": "language-model (task lm)"}
Handler = Callable[[Request], Awaitable[Response]]


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True)
class Access:
    """``hosts``: the names a request's Host header may give (the loopback names, the bound address, and what
    ``--allow-host`` adds; ``"*"`` allows any); ``cors``: the one other origin whose pages may call the API
    (None: none)."""

    hosts: tuple[str, ...] = LOOPBACK_NAMES
    cors: str | None = None

    def allows(self, host_header: str) -> bool:
        """Whether a Host header ("name", "name:port", "[::1]:port") names an allowed host."""
        if "*" in self.hosts:
            return True
        name = host_header.strip().lower()
        if name.startswith("["):  # [IPv6] or [IPv6]:port, nothing else after the bracket ("[::1].evil.example")
            found = re.fullmatch(r"\[([^\]]*)\](?::\d*)?", name)
            if found is None:
                return False
            name = found.group(1)
        elif name.count(":") == 1:
            name = name.split(":", 1)[0]
        return name in self.hosts


class Guard:
    """ASGI middleware in front of every route: the Host allow-list, the JSON content type of a POST, CORS."""

    def __init__(self, app, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        host = request.headers.get("host", "")
        origin = request.headers.get("origin")
        cors = self.access.cors is not None and origin == self.access.cors
        extra = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if cors else {}
        path = request.url.path
        refusal = None
        if not self.access.allows(host):
            refusal = error_response(path, 403, "host_not_allowed", f"Host {host!r} is not one this server answers "
                                                                    "to (aiayn serve --allow-host NAME adds one)")
        elif request.method == "OPTIONS":
            if cors:
                # Authorization: a page of that origin may send the --api-key as a bearer token
                refusal = Response(status_code=204, headers={
                    **extra, "Access-Control-Allow-Methods": "GET, POST",
                    "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600"})
            else:
                refusal = error_response(path, 403, "cors_not_allowed", f"origin {origin!r} may not call this "
                                                                        "server (aiayn serve --cors ORIGIN allows one)")
        elif request.method == "POST":
            ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            forms = ("application/json", "application/x-www-form-urlencoded", "multipart/form-data")
            if ctype != "application/json" and not (request.url.path in FORM_PATHS and ctype in forms):
                refusal = error_response(path, 415, "unsupported_media_type",
                                         f"Content-Type {ctype or 'none'!r}: send application/json", extra)
            elif origin is not None and not cors and not _same_origin(origin, host):
                refusal = error_response(path, 403, "cors_not_allowed", f"origin {origin!r} may not call this "
                                                                        "server (aiayn serve --cors ORIGIN allows one)")
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if not extra:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      *((k.lower().encode(), v.encode()) for k, v in extra.items())]
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (scheme://host[:port]) is this server's own page (what its Host header says)."""
    return origin.split("://", 1)[-1].lower() == host.strip().lower()


@dataclasses.dataclass
class Service:
    """What the routes share: the loaded model, its batcher and the request limits."""

    model: Translator | Generator
    batcher: Batcher
    limits: Limits

    @property
    def task(self) -> str:
        return self.model.cfg.task

    @property
    def run(self) -> Run:
        return self.model.run

    def need(self, endpoint: str, *tasks: str) -> None:
        if self.task not in tasks:
            other = "/v1/generate" if self.task == "lm" else "/v1/translate"
            wanted = " or ".join(TASK_NAMES[t] for t in tasks)
            raise ApiError(400, "wrong_task", f"{endpoint} needs a {wanted} run; this server runs a "
                                              f"{TASK_NAMES[self.task]} run (use {other})")


def translation_json(hyps: list[Translation]) -> dict[str, Any]:
    """One input's result: the best hypothesis' fields, and all of them best first under ``nbest``."""
    if not hyps:  # an empty input line: an empty output, as `aiayn translate` writes
        return {"text": "", "score": None, "logprob": None, "tokens": [], "nbest": []}
    return {**hypothesis_json(hyps[0]), "nbest": [hypothesis_json(h) for h in hyps]}


def attention_json(run: Run, text: str, target: str | None) -> bytes:
    """The response body of /v1/attention, rendered on the worker thread (it can be large)."""
    data = attention_data(run, text, target)
    kinds = {}
    for kind, m in data.maps.items():
        L, H, Q, K = m.weights.shape
        kinds[kind] = {"title": KINDS[kind], "layers": L, "heads": H, "queries": m.queries, "keys": m.keys,
                       "predicts": m.predicts,  # decoder rows: the token each step predicts (None: encoder)
                       "weights": np.round(m.weights, 5).tolist()}  # (L, H, Q, K), each row sums to 1
    body = {"task": run.cfg.task, "source": data.src, "target": data.tgt, "generated": data.generated,
            "attention": kinds}
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def json_errors(handler: Handler) -> Handler:
    """Turn whatever a route raises into a JSON error: ApiError as it says, a user error (bad options
    the model rejects) 422, a full queue 503, shutdown 503, anything else 500 (logged)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            err = e
        except UserError as e:
            err = ApiError(422, "invalid_request", str(e))
        except QueueFull as e:
            err = ApiError(503, "queue_full", f"{e}: retry later")
        except Closed as e:
            err = ApiError(503, "shutting_down", str(e))
        except Exception as e:  # the model failed: answer, log, keep serving
            log.error("%s %s failed: %s: %s", request.method, request.url.path, type(e).__name__, e)
            err = ApiError(500, "model_error", one_line(f"{type(e).__name__}: {e}"))
        headers = {"Retry-After": "1"} if err.status == 503 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    return wrapped


def create_app(model: Translator | Generator, max_batch_tokens: int | None = None, max_wait_ms: float = 10.0,
               max_queue: int = 256, limits: Limits | None = None, access: Access | None = None,
               api_key: str | None = None):
    """The server for a loaded model (``aiayn.load(RUN)``). ``max_batch_tokens`` (default: the device's
    decoding budget) bounds the source tokens x beam merged into one model call; ``max_wait_ms`` is how
    long the first request of a call waits for others; ``max_queue`` requests wait at most; ``access``: who
    may call it (default: loopback names only, no CORS); ``api_key``: when set, every API request must carry it
    (:mod:`aiayn.serve.protocols`). Returns the ASGI app (its ``state.service`` is the
    loaded model, batcher and limits)."""
    limits = limits or Limits()
    access = access or Access()
    budget = max_batch_tokens or model.cfg.decode.batch_tokens(model.device.type)
    svc = Service(model, Batcher(budget, max_wait_ms, max_queue), limits)
    started = time.time()

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def health(request: Request) -> Response:
        s = svc.batcher.stats
        return JSONResponse({"status": "ok", "queued": svc.batcher.queued, "jobs": s.jobs, "calls": s.calls,
                             "items": s.items, "cancelled": s.cancelled, "uptime_s": round(time.time() - started, 3)})

    async def model_info(request: Request) -> Response:
        check_key(request, api_key)
        m = svc.model
        return JSONResponse({
            "task": svc.task, "run": str(m.path), "device": str(m.device),
            "precision": str(next(m.model.parameters()).dtype).removeprefix("torch."),
            "parameters": count_parameters(m.model), "config": m.cfg.to_dict(),
            "limits": {**dataclasses.asdict(limits), "attention_tokens": m.cfg.model.max_positions},
            "batching": {"max_batch_tokens": budget, "max_wait_ms": max_wait_ms, "max_queue": max_queue},
        })

    async def translate(request: Request) -> Response:
        check_key(request, api_key)
        body = parse_body(await read_body(request, limits), limits)
        svc.need("/v1/translate", "translation", "summarization")
        texts, opts = translate_request(body, svc.model.cfg.decode, limits)
        found, opts = await run_translation(texts, opts)
        return JSONResponse({"translations": [translation_json(h) for h in found],
                             "options": dataclasses.asdict(opts)})

    async def run_translation(texts: list[str], opts, seeds: list[int] | None = None, field: str = "text",
                              cancelled: threading.Event | None = None) -> tuple[list[list[Translation]], Any]:
        """Translate ``texts`` through the batcher (merged with concurrent requests of the same options);
        returns the hypotheses of each text and the options used. A text too long for the model is a 413 naming
        ``field[i]`` (the request's own name of its texts). ``seeds``: one seeded draw per text, each decoded alone
        (a seeded draw must not depend on its batch) but all in one job, so one request takes one queue place.
        ``cancelled`` (a stream's): once set, the search stops at its next step if no other request shares it."""
        stop = svc.batcher.call_cancelled
        tr: Translator = svc.model
        opts = opts.replace(max_tokens=budget)
        cost = sum(n + 1 for n in source_tokens(tr, texts, field) if n) * (opts.nbest if opts.sample else opts.beam)
        if seeds is not None:
            draws = [opts.replace(sample=True, seed=seed) for seed in seeds]
            found = await svc.batcher.run(None, list(zip(texts, draws)), max(cost, 1), lambda items: [
                tr.search([text], o, scores=True, stop=stop)[0] for text, o in items], cancelled)
            return found, opts
        # Seeded draws must not depend on who else is in the batch: such requests run alone.
        group = None if opts.sample and opts.seed is not None else ("translate", dataclasses.astuple(opts))
        found = await svc.batcher.run(group, texts, max(cost, 1),
                                      lambda items: tr.search(items, opts, scores=True, stop=stop), cancelled)
        return found, opts

    async def generate(request: Request) -> Response:
        check_key(request, api_key)
        body = parse_body(await read_body(request, limits), limits)
        svc.need("/v1/generate", "lm")
        gen: Generator = svc.model
        prompt, opts = generate_request(body, gen.cfg.decode, limits)
        [text] = await svc.batcher.run(None, [prompt], 1, lambda items: [gen.generate(p, opts) for p in items])
        return JSONResponse({"prompt": prompt, "text": text, "options": dataclasses.asdict(opts)})

    async def attention(request: Request) -> Response:
        check_key(request, api_key)
        body = parse_body(await read_body(request, limits), limits)
        text, target = attention_request(body, limits)
        run = svc.run
        n, room = len(run.tokenizers.src.encode(text)), run.cfg.model.max_positions - (svc.task != "lm")
        if n > room:
            raise ApiError(413, "line_too_long", f"text: {n} tokens, the model takes at most {room}")
        if target is not None and svc.task != "lm":
            m, steps = len(run.tokenizers.tgt.encode(target)), run.cfg.model.max_positions - 1
            if m > steps:  # the whole target or nothing: a map of its first positions would mislead
                raise ApiError(413, "line_too_long", f"target: {m} tokens, the decoder reads at most {steps} "
                                                     "after its start token (the model's positions)")
        [payload] = await svc.batcher.run(None, [text], 1, lambda items: [attention_json(run, items[0], target)])
        return Response(payload, media_type="application/json")

    async def not_found(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(request.url.path, exc.status_code, code, msg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        # uvicorn has already waited for the requests in flight; finish anything still queued.
        svc.batcher.close(timeout=60)

    routes = [
        Route("/", json_errors(index)),
        Route("/health", json_errors(health)),
        Route("/v1/model", json_errors(model_info)),
        Route("/v1/translate", json_errors(translate), methods=["POST"]),
        Route("/v1/generate", json_errors(generate), methods=["POST"]),
        Route("/v1/attention", json_errors(attention), methods=["POST"]),
        *protocol_routes(svc, run_translation, api_key),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.service = svc
    guarded = Guard(app, access)
    guarded.state = app.state  # tests and tools reach the service through it
    return guarded


@torch.no_grad()
def warm_up(model: Translator | Generator) -> None:
    """One tiny call so that the first user does not pay for lazy initialisation."""
    if isinstance(model, Translator):
        model.search(["warm up"], model.options(beam=1, nbest=1), scores=False)
    else:
        model.generate("", max_new_tokens=1)
