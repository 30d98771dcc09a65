"""A plan of trainings run to the end: each job trained (or resumed, or skipped when done) and then finished
(evaluated, its result written) by a callback, in one process or in several that share the machine.

What ``aiayn table3`` and ``aiayn sweep`` share. A job is done when its result file exists: the callback writes
it last, atomically, so a killed runner leaves either a result or none. A job not done is trained into its run
directory: new, resumed from its newest checkpoint, or, when its training had ended but its inference weights
were not written yet (killed at the very end), only finished. A rerun of the same plan therefore goes on where
the last one stopped and never trains a finished run again.

``parallel`` > 1 starts that many worker processes (``spawn``: safe with CUDA), each going through the whole
plan and taking the jobs no other worker has claimed (an exclusive lock per job in ``claims``): several runs
share one GPU, whose small models leave most of it idle when trained one at a time. A worker dies with the
runner (Linux: the parent-death signal), so a killed runner leaves no training behind; a job that fails is
reported and the others go on; the first failure is raised once every job has had its turn.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiayn.config import Config
from aiayn.errors import Interrupted, user_error_message
from aiayn.files import claim, lock_holder

log = logging.getLogger("aiayn.runner")


@dataclass(frozen=True)
class Job:
    """One training of a plan: its ``name`` (e.g. ``base-seed1``), config and run directory, and the file whose
    presence says it is done (trained and finished)."""

    name: str
    cfg: Config
    run_dir: Path
    done: Path


@dataclass(frozen=True)
class Trained:
    """What a job's training reached: its updates and seconds of training (counted from its first start)."""

    step: int
    elapsed_s: float


Finish = Callable[[Job, Trained], None]


def settings_of(cfg: Config, leave_out: Sequence[str]) -> dict[str, Any]:
    """``cfg`` as ``{"section.key": value}`` (JSON values) without the keys ``leave_out``: what a plan's results
    were made with, compared when a plan is run again."""
    from aiayn.run.ownership import flatten

    return json.loads(json.dumps({k: v for k, v in flatten(cfg.to_dict()).items() if k not in leave_out}))


def share_cpu(cfg: Config, parallel: int) -> Config:
    """``cfg`` with ``train.threads`` set to this process's share of the cores when ``parallel`` trainings run
    side by side on the CPU (unless the config sets it): two processes of two threads each on two cores run
    slower than one after the other."""
    from aiayn.device import resolve_device

    if parallel <= 1 or cfg.train.threads is not None or resolve_device(cfg.train.device).type != "cpu":
        return cfg
    threads = max(1, (os.cpu_count() or 1) // parallel)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=threads))


def default_parallel(cfg: Config, jobs: int) -> int:
    """How many trainings share the device when the user does not say: 3 on a GPU (measured: three Multi30k runs
    kept one H200 busy, docs/results.md), at most the jobs; one at a time on a CPU, whose cores one training
    already uses."""
    from aiayn.device import resolve_device

    return max(1, min(jobs, 3)) if resolve_device(cfg.train.device).type == "cuda" else 1


def _finished_state(run_dir: Path) -> Trained | None:
    """The updates and training time of a run whose training ended (its inference weights are written), from its
    newest checkpoint; None for a run still to train."""
    from aiayn.run.weights import FINAL_WEIGHTS
    from aiayn.train.resume import CheckpointMeta

    meta = CheckpointMeta.newest(run_dir) if (run_dir / FINAL_WEIGHTS).is_file() else None
    return Trained(meta.step, float(meta.state.elapsed_s)) if meta is not None else None


def _ended_without_weights(cfg: Config, run_dir: Path) -> Config | None:
    """For a run killed after its training ended (its time or updates spent) but before it wrote its inference
    weights: the config that resumes it to write them and train no further (``max_updates`` = its step; a resume
    whose minutes are spent is refused otherwise). None when the run has training left."""
    from aiayn.train.resume import CheckpointMeta

    meta = CheckpointMeta.newest(run_dir)
    if meta is None:
        return None
    elapsed, tc = meta.state.elapsed_s, cfg.train
    if meta.step < tc.max_updates and (tc.max_minutes is None or elapsed < tc.max_minutes * 60):
        return None
    return dataclasses.replace(cfg, train=dataclasses.replace(tc, max_updates=meta.step))


def train_job(job: Job, progress: bool = False) -> Trained | None:
    """Train ``job`` to its end (new, resumed, or only finished; see the module docstring); None when another
    process (a user's ``aiayn train``) holds its run directory."""
    from aiayn.train.run import train

    done = _finished_state(job.run_dir)
    if done is not None:
        log.info("%s: trained already (%d updates)", job.name, done.step)
        return done
    holder = lock_holder(job.run_dir)
    if holder is not None:
        log.info("%s: process %s trains it; left to it", job.name, holder)
        return None
    cfg, resume = job.cfg, job.run_dir.is_dir() and any(job.run_dir.iterdir())
    if resume:
        cfg = _ended_without_weights(cfg, job.run_dir) or cfg
        log.info("%s: resumed", job.name)
    state = train(cfg, job.run_dir, resume=resume, progress=progress)
    return Trained(state.step, state.elapsed_s)


def _do_jobs(jobs: Sequence[Job], finish: Finish, claims: Path, progress: bool) -> list[BaseException]:
    """Every job of the plan that no other worker has claimed and that is not done: trained and finished. A job
    that fails is logged and the others go on; returns the failures."""
    failures: list[BaseException] = []
    for i, job in enumerate(jobs, 1):
        if job.done.exists():
            log.info("%d/%d %s: done already (%s)", i, len(jobs), job.name, job.done)
            continue
        claims.mkdir(parents=True, exist_ok=True)  # only now: a plan with nothing to do writes nothing
        with claim(claims / f"{job.name}.lock") as mine:
            if not mine:
                log.info("%d/%d %s: another worker has it", i, len(jobs), job.name)
                continue
            if job.done.exists():  # finished by another worker between the check above and the claim
                continue
            log.info("%d/%d %s: %d updates at most%s", i, len(jobs), job.name, job.cfg.train.max_updates,
                     f", {job.cfg.train.max_minutes:g} minutes at most" if job.cfg.train.max_minutes else "")
            try:
                trained = train_job(job, progress)
                if trained is not None:
                    finish(job, trained)
            except Exception as e:  # noqa: BLE001 - reported below and raised by the runner at the end
                message = user_error_message(e)
                if message is None:
                    log.exception("%s failed (a bug in aiayn)", job.name)
                else:
                    log.error("%s failed: %s", job.name, message)
                failures.append(e)
    return failures


def run_jobs(jobs: Sequence[Job], finish: Finish, claims: Path, parallel: int = 1, progress: bool = False) -> None:
    """Run the plan (module docstring) in ``parallel`` processes; raises the first failure once all jobs have had
    their turn (:class:`~aiayn.errors.Interrupted` for a worker killed from outside)."""
    todo = [j for j in jobs if not j.done.exists()]
    if parallel <= 1 or len(todo) <= 1:
        failures = _do_jobs(jobs, finish, claims, progress)
    else:
        failures = _spawn(jobs, finish, claims, min(parallel, len(todo)))
    if failures:
        if len(failures) > 1:
            log.error("%d of %d jobs failed; the first is reported", len(failures), len(jobs))
        raise failures[0]


def _spawn(jobs: Sequence[Job], finish: Finish, claims: Path, n: int) -> list[BaseException]:
    """``n`` worker processes through the plan; their failures, as the workers raised them where they can be sent
    back, else as one line each."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
    results = ctx.SimpleQueue()
    level = logging.getLogger().getEffectiveLevel()
    procs = [ctx.Process(target=_worker, name=f"aiayn-worker-{i}", daemon=False,
                         args=(list(jobs), finish, claims, i, os.getpid(), level, results)) for i in range(1, n + 1)]
    log.info("%d processes share the %d jobs", n, len(jobs))
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    except BaseException:  # Ctrl-C or an error here: no worker outlives the runner
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        raise
    failures: list[BaseException] = []
    while not results.empty():
        failures.extend(results.get())
    for i, p in enumerate(procs, 1):
        if p.exitcode and p.exitcode < 0:
            name = signal.Signals(-p.exitcode).name
            failures.append(Interrupted(f"worker {i} was stopped by {name}: its run resumes from its newest "
                                        "checkpoint when the same command runs again"))
        elif p.exitcode:
            failures.append(RuntimeError(f"worker {i} ended with exit status {p.exitcode} (its log above)"))
    return failures


def _sendable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (to cross to the runner), else an exception of the same kind and line."""
    try:
        return pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - any exception that does not round-trip is replaced
        message = user_error_message(e)
        return Interrupted(message) if message is not None else RuntimeError(f"{type(e).__name__}: {e}")


def _worker(jobs: list[Job], finish: Finish, claims: Path, index: int, parent: int, level: int, results) -> None:
    """A worker process: its log lines say which worker it is; it ends when the runner does."""
    from aiayn.engine import set_cpu_threads

    _die_with_parent(parent)
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s worker {index} %(levelname)s %(name)s: %(message)s")
    # The process's share of the cores (share_cpu) holds for its evaluations too, not only inside train():
    # PyTorch's default (every core) in each of several processes makes their threads spin against each other.
    set_cpu_threads(jobs[0].cfg.train.threads if jobs else None)
    try:
        failures = _do_jobs(jobs, finish, claims, progress=False)
    except KeyboardInterrupt:
        sys.exit(130)
    results.put([_sendable(e) for e in failures])


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to end this process when the runner ends (Linux's PR_SET_PDEATHSIG); elsewhere a killed
    runner's workers finish their current job and stop."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the runner died before the request took effect
        os._exit(1)
