"""Every error of ``aiayn serve`` in the shape of the protocol it answers: the one place that maps them.

* aiayn's own API (:mod:`aiayn.serve.native`, and any path no route table serves or claims):
  ``{"error": {"code", "message"}}`` (:class:`~aiayn.serve.schemas.ApiError`, codes in :mod:`aiayn.serve.schemas`).
* LibreTranslate's routes (:mod:`aiayn.serve.libretranslate`): ``{"error": message}`` (:class:`LibreError`).
* OpenAI's and vLLM's (:mod:`aiayn.serve.openai_api`, :mod:`aiayn.serve.tokenizer_routes`, and any other
  ``/v1/...`` path): ``{"error": {"message", "type", "param", "code"}}`` (:class:`OpenAIError`).

Each route's handler is wrapped by :func:`answering_errors` with its protocol, which answers whatever it raises:
its protocol's own error as it says, an :class:`~aiayn.serve.schemas.ApiError` of request checking, a user error
(options the model rejects), a full queue, a server shutting down, and anything else as a 500, after which the
server goes on serving (:data:`ERRORS`, one function per protocol). What is refused before any route's handler
runs (no such route or method, a media type, a host, an origin) goes through :func:`error_response` in the shape
of the protocol the path answers in, which the mounted route tables tell (:class:`aiayn.serve.routes.Protocols`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiayn.errors import UserError, one_line
from aiayn.serve.batcher import Closed, QueueFull
from aiayn.serve.schemas import ApiError

log = logging.getLogger("aiayn.serve")

Handler = Callable[[Request], Awaitable[Response]]


class LibreError(Exception):
    """A LibreTranslate-shaped refusal: ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class OpenAIError(Exception):
    """An OpenAI-shaped refusal: ``status`` and ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_response(protocol: str, status: int, code: str, message: str, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """A refusal made before any route's handler (no such route or method, media type, host, origin) in
    ``protocol``'s error shape (``"aiayn"``, ``"libretranslate"`` or ``"openai"``)."""
    if protocol == "libretranslate":
        body: dict[str, Any] = {"error": message}
    elif protocol == "openai":
        body = OpenAIError(status, message, code=code, kind="server_error" if status >= 500 else
                           "invalid_request_error").body()
    else:
        body = {"error": {"code": code, "message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def aiayn_error(e: Exception, request: Request) -> JSONResponse:
    """aiayn's own API: an ApiError as it says, a user error (bad options the model rejects) 422, a full queue
    503, shutdown 503 (both with Retry-After), anything else 500 (logged)."""
    if isinstance(e, ApiError):
        err = e
    elif isinstance(e, UserError):
        err = ApiError(422, "invalid_request", str(e))
    elif isinstance(e, QueueFull):
        err = ApiError(503, "queue_full", f"{e}: retry later")
    elif isinstance(e, Closed):
        err = ApiError(503, "shutting_down", str(e))
    else:  # the model failed: answer, log, keep serving
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(e).__name__, e)
        err = ApiError(500, "model_error", one_line(f"{type(e).__name__}: {e}"))
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def libre_error(e: Exception, request: Request) -> JSONResponse:
    """LibreTranslate's shape: its own 400s, request checking's 422 as 400, a full queue 429 (as LibreTranslate's
    rate limit), shutdown 503, anything else 500."""
    if isinstance(e, LibreError):
        status, message = e.status, e.message
    elif isinstance(e, ApiError):
        status, message = (400 if e.status == 422 else e.status), e.message
    elif isinstance(e, UserError):
        status, message = 400, str(e)
    elif isinstance(e, (QueueFull, Closed)):
        status, message = 429 if isinstance(e, QueueFull) else 503, f"{e}: retry later"
    else:  # the model failed: answer, keep serving
        status, message = 500, one_line(f"{type(e).__name__}: {e}")
    return JSONResponse({"error": message}, status_code=status)


def openai_error(e: Exception, request: Request) -> JSONResponse:
    """OpenAI's shape: request checking's 422 as 400 (its code kept), a full queue 429 ``rate_limit_error``,
    shutdown 503 and anything else 500 as ``server_error``."""
    if isinstance(e, OpenAIError):
        return e.response()
    if isinstance(e, ApiError):
        return OpenAIError(400 if e.status == 422 else e.status, e.message, code=e.code).response()
    if isinstance(e, UserError):
        return OpenAIError(400, str(e)).response()
    if isinstance(e, QueueFull):
        return OpenAIError(429, f"{e}: retry later", kind="rate_limit_error").response()
    if isinstance(e, Closed):
        return OpenAIError(503, str(e), kind="server_error").response()
    return OpenAIError(500, one_line(f"{type(e).__name__}: {e}"), kind="server_error").response()


def openai_stream_error(e: BaseException) -> dict[str, Any]:
    """The error event of a streamed OpenAI answer that failed after its 200 headers were sent (OpenAI says it
    in the stream)."""
    return OpenAIError(500, one_line(f"{type(e).__name__}: {e}"), kind="server_error").body()


ERRORS: dict[str, Callable[[Exception, Request], JSONResponse]] = {
    "aiayn": aiayn_error, "libretranslate": libre_error, "openai": openai_error}


def answering_errors(protocol: str, handler: Handler) -> Handler:
    """``handler`` with whatever it raises answered in ``protocol``'s shape (:data:`ERRORS`)."""
    to_response = ERRORS[protocol]

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:
            return to_response(e, request)

    return wrapped
