"""Streamed answers (server-sent events) and their one cancellation path.

A streamed answer is produced on the batcher's worker thread and sent by the event loop. :class:`EventStream`
joins the two: the worker pushes each event as it is decoded (:meth:`EventStream.push`, from any thread), the
response sends them in order. When the client goes away (it closes the connection, Starlette's response stops),
the stream is cancelled: :attr:`EventStream.cancelled` is set, which the decoding reads once per step and then
stops (a job already running ends within one decoding step: a language model's token loop reads it directly, a
translation's search through :meth:`aiayn.serve.batcher.Batcher.call_cancelled`, when every request of its model
call is gone), and the job's future is cancelled, so that a job still in the queue is never run
(:meth:`aiayn.serve.batcher.Batcher._take` drops it).

Every streamed route answers through :meth:`EventStream.response`, so a new streamed endpoint gets the same rule.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse

from aiayn.serve.batcher import Stats

DONE = b"data: [DONE]\n\n"


class EventStream:
    """The events of one streamed answer, from the worker thread to the client (see the module docstring)."""

    def __init__(self, stats: Stats | None = None) -> None:
        self.stats = stats  # the batcher's counters: stats.cancelled counts the streams whose client went away
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.cancelled = threading.Event()  # set when the client went away: the decoding loop stops at its next step
        self.future: asyncio.Future | None = None

    def push(self, event: bytes) -> None:
        """Queue one event for the client (from any thread; nothing once the stream is cancelled)."""
        if not self.cancelled.is_set():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def cancel(self) -> None:
        """The client is gone: stop the decoding (at its next step) and drop the job if it still waits."""
        if self.future is not None and not self.future.done():
            self.cancelled.set()
            self.future.cancel()
            if self.stats is not None:
                self.stats.cancelled += 1

    async def response(self, work: Awaitable[Any], error_event: Callable[[BaseException], bytes],
                       headers: dict[str, str] | None = None) -> StreamingResponse:
        """Start ``work`` (a coroutine that queues its job, pushes the events and returns when the answer is
        complete) and answer with its events, then ``error_event(exception)`` if it failed later (the 200 headers
        are sent by then), then ``data: [DONE]``. What fails while the job is queued (a full queue, a server
        shutting down, a request the queueing refuses) raises here instead, before any header: the route answers
        it with its 4xx or 503 as it would without ``stream``."""
        self.future = asyncio.ensure_future(work)
        await asyncio.sleep(0)  # the work's first step runs: up to the job waiting in the queue
        if self.future.done() and not self.future.cancelled() and self.future.exception() is not None:
            raise self.future.exception()
        self.future.add_done_callback(lambda f: self.queue.put_nowait(None))

        async def events() -> AsyncIterator[bytes]:
            while (item := await self.queue.get()) is not None:
                yield item
            if not self.future.cancelled() and self.future.exception() is not None:
                yield error_event(self.future.exception())
            yield DONE

        return _Cancellable(events(), self.cancel, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


class _Cancellable(StreamingResponse):
    """A streaming response that calls ``on_close`` however it ends: sent whole (a no-op then), or stopped because
    the client disconnected (Starlette cancels the sending, or the sending fails)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
