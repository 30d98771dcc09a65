"""Batches for the training step through PyTorch's ``DataLoader``: worker processes read and collate the planned
updates ahead of the step.

The plan (:class:`aiayn.train.plan.EpochPlanner`) decides which batches each update trains on; this module only
builds them. An :class:`UpdateSampler` yields this process's planned updates of an epoch from a position (the
resume point), a worker turns one update (its micro-batches' index arrays) into its :class:`Batch` objects with
the data's ``collate_plan``, and the loader hands them over in the sampler's order. Order and content are those of
collating in the loop, whatever the number of workers: a worker touches no random state, so a resumed run sees
the same batches bit for bit. The workers persist across epochs (the sampler is re-pointed at the next epoch's
updates), copy batches into page-locked memory for a GPU (``pin_memory``), and get the training data by
``fork`` where the platform has it (no copy), else by pickle (the data pickles as its files' names).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from aiayn.data.batching import Batch

log = logging.getLogger("aiayn.data")

PREFETCH_UPDATES = 2  # updates each worker builds ahead of the step
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


class UpdateSampler(Sampler):
    """This process's planned updates of the current epoch, from ``start`` on (set by :meth:`point`)."""

    def __init__(self) -> None:
        self.updates: Sequence[Any] = ()
        self.start = 0

    def point(self, updates: Sequence[Any], start: int) -> None:
        """Yield ``updates[start:]`` from the next ``iter``."""
        self.updates, self.start = updates, start

    def __iter__(self) -> Iterator[Any]:
        return iter(self.updates[self.start :])

    def __len__(self) -> int:
        return max(0, len(self.updates) - self.start)


class UpdateBatches(Dataset):
    """One planned update (the plan items of its micro-batches) -> its batches, collated by ``data``."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __getitem__(self, update: Sequence[Any]) -> list[Batch]:
        return [self.data.collate_plan(item) for item in update]

    def __len__(self) -> int:  # pragma: no cover - the sampler decides what is read, not a length
        raise TypeError("UpdateBatches is indexed by planned updates, not by position")


def _as_is(batches: list[Batch]) -> list[Batch]:
    return batches


def _worker_init(worker_id: int, parent: int) -> None:
    """In each worker, first: die with the training process, and let go of its locks."""
    # A training killed with -9 cannot stop its workers, and a worker blocked on its result pipe never notices its
    # parent is gone: it would live on, holding the training's stderr, sockets and locks (a torchrun restart then
    # waits on them). Linux kills it with its parent; the check covers a parent that died before the request.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
    # A forked worker shares the training's lock descriptors (its run directory's, a store's): closed here, so that
    # a killed training's lock ends with it.
    from aiayn.files import close_inherited_locks

    close_inherited_locks()


class UpdateLoader:
    """The batches of each epoch's updates, built by ``workers`` processes (0: in this process, when asked)
    ``PREFETCH_UPDATES`` updates ahead each. Use it as a context manager: leaving stops the workers."""

    def __init__(self, data: Any, workers: int, pin_memory: bool = False) -> None:
        self.sampler = UpdateSampler()
        self.workers = workers
        extra = {"prefetch_factor": PREFETCH_UPDATES, "persistent_workers": True} if workers > 0 else {}
        self._loader: DataLoader | None = DataLoader(
            UpdateBatches(data), sampler=self.sampler, batch_size=None, collate_fn=_as_is, num_workers=workers,
            worker_init_fn=functools.partial(_worker_init, parent=os.getpid()) if workers > 0 else None,
            pin_memory=pin_memory, generator=torch.Generator().manual_seed(0), **extra)  # its own: the workers'
        # seeds are drawn from it, never from the global generator the training seeds its weights with
        self._iter: Iterator[list[Batch]] | None = None

    def epoch(self, updates: Sequence[Any], start: int) -> Iterator[list[Batch]]:
        """The batches of ``updates[start:]``, in order (one list of micro-batches per update)."""
        if self._loader is None:
            raise RuntimeError("UpdateLoader: used after close()")
        self.sampler.point(updates, start)
        self._iter = iter(self._loader)  # persistent workers: re-pointed, not restarted
        return self._iter

    def close(self) -> None:
        """Stop the workers (whatever they built ahead) and wait for them."""
        it, self._iter, self._loader = self._iter, None, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> UpdateLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def loader_workers(requested: int | None, device: torch.device, threads: int, local_world: int) -> int:
    """Worker processes of each training process: ``data.loader_workers`` when set, else the cores the training
    leaves free on this machine (``usable cores - local processes x their compute threads``, a CUDA process
    counting one), at least 1 and at most 4. At least one even on a full machine: collating is a small part of a
    step, and in a worker it overlaps the step instead of adding to it."""
    if requested is not None:
        return requested
    from aiayn.engine import usable_cores

    per_process = threads if device.type == "cpu" else 1
    return max(1, min(4, usable_cores() - local_world * per_process))
