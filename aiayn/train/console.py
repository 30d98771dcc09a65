"""What a training run tells the person running it, on stderr (:class:`Console`; progress over items of other
commands is :mod:`aiayn.progress`).

On a terminal a progress bar; anywhere else (a log file, a pipe, ``--no-progress``) a plain line at every
``train.log_every`` update, never carriage returns. Both count to the limit that ends the run first: after the
first updates the run's speed says how many updates ``train.max_minutes`` leaves room for, and the bar's
total and ETA follow that, not ``train.max_updates`` alone.

Once the speed is known (:data:`MEASURE_UPDATES` updates and :data:`MEASURE_SECONDS` seconds after the start),
one line says what the run will reach: about how many updates, in how many minutes, and, when the recipe
records what its updates gave (``expect.bleu``, measured: docs/results.md), the validation BLEU that
many updates reached. A run that will end, or ended, before ``expect.useful_updates`` is told so in a warning,
with what to do about it.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from aiayn.config import ExpectConfig, TrainConfig

log = logging.getLogger("aiayn.train")

MEASURE_UPDATES = 10  # updates, and ...
MEASURE_SECONDS = 20.0  # ... seconds after the start before the speed is trusted for the projection


def expected_bleu(reference: Sequence[tuple[int, float]], updates: int) -> float | None:
    """The BLEU the recipe reached at ``updates``, interpolated linearly between its measured points
    ((updates, BLEU) pairs, increasing); None outside them but above the last (the last is returned: more
    updates did not hurt there) and below the first (unknown)."""
    points = sorted(reference)
    if not points or updates < points[0][0]:
        return None
    for (u0, b0), (u1, b1) in zip(points, points[1:]):
        if u0 <= updates <= u1:
            return b0 + (b1 - b0) * (updates - u0) / (u1 - u0)
    return points[-1][1]


def final_step(tc: TrainConfig, step: int, elapsed_s: float, rate: float) -> int:
    """The step the run will stop at: max_updates, or as many as ``rate`` (updates/s) fits in the minutes left."""
    if tc.max_minutes is None or rate <= 0:
        return tc.max_updates
    left = max(0.0, tc.max_minutes * 60 - elapsed_s)
    return min(tc.max_updates, step + int(rate * left))


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


class Console:
    """What the training run says on stderr: its progress, the projection, the warnings of an undertrained run
    (rank 0 only: ``show`` False on the others)."""

    def __init__(self, tc: TrainConfig, expect: ExpectConfig, step: int, elapsed_s: float, show: bool,
                 bar: bool) -> None:
        self.tc, self.expect, self.show = tc, expect, show
        self.start_step, self.start_s = step, elapsed_s
        self.projected = False
        self.forecast: int | None = None  # the run's last stop forecast a plain line showed (None: none yet)
        self.bar = None
        if show and bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=tc.max_updates, initial=step, unit="upd", dynamic_ncols=True, mininterval=1.0)

    def rate(self, step: int, elapsed_s: float) -> float:
        """Updates per second since this process started training."""
        return (step - self.start_step) / max(elapsed_s - self.start_s, 1e-9)

    def update(self, step: int, elapsed_s: float) -> None:
        """After every update: the bar, and once the speed is known, the projection."""
        if not self.show:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        if not self.projected and step - self.start_step >= MEASURE_UPDATES \
                and elapsed_s - self.start_s >= MEASURE_SECONDS:
            self.projected = True
            self.project(step, elapsed_s)
        if self.bar is not None and self.tc.max_minutes is not None and self.projected:
            self.bar.total = max(step, final_step(self.tc, step, elapsed_s, self.rate(step, elapsed_s)))

    def project(self, step: int, elapsed_s: float) -> dict[str, Any]:
        """One line: the speed, the step the run will stop at and when, and what that many updates gave."""
        tc, rate = self.tc, self.rate(step, elapsed_s)
        end = final_step(tc, step, elapsed_s, rate)
        limit = "train.max_updates" if end >= tc.max_updates else f"train.max_minutes={tc.max_minutes:g}"
        bleu, useful = expected_bleu(self.expect.bleu, end), self.expect.useful_updates
        gave = f"; this recipe's validation BLEU after {end:,} updates was about {bleu:.0f}" if bleu is not None else ""
        self.write(f"{rate:.2f} updates/s: this run will stop after about {end:,} updates ({limit}), in about "
                   f"{_minutes((end - step) / max(rate, 1e-9))}{gave}")
        if useful is not None and end < useful:
            # fewer threads help only a run on several (a busy machine's cores are shared)
            threads = "on a busy machine try --threads 1, " if torch.get_num_threads() > 1 else ""
            log.warning("at this speed the run ends after about %s updates, fewer than the %s this recipe needs to "
                        "be useful (docs/results.md): %sgive it more time (--set train.max_minutes=...), or train on "
                        "a GPU", f"{end:,}", f"{useful:,}", threads)
        return {"rate": rate, "final_step": end, "expected_bleu": bleu}

    def record(self, rec: dict[str, Any]) -> None:
        """A logged update (``train.log_every``): the bar's postfix, or a plain line."""
        if not self.show:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['train_loss']:.3f}", lr=f"{rec['lr']:.2e}",
                                 tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
            return
        tc, step, elapsed = self.tc, rec["step"], rec["elapsed_s"]
        end = final_step(tc, step, elapsed, self.rate(step, elapsed)) if step > self.start_step else tc.max_updates
        eta = (end - step) / max(self.rate(step, elapsed), 1e-9) if step > self.start_step else math.nan
        self.write(f"step {step:,}/{self.total(step, elapsed, end)} loss {rec['train_loss']:.3f} lr {rec['lr']:.2e} "
                   f"{rec['tokens_per_s']:,.0f} tokens/s, {_minutes(elapsed)} elapsed"
                   + (f", about {_minutes(eta)} left" if math.isfinite(eta) else ""))

    def total(self, step: int, elapsed_s: float, end: int) -> str:
        """The updates a plain line counts to: train.max_updates, or where the clock will stop the run, which is a
        forecast from the speed so far and said to be one, with the last forecast when it moved by a tenth or
        more (the first updates, slower, make early forecasts low)."""
        if end >= self.tc.max_updates:
            return f"{end:,}"
        was = self.forecast
        self.forecast = end
        moved = f"; was ~{was:,}" if was is not None and abs(end - was) >= 0.1 * was else ""
        return (f"~{end:,} (the forecast of train.max_minutes={self.tc.max_minutes:g} at "
                f"{self.rate(step, elapsed_s):.2f} updates/s so far{moved})")

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            log.info("%s", line)

    def close(self, step: int) -> None:
        """The end: close the bar; warn when the run stopped before it was useful."""
        if self.bar is not None:
            self.bar.close()
        useful = self.expect.useful_updates
        if self.show and useful is not None and step < useful:
            log.warning("this run stopped after %s updates, fewer than the %s this recipe needs to be useful: its "
                        "translations will be poor (resume it with more time: aiayn train --resume RUN --set "
                        "train.max_minutes=...)", f"{step:,}", f"{useful:,}")
