"""Which batches each update trains on: an epoch's plan (a function of the seed and the epoch, the same in every
process), dealt to the processes and grouped into updates, planned one epoch ahead; DataLoader workers collate them
ahead of the step (:mod:`aiayn.data.loader`).

Update ``i`` of an epoch takes the plan's batches ``i*m ... i*m + m - 1``, ``m = processes x accumulation steps``:
its micro-batch ``slot`` (``step x processes + rank``) is batch ``i*m + slot``. The updates depend on ``m`` only,
so 2 processes x 1 step and 1 process x 2 steps train on the same batches, and a resume may change one for the
other (:func:`aiayn.train.resume.resume_config`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any, Protocol

from aiayn.data.batching import Batch
from aiayn.train.parallel import Dist


class TrainData(Protocol):
    """What the loop needs from a task's data: a deterministic plan of each epoch's batches (cheap: no tensors),
    the target tokens of a planned batch, the batch itself on demand, and the validation batches."""

    def epoch_plan(self, epoch: int) -> Sequence[Any]: ...

    def plan_tokens(self, item: Any) -> int: ...

    def collate_plan(self, item: Any) -> Batch: ...

    @property
    def valid_batches(self) -> list[Batch]: ...


def micro_batches(world: int, accum_steps: int) -> int:
    """``m``, the micro-batches of one update: processes x accumulation steps. The batches an update trains on
    depend on this product only, so every resume keeps it (:func:`aiayn.train.resume.resume_config`)."""
    return world * accum_steps


def update_token_totals(tokens: Sequence[int], accum_steps: int, world: int) -> list[int]:
    """Target tokens of each update of an epoch summed over all processes, from the target tokens of each
    planned batch. Batches are dealt round-robin (process r takes r, r + world, ...), so every process can
    count what the others hold instead of all-reducing the count before every update."""
    n_updates = len(tokens) // micro_batches(world, accum_steps)
    k = accum_steps
    ranks = [tokens[r::world][: n_updates * k] for r in range(world)]
    return [sum(n for mine in ranks for n in mine[i * k : (i + 1) * k]) for i in range(n_updates)]


class EpochPlanner:
    """This process's updates, epoch by epoch. Use it as a context manager: inside, the next epoch is planned in
    a background thread while the current one trains (:meth:`plan_ahead`)."""

    def __init__(self, data: TrainData, accum_steps: int, dist: Dist) -> None:
        self.data, self.accum_steps, self.dist = data, accum_steps, dist
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ahead: dict[int, concurrent.futures.Future] = {}

    def __enter__(self) -> EpochPlanner:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "aiayn-plan")
        return self

    def __exit__(self, *exc: object) -> None:
        for ahead in self._ahead.values():
            ahead.cancel()
        self._ahead = {}
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None

    def updates(self, epoch: int) -> tuple[list[list[Any]], list[int]]:
        """This process's updates of ``epoch`` (each a list of ``accum_steps`` planned batches, collated when
        trained on by the loader) and the target tokens of each update over all processes. Every process gets
        the same number of updates; a remainder of the plan is left for the next epoch's shuffle."""
        ahead = self._ahead.pop(epoch, None)
        plan, tokens = ahead.result() if ahead is not None else self._plan(epoch)
        k, w = self.accum_steps, self.dist.world
        n_updates = len(plan) // micro_batches(w, k)
        mine = plan[self.dist.rank :: w][: n_updates * k]
        return [mine[i * k : (i + 1) * k] for i in range(n_updates)], update_token_totals(tokens, k, w)

    def plan_ahead(self, epoch: int) -> None:
        """Plan ``epoch`` in the background while the current one trains, so that it starts without a pause.
        Called after the current epoch's first update: planning holds the interpreter for seconds on a large
        corpus (its seeded shuffle is Python's), and the first update would otherwise wait for it too."""
        if self._pool is not None and epoch not in self._ahead:
            self._ahead = {epoch: self._pool.submit(self._plan, epoch)}

    def _plan(self, epoch: int) -> tuple[Sequence[Any], list[int]]:
        """An epoch's plan and the target tokens of each planned batch."""
        plan = self.data.epoch_plan(epoch)
        return plan, [self.data.plan_tokens(p) for p in plan]
