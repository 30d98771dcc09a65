"""Dynamic batching: requests that arrive close together share one model call, on one worker thread.

The event loop only enqueues a :class:`Job` and awaits its future; the model runs on the batcher's
single worker thread, so a long decode never blocks the loop (health checks, new requests and
the page stay responsive) and the model is never entered by two threads at once.

Grouping rule. Jobs carry a ``group``; jobs with the same non-None group (a translate request's
decoding options) can be merged: their items are concatenated, the group's function runs once, and
each job gets back its own slice of the results, in order. The worker takes the oldest job, then
waits up to ``max_wait_ms`` after that job's arrival for more jobs of its group, until their summed
``cost`` (source tokens x beam) reaches ``max_batch_tokens`` (a job queued while a call ran: up to ``max_wait_ms`` after
that call's answer, so that its clients' next requests join it), or until as many jobs wait as the last call ran (its
clients are back: waiting longer would idle the model); and a job alone in the queue that came after the results of
a model call that ran one job (one client sending one request at a time) runs at once. A job with
group None (generation, attention maps) runs alone. Jobs of other groups keep their place in the queue for the
next round.

Tests prove merging without racing the wait: :meth:`Batcher.hold` keeps the worker from taking jobs while
requests are queued (:meth:`Batcher.wait_queued`), so that on release they are all pending at once.

Backpressure: at most ``max_queue`` jobs wait; one more raises :class:`QueueFull` (the server answers
503). :meth:`Batcher.close` stops taking jobs and lets the worker finish every queued one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from aiayn.errors import ConfigError, UserError

log = logging.getLogger("aiayn.serve")


class QueueFull(Exception):
    """The queue holds ``max_queue`` jobs already."""


class Closed(Exception):
    """The batcher is shutting down and takes no new job."""


@dataclass(eq=False)
class Job:
    """Some items to run through ``run`` (merged items in, one result per item out, same order)."""

    group: Hashable | None
    items: Sequence[Any]
    cost: int
    run: Callable[[list[Any]], list[Any]]
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)
    cancelled: threading.Event | None = None  # set when its client went away (a stream: aiayn.serve.streams)
    setup: bool = False  # Batcher.setup's: not a request, not counted in the stats


@dataclass
class Stats:
    """Counters for /health and the tests: jobs taken, model calls made, items run, largest call."""

    jobs: int = 0
    calls: int = 0
    items: int = 0
    largest_call: int = 0  # jobs merged into one call, at most
    cancelled: int = 0  # streamed answers stopped because their client went away (aiayn.serve.streams)


MAX_WAIT_MS = 60_000.0  # a request waits at most a minute for others to share its model call


def check_batching(max_batch_tokens: int | None, max_wait_ms: float, max_queue: int) -> None:
    """The batcher's settings, as ``aiayn serve`` flags: a one-line ConfigError for one out of range (a wait that
    is NaN would make every request wait forever, an infinite one would stop the model's thread)."""
    if not (math.isfinite(max_wait_ms) and 0 <= max_wait_ms <= MAX_WAIT_MS):
        raise ConfigError(f"--max-wait-ms {max_wait_ms}: expected a number of milliseconds in [0, {MAX_WAIT_MS:g}]")
    if max_batch_tokens is not None and not 1 <= max_batch_tokens <= 2**31:
        raise ConfigError(f"--max-batch-tokens {max_batch_tokens}: expected 1-{2**31}")
    if not 1 <= max_queue <= 1_000_000:
        raise ConfigError(f"--max-queue {max_queue}: expected 1-1000000")


class Batcher:
    """One worker thread that runs queued jobs, merging those of a group (see the module docstring)."""

    def __init__(self, max_batch_tokens: int = 4096, max_wait_ms: float = 10.0, max_queue: int = 256) -> None:
        check_batching(max_batch_tokens, max_wait_ms, max_queue)
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.stats = Stats()
        self._pending: collections.deque[Job] = collections.deque()
        self._current: list[Job] = []  # the jobs of the model call running now (worker thread)
        self._running = 0
        self._held = False
        # (jobs, time its results were given) of the last model call: a job alone in the queue that came after the
        # results of a one-job call is one client sending one request at a time, and no company is coming for it
        self._last_call = (0, 0.0)
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="aiayn-serve-model", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Jobs waiting or running now."""
        with self._cond:
            return len(self._pending) + self._running

    def submit(self, job: Job) -> Future:
        """Queue ``job`` (from any thread); its future gets the list of results or the model's exception."""
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._pending.append(job)
            self._cond.notify_all()
        return job.future

    def setup(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the worker thread, before the jobs queued after it, and wait for it (its exception is raised
        here): what belongs to the thread that runs the model (its CPU threads, a warm-up)."""
        self.submit(Job(None, [None], 0, lambda _: [fn()], setup=True)).result()

    async def run(self, group: Hashable | None, items: Sequence[Any], cost: int,
                  fn: Callable[[list[Any]], list[Any]], cancelled: threading.Event | None = None) -> list[Any]:
        """Queue a job and await its results (on the event loop); ``cancelled``: set when its client went away."""
        return await asyncio.wrap_future(self.submit(Job(group, items, cost, fn, cancelled=cancelled)))

    def call_cancelled(self) -> bool:
        """Whether every job of the model call running now was cancelled by its client (then the call may stop:
        a search asks this once per decoding step, :attr:`aiayn.search.SearchSpec.stop`). Worker thread only."""
        jobs = self._current
        return bool(jobs) and all(j.cancelled is not None and j.cancelled.is_set() for j in jobs)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """While inside, the worker takes no new job (one it runs already finishes); on leaving, it takes the
        queued ones as usual. For tests: hold, submit N jobs of a group, release, and they share one call."""
        with self._cond:
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def wait_queued(self, n: int, timeout: float = 60.0) -> bool:
        """Block until at least ``n`` jobs wait in the queue (not counting running ones); False after ``timeout``
        seconds without that."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._pending) >= n, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Take no new job, finish the queued ones, stop the worker (waits up to ``timeout`` seconds)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # The worker thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._pending or self._held) and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return  # closing, and nothing left to do
                jobs = self._take()
                self._running = len(jobs)
            try:
                if jobs:
                    self._run(jobs)
            finally:
                with self._cond:
                    self._running = 0

    def _take(self) -> list[Job]:
        """The oldest job and those of its group that fit the budget, waiting for more until its deadline
        (called with the lock held; waiting releases it). Cancelled jobs are dropped."""
        first = self._pending[0]
        chosen = [first]
        calls, answered = self._last_call
        alone = calls == 1 and len(self._pending) == 1 and first.arrived >= answered
        if first.group is not None and not alone:
            # From the later of the job's arrival and the last call's answer: the clients that call answered send their
            # next requests within the wait and join this call, instead of taking turns at the model with the clients
            # queued meanwhile (two cohorts in half-size calls, each waiting for the other's)
            deadline = max(first.arrived, answered) + self.max_wait
            while True:
                chosen, cost, full = [], 0, False
                for job in self._pending:
                    if job.group != first.group:
                        continue
                    if chosen and cost + job.cost > self.max_batch_tokens:
                        full = True
                        break
                    chosen.append(job)
                    cost += job.cost
                left = deadline - time.monotonic()
                back = calls > 1 and len(chosen) >= calls  # as many jobs as the last call had: its clients are back
                if full or cost >= self.max_batch_tokens or left <= 0 or back or self._closing:
                    break
                self._cond.wait(left)
        for job in chosen:
            self._pending.remove(job)
        # A client that went away cancelled its future: do not spend the model on it.
        return [job for job in chosen if job.future.set_running_or_notify_cancel()]

    def _run(self, jobs: list[Job]) -> None:
        items = [x for job in jobs for x in job.items]
        if not jobs[0].setup:
            self.stats.jobs += len(jobs)
            self.stats.calls += 1
            self.stats.items += len(items)
            self.stats.largest_call = max(self.stats.largest_call, len(jobs))
        self._current = jobs
        try:
            results = jobs[0].run(items)
            if len(results) != len(items):
                raise RuntimeError(f"batch function returned {len(results)} results for {len(items)} items")
        except Exception as e:  # the model failed: every request of the call gets the error, the worker goes on
            if not isinstance(e, UserError) and not self.call_cancelled():  # stopped for clients gone: no failure
                log.exception("model call failed (%d requests, %d items)", len(jobs), len(items))
            for job in jobs:
                job.future.set_exception(e)
            return
        finally:
            self._current = []
        self._last_call = (len(jobs), time.monotonic())  # before the results: a reply's next request comes after
        start = 0
        for job in jobs:
            job.future.set_result(results[start : start + len(job.items)])
            start += len(job.items)
