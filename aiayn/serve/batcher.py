"""Dynamic batching: requests that arrive close together share one model call, on the batcher's worker threads.

The event loop only enqueues a :class:`Job` and awaits its future; the model runs on the batcher's worker
threads, so a long decode never blocks the loop (health checks, new requests and the page stay responsive). A call's
answers reach the loop in one callback, and a worker choosing a call is woken when its call may be complete, not at
each request: every wake takes the interpreter from the thread that is answering or reading requests.
``workers`` model calls run side by side (each worker a thread with its own CPU threads, :meth:`Batcher.setup`).
Two calls on one thread each once outran one call on two threads under many clients (a step's threads waited for
each other, and a thread whose core was busy held the step); since the native search splits a call's sentences into a
group per thread, one call does as well (BENCHMARKS.md, section 4e), and one worker is the default. One worker at a
time chooses the jobs of its call, so no job runs twice; the lowest idle worker takes the next call, and a call
leaves the idle workers their share of the waiting jobs; only the worker that is to act is woken.

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


@dataclass(eq=False, kw_only=True)
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
    # Batcher.run's: the event loop's own future, given its outcome by one callback per call (see _answer)
    waiter: asyncio.Future | None = None


@dataclass
class Stats:
    """Counters for /health and the tests: jobs taken, model calls made, items run, largest call, seconds in calls."""

    jobs: int = 0
    calls: int = 0
    items: int = 0
    largest_call: int = 0  # jobs merged into one call, at most
    cancelled: int = 0  # streamed answers stopped because their client went away (aiayn.serve.streams)
    busy_s: float = 0.0  # seconds the workers spent in model calls (summed over workers; setup calls not counted)


MAX_WAIT_MS = 60_000.0  # a request waits at most a minute for others to share its model call
MAX_WORKERS = 64


def check_batching(max_batch_tokens: int | None, max_wait_ms: float, max_queue: int, workers: int = 1) -> None:
    """The batcher's settings, as ``aiayn serve`` flags: a one-line ConfigError for one out of range (a wait that
    is NaN would make every request wait forever, an infinite one would stop the model's thread)."""
    if not (math.isfinite(max_wait_ms) and 0 <= max_wait_ms <= MAX_WAIT_MS):
        raise ConfigError(f"--max-wait-ms {max_wait_ms}: expected a number of milliseconds in [0, {MAX_WAIT_MS:g}]")
    if max_batch_tokens is not None and not 1 <= max_batch_tokens <= 2**31:
        raise ConfigError(f"--max-batch-tokens {max_batch_tokens}: expected 1-{2**31}")
    if not 1 <= max_queue <= 1_000_000:
        raise ConfigError(f"--max-queue {max_queue}: expected 1-1000000")
    if not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(f"--workers {workers}: expected 1-{MAX_WORKERS}")


@dataclass(frozen=True)
class Batching:
    """How a server batches its model calls (``aiayn serve``'s flags): ``max_batch_tokens`` (None: the device's
    decoding budget), ``max_wait_ms``, ``max_queue``, ``workers`` (model calls side by side); checked when built."""

    max_batch_tokens: int | None = None
    max_wait_ms: float = 10.0
    max_queue: int = 256
    workers: int = 1

    def __post_init__(self) -> None:
        check_batching(self.max_batch_tokens, self.max_wait_ms, self.max_queue, self.workers)

    def batcher(self, budget: int) -> Batcher:
        """The batcher, merging up to ``budget`` source tokens x beam a call."""
        return Batcher(budget, self.max_wait_ms, self.max_queue, self.workers)


def _settle(jobs: list[Job]) -> None:
    """On the event loop: each job's waiter gets its future's outcome (one whose task was cancelled: nothing)."""
    for job in jobs:
        waiter = job.waiter
        if waiter is None or waiter.done():
            continue
        if job.future.cancelled():
            waiter.cancel()
        elif (error := job.future.exception()) is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(job.future.result())


class Batcher:
    """``workers`` threads that run queued jobs, merging those of a group (see the module docstring)."""

    def __init__(self, max_batch_tokens: int = 4096, max_wait_ms: float = 10.0, max_queue: int = 256,
                 workers: int = 1) -> None:
        check_batching(max_batch_tokens, max_wait_ms, max_queue, workers)
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.stats = Stats()
        self._pending: collections.deque[Job] = collections.deque()
        self._pending_cost = 0  # the summed cost of the queued jobs (all groups)
        self._wake_at = 1  # queued jobs at which a submit wakes the worker choosing a call (_take sets it, then waits)
        self._local = threading.local()  # .current: the jobs of the model call its worker runs now
        self._running = 0  # jobs in the model calls running now
        self._calls_running = 0
        self._leftover = False  # the last call left jobs for an idle worker: the next call takes them without waiting
        self._idle = [False] * workers  # the workers waiting for a job
        self._held = False
        self._forming: int | None = None  # the worker choosing its call's jobs (the others would choose the same)
        self._setups: list[collections.deque[Job]] = [collections.deque() for _ in range(workers)]
        # (jobs, time its results were given) of the last model call: a job alone in the queue that came after the
        # results of a one-job call is one client sending one request at a time, and no company is coming for it
        self._last_call = (0, 0.0)
        self._closing = False
        self._cond = threading.Condition()  # its lock guards the state; waiters outside the workers wait on it
        # each worker waits on its own condition, and only the one that is to act is woken: a worker woken for nothing
        # takes a core from the running call's threads, which then wait for each other
        self._wakes = [threading.Condition(self._cond._lock) for _ in range(workers)]  # type: ignore[attr-defined]
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"aiayn-serve-model-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    @property
    def workers(self) -> int:
        """Model calls that run side by side."""
        return len(self._threads)

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
            self._pending_cost += job.cost
            if self._forming is None:
                self._wake_one()
            elif len(self._pending) >= self._wake_at or self._pending_cost >= self.max_batch_tokens:
                # the worker choosing a call is woken only when its call may be complete: each wake takes the
                # interpreter from the event loop that is reading the next requests
                self._wakes[self._forming].notify()
            self._cond.notify_all()
        return job.future

    def setup(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(worker)`` on every worker thread (0, 1, ...), before the jobs it takes next, and wait for them
        (the first exception is raised here): what belongs to a thread that runs the model (its CPU threads, a
        warm-up)."""
        jobs = [Job(group=None, items=[None], cost=0, run=lambda _, i=i: [fn(i)], setup=True)
                for i in range(self.workers)]
        with self._cond:
            for queue, job in zip(self._setups, jobs):
                queue.append(job)
            self._wake_all()
        for job in jobs:
            job.future.result()

    async def run(self, group: Hashable | None, items: Sequence[Any], cost: int,
                  fn: Callable[[list[Any]], list[Any]], cancelled: threading.Event | None = None) -> list[Any]:
        """Queue a job and await its results (on the event loop); ``cancelled``: set when its client went away.
        Cancelling the awaiting task cancels the job if it has not started."""
        waiter = asyncio.get_running_loop().create_future()
        job = Job(group=group, items=items, cost=cost, run=fn, cancelled=cancelled, waiter=waiter)
        waiter.add_done_callback(lambda w: job.future.cancel() if w.cancelled() else None)
        self.submit(job)
        return await waiter

    def call_cancelled(self) -> bool:
        """Whether every job of the model call this worker runs now was cancelled by its client (then the call may
        stop: a search asks this once per decoding step, :attr:`aiayn.search.SearchSpec.stop`). Worker threads
        only."""
        jobs = getattr(self._local, "current", [])
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
                self._wake_all()

    def wait_queued(self, n: int, timeout: float = 60.0) -> bool:
        """Block until at least ``n`` jobs wait in the queue (not counting running ones); False after ``timeout``
        seconds without that."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._pending) >= n, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Take no new job, finish the queued ones, stop the workers (waits up to ``timeout`` seconds)."""
        with self._cond:
            self._closing = True
            self._wake_all()
        end = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))

    # The worker thread ----------------------------------------------------------------------------------

    def _loop(self, worker: int) -> None:
        setups = self._setups[worker]
        while True:
            with self._cond:
                while True:
                    if setups:
                        jobs = [setups.popleft()]
                        break
                    # the lowest idle worker takes the next call: a call alone runs on the same thread team each
                    # time (another team's threads, spinning after their last call, would share the cores with it)
                    first_idle = not any(self._idle[:worker]) or self._leftover or self._closing
                    self._idle[worker] = True
                    if (self._pending and (not self._held or self._closing) and self._forming is None
                            and first_idle):
                        self._idle[worker] = False
                        self._forming = worker
                        try:
                            jobs = self._take()
                        finally:
                            self._forming = None
                            if self._pending:
                                self._wake_one()  # its leftover share, or another group's jobs
                        break
                    if self._closing and not self._pending:
                        self._idle[worker] = False
                        self._wake_all()
                        return  # nothing left to do
                    self._wakes[worker].wait()
                self._running += len(jobs)
                self._calls_running += 1
            try:
                if jobs:
                    self._run(jobs)
            finally:
                with self._cond:
                    self._running -= len(jobs)
                    self._calls_running -= 1

    def _wake_one(self) -> None:
        """Wake the worker that acts on a new job: the one choosing a call (it may join it), else the lowest idle one
        (lock held)."""
        if self._forming is not None:
            self._wakes[self._forming].notify()
            return
        for worker, idle in enumerate(self._idle):
            if idle:
                self._wakes[worker].notify()
                return

    def _wake_all(self) -> None:
        for wake in self._wakes:
            wake.notify()
        self._cond.notify_all()

    def _take(self) -> list[Job]:
        """The oldest job and those of its group that fit the budget, waiting for more until its deadline
        (called with the lock held; waiting releases it), shared out with the workers that are idle. Cancelled jobs
        are dropped."""
        first = self._pending[0]
        chosen = [first]
        calls, answered = self._last_call
        alone = calls == 1 and len(self._pending) == 1 and first.arrived >= answered
        leftover, self._leftover = self._leftover, False  # jobs an idle worker was left: they have waited already
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
                if full or cost >= self.max_batch_tokens or left <= 0 or back or leftover or self._closing:
                    break
                # woken by a submit once as many jobs wait as the last call ran (or the budget's worth), by close or
                # hold, or at the deadline (counting every group's jobs: a wake too early only looks again)
                self._wake_at = calls if calls > 1 else self.max_queue + 1
                self._wakes[self._forming].wait(left)
            # Workers with nothing to run take their share: calls side by side, each on its share of the CPU threads,
            # outran one call of them all on all of them (the step's threads wait for each other)
            idle = self.workers - self._calls_running
            if idle > 1 and len(chosen) > 1:
                keep = math.ceil(len(chosen) / idle)
                self._leftover = keep < len(chosen)
                chosen = chosen[:keep]
        for job in chosen:
            self._pending.remove(job)
            self._pending_cost -= job.cost
        # A client that went away cancelled its future: do not spend the model on it.
        return [job for job in chosen if job.future.set_running_or_notify_cancel()]

    def _run(self, jobs: list[Job]) -> None:
        items = [x for job in jobs for x in job.items]
        if not jobs[0].setup:
            with self._cond:
                self.stats.jobs += len(jobs)
                self.stats.calls += 1
                self.stats.items += len(items)
                self.stats.largest_call = max(self.stats.largest_call, len(jobs))
        self._local.current = jobs
        started = time.monotonic()
        try:
            results = jobs[0].run(items)
            if len(results) != len(items):
                raise RuntimeError(f"batch function returned {len(results)} results for {len(items)} items")
        except Exception as e:  # the model failed: every request of the call gets the error, the worker goes on
            if not isinstance(e, UserError) and not self.call_cancelled():  # stopped for clients gone: no failure
                log.exception("model call failed (%d requests, %d items)", len(jobs), len(items))
            for job in jobs:
                job.future.set_exception(e)
            self._answer(jobs)
            return
        finally:
            self._local.current = []
            if not jobs[0].setup:
                with self._cond:
                    self.stats.busy_s += time.monotonic() - started
        with self._cond:
            self._last_call = (len(jobs), time.monotonic())  # before the results: a reply's next request comes after
        start = 0
        for job in jobs:
            job.future.set_result(results[start : start + len(job.items)])
            start += len(job.items)
        self._answer(jobs)

    @staticmethod
    def _answer(jobs: list[Job]) -> None:
        """Give the event loop futures of ``jobs`` (done ones) their outcome, in one callback per loop: a callback
        per job woke the loop once per job, and each wake took the interpreter back and forth between this thread
        and the loop, which was answering the first of them."""
        loops: dict[asyncio.AbstractEventLoop, list[Job]] = {}
        for job in jobs:
            if job.waiter is not None:
                loops.setdefault(job.waiter.get_loop(), []).append(job)
        for loop, waiting in loops.items():
            with contextlib.suppress(RuntimeError):  # the loop was closed: nobody awaits them
                loop.call_soon_threadsafe(_settle, waiting)
