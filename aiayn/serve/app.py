"""The ASGI application of ``aiayn serve`` (Starlette): the route table of each protocol behind one guard.

The tables (:class:`aiayn.serve.routes.RouteTable`, each path declared once beside its handler): aiayn's own API
(:mod:`aiayn.serve.native`), LibreTranslate's (:mod:`aiayn.serve.libretranslate`), OpenAI's
(:mod:`aiayn.serve.openai_api`) and vLLM's tokenizer routes (:mod:`aiayn.serve.tokenizer_routes`).

Every error is JSON in its protocol's shape (:mod:`aiayn.serve.errors`), also for a route or method that does not
exist (the mounted tables say which protocol a path answers in: :class:`aiayn.serve.routes.Protocols`); a bad
request gets its 4xx, a full queue 503 (429 on the ecosystem's protocols), a failing model 500, and the server
goes on serving. All model work runs on the batcher's worker thread (:mod:`aiayn.serve.batcher`).

Who may call it (:class:`Access`): a request whose ``Host`` header names none of the allowed hosts is refused
(403 ``host_not_allowed``): a page on another site that rebinds its DNS name to this machine cannot use the
server. A POST must say ``Content-Type: application/json`` (else 415; LibreTranslate's routes also take forms,
as its clients send them): browsers then ask before sending one
from another origin, and no CORS header answers them unless ``--cors ORIGIN`` names that origin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from aiayn.decode.generate import Generator
from aiayn.decode.translator import Translator
from aiayn.serve.batcher import Batching
from aiayn.serve.libretranslate import LibreTranslate
from aiayn.serve.native import STATIC, NativeRoutes
from aiayn.serve.openai_api import OpenAIRoutes
from aiayn.serve.routes import Protocols
from aiayn.serve.schemas import Limits
from aiayn.serve.service import Choices, Service
from aiayn.serve.tokenizer_routes import TokenizerRoutes

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

    def __init__(self, app, access: Access, protocols: Protocols) -> None:
        self.app, self.access, self.protocols = app, access, protocols

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
        error_response = self.protocols.error_response  # in the shape of the protocol the path answers in
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
            if ctype != "application/json" and not (self.protocols.takes_forms(path) and ctype in forms):
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


async def not_found(request: Request, exc: HTTPException) -> Response:
    """No such route or method, in the error shape of the protocol the path belongs to."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    if request.url.path != "/" and request.url.path.endswith("/"):  # never redirected: a 307 with no body
        msg += f" (the routes have no trailing slash: {request.url.path.rstrip('/')})"
    return request.app.state.protocols.error_response(request.url.path, exc.status_code, code, msg)


def create_app(model: Translator | Generator, batching: Batching | None = None, limits: Limits | None = None,
               access: Access | None = None, api_key: str | None = None, choices: Choices | None = None):
    """The server for a loaded model (``aiayn.load(RUN)``). ``batching``: how model calls are merged and run
    (:class:`aiayn.serve.batcher.Batching`: ``max_batch_tokens``, default the device's decoding budget, bounds the
    source tokens x beam merged into one call; ``max_wait_ms`` is how long the first request of a call waits for
    others; ``max_queue`` requests wait at most; ``workers`` calls run side by side); ``access``: who may call it
    (default: loopback names only, no CORS); ``api_key``: when set, every API request must carry it
    (:mod:`aiayn.serve.service`); ``choices``: the operator's decoding options, replacing the run's ``decode``
    section on every route (``Choices(decode={"beam": 4, "alpha": 0.2, "length_penalty": "power"})``), and model
    aliases. Returns the ASGI app (its ``state.service`` is the loaded model, batcher and limits)."""
    choices, batching = choices or Choices(), batching or Batching()
    base = model.cfg.decode.replace(**choices.decode)  # a bad option fails here, before anything is served
    budget = batching.max_batch_tokens or base.batch_tokens(model.device.type)
    batcher = batching.batcher(budget)
    svc = Service(model=model, batcher=batcher, limits=limits or Limits(), api_key=api_key, budget=budget,
                  max_wait_ms=batching.max_wait_ms, max_queue=batching.max_queue, choices=choices)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        # uvicorn has already waited for the requests in flight; finish anything still queued.
        svc.batcher.close(timeout=60)

    openai = OpenAIRoutes(svc)
    tables = (NativeRoutes(svc), LibreTranslate(svc), openai, TokenizerRoutes(openai))
    routes = [*(r for table in tables for r in table.routes()),
              Mount("/static", StaticFiles(directory=STATIC), name="static")]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.router.redirect_slashes = False  # POST /v1/completions/ answered 307, no body: now a 404 saying why
    app.state.service = svc
    app.state.protocols = Protocols(tables)  # the error shape of each path, asked of the mounted tables
    guarded = Guard(app, access or Access(), app.state.protocols)
    guarded.state = app.state  # tests and tools reach the service through it
    return guarded


@torch.no_grad()
def warm_up(model: Translator | Generator) -> None:
    """One tiny call so that the first user does not pay for lazy initialisation (the run's own)."""
    model.warm_up()
