"""Batches built ahead of the training step, in a background thread.

The training loop asks for one update at a time; a :class:`Prefetcher` collates the next few updates' batches
(and, for a GPU, copies them into page-locked memory) while the step runs, so the step does not wait for Python
to pad id lists. Order and content are exactly those of collating in the loop: the thread touches no random
state, so a resumed run sees the same batches bit for bit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_DONE = object()


class Prefetcher(Generic[T, R]):
    """``build(items[i])`` for i = start, start + 1, ..., computed up to ``depth`` items ahead in a daemon thread;
    iterate it (or call :meth:`next`). An exception in ``build`` is raised by the :meth:`next` that would have
    returned that item. Use it as a context manager: leaving stops the thread, whatever was built ahead."""

    def __init__(self, items: Sequence[T], build: Callable[[T], R], start: int = 0, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"Prefetcher: depth must be >= 1, got {depth}")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(items, build, start), daemon=True,
                                        name="aiayn-prefetch")
        self._thread.start()

    def _put(self, value: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, items: Sequence[T], build: Callable[[T], R], start: int) -> None:
        for i in range(start, len(items)):
            try:
                value: Any = (True, build(items[i]))
            except BaseException as e:  # handed to the consumer, which raises it where it would have failed
                self._put((False, e))
                return
            if not self._put(value):
                return
        self._put((True, _DONE))

    def next(self) -> R:
        ok, value = self._queue.get()
        if not ok:
            raise value
        if value is _DONE:
            raise StopIteration
        return value

    def __iter__(self) -> Prefetcher[T, R]:
        return self

    def __next__(self) -> R:
        return self.next()

    def close(self) -> None:
        """Stop building ahead and wait for the thread (it finishes the item it is on)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
