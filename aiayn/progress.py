"""Progress over a known number of items, on stderr: a bar on a terminal; anywhere else (a log file, a pipe) a
plain line at most every :data:`LINE_EVERY_S` seconds and at the end, never the carriage returns a bar draws with."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("aiayn")

LINE_EVERY_S = 30.0  # off a terminal, at most one progress line this often


class ItemProgress:
    """``update(n)`` after each n items done; ``close()`` at the end (a last line with the rate). ``total`` None:
    a stream of unknown length (the count and the rate, no ETA)."""

    def __init__(self, total: int | None, unit: str, what: str, show: bool = True) -> None:
        self.total, self.unit, self.what = total, unit, what
        self.done, self.t0 = 0, time.perf_counter()
        self.last = self.t0
        self.show = show and (total is None or total > 0)
        self.bar = None
        if self.show and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit=unit, desc=what, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.show and now - self.last >= LINE_EVERY_S and (self.total is None or self.done < self.total):
            self.last = now
            rate = self.done / (now - self.t0)
            if self.total is None:
                log.info("%s: %s %ss (%.1f/s)", self.what, f"{self.done:,}", self.unit, rate)
            else:
                log.info("%s: %s/%s %ss (%.1f/s, about %.0f s left)", self.what, f"{self.done:,}",
                         f"{self.total:,}", self.unit, rate, (self.total - self.done) / max(rate, 1e-9))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.show:
            took = time.perf_counter() - self.t0
            log.info("%s: %s %ss in %.0f s (%.1f/s)", self.what, f"{self.done:,}", self.unit, took,
                     self.done / max(took, 1e-9))
