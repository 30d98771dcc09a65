"""Owning a run directory: every check before the first write, a marker, a lock, and no trace of a failed start.

``aiayn train`` writes into RUN only after it has checked that it may (:meth:`RunDirectory.open`):

- RUN is new or empty: it becomes a run. ``RUN/.aiayn-run.json`` (the marker: when, and from which
  config, as the config itself and its sha256) is the first file written.
- RUN holds anything else and ``--resume`` is not given: refused. A folder aiayn did not create (a user's
  ``config.yaml``, ...) is never written into; a run (even one killed before its first checkpoint) is
  only continued with ``--resume``.
- ``--resume``: the newest checkpoint is checked against its schema before any work; a run killed before
  its first checkpoint restarts only with the config its marker records (its tokenizer was trained for
  that config); weights without checkpoints (nothing to resume from) are refused, never overwritten.

``RUN/.aiayn-run.lock`` is held with an exclusive ``flock`` by the one process that writes the run (rank 0
of a torchrun job) for the whole training; a second ``aiayn train`` (or ``aiayn average``) into RUN is
refused. The lock dies with its process, so a killed run can be resumed at once. If the training fails
before its first update (bad data, bad config, Ctrl-C while the tokenizer trains), what this process
created is removed again: the directory itself if it made it, else the files it added.

It stands below the training code (inference never imports that, and this is part of the run package): what it needs
of a training is handed to it, the processes of the job (:class:`Processes`, :class:`aiayn.train.parallel.Dist`) and
the check of a checkpoint's state (``check_checkpoint``, :meth:`aiayn.train.resume.CheckpointMeta.read`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from aiayn.config import Config, load_yaml, migrate
from aiayn.data.pipeline import FITTED_KEYS
from aiayn.errors import CheckpointError, ConfigError, one_line
from aiayn.files import LOCK, MARKER, RunLock, atomic_write_json, check_writable, now, read_json
from aiayn.run.weights import checkpoint_dir, list_checkpoints

log = logging.getLogger("aiayn.train")

# data keys that decide what the tokenizer is: a resume must not silently reuse a tokenizer made for others.
TOKENIZER_KEYS = ("tokenizer", "vocab_size", "shared_vocab", "byte_fallback", "lowercase", "pretokenize")

# Reads checkpoint ``step`` of a run directory, raising a one-line CheckpointError when its state is not sound.
CheckpointCheck = Callable[[Path, int], object]


class Processes(Protocol):
    """The processes of a training job as ownership needs them (:class:`aiayn.train.parallel.Dist`)."""

    world: int

    @property
    def main(self) -> bool: ...

    def barrier(self) -> None: ...

    def gather_objects(self, obj: Any) -> list[Any]: ...

    def broadcast_flag(self, flag: bool, device: torch.device) -> bool: ...


def recipe(cfg: Config) -> dict[str, Any]:
    """The config as the user wrote it: :meth:`Config.to_dict` without the model keys fitted to the tokenizer."""
    d = cfg.to_dict()
    for key in FITTED_KEYS:
        d["model"].pop(key, None)
    return d


def config_hash(cfg: Config) -> str:
    """sha256 of :func:`recipe` (canonical JSON): equal for the same recipe before and after vocabulary fitting."""
    return recipe_hash(recipe(cfg))


def recipe_hash(values: dict[str, Any]) -> str:
    """sha256 of a recipe's canonical JSON."""
    text = json.dumps(values, sort_keys=True, ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as ``{"section.key": value}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(old: dict[str, Any], new: dict[str, Any], limit: int = 3) -> list[str]:
    """``key: old -> new`` for the keys that differ between two recipes (at most ``limit``)."""
    a, b = flatten(old), flatten(new)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:limit]] + (["..."] if len(keys) > limit else [])


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    """The marker of a run directory, None when there is none; a damaged one is a CheckpointError."""
    path = run_dir / MARKER
    if not path.exists():
        return None
    try:
        marker = read_json(path)
        if not isinstance(marker, dict) or not isinstance(marker.get("config_sha256"), str) \
                or not isinstance(marker.get("config"), dict):
            raise ValueError("expected an object with 'config_sha256' and 'config'")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable run marker ({one_line(e)})") from None
    return marker


def torchrun_agent() -> dict[str, str] | None:
    """Who started this process, under torchrun: the job's rendezvous id and its agent (host and pid, the parent of
    every worker it starts, round after round); None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    return {"run_id": run_id, "agent": f"{socket.gethostname()}:{os.getppid()}"}


def same_torchrun_job(run_dir: str | Path) -> bool:
    """Whether ``run_dir``'s marker was written by the torchrun job this process belongs to, through the same agent:
    a node joined or left a ``--nnodes MIN:MAX`` job and its agent restarted its workers for a new rendezvous round
    (torchrun does not count that as a restart: TORCHELASTIC_RESTART_COUNT stays as it was). Such a start goes on
    from the newest checkpoint; a new torchrun command (another agent) is a new start, refused without --resume."""
    agent = torchrun_agent()
    if agent is None:
        return False
    try:
        marker = read_marker(Path(run_dir))
    except (CheckpointError, OSError):  # the start itself says what is wrong with it
        return False
    return marker is not None and marker.get("torchrun") == agent


@dataclass
class DirState:
    """What a run directory holds, read without writing anything."""

    exists: bool
    entries: list[str] = field(default_factory=list)  # names in it, our lock file left out
    marker: dict[str, Any] | None = None
    steps: list[int] = field(default_factory=list)  # complete checkpoints
    has_weights: bool = False  # model.safetensors


def inspect(run_dir: Path) -> DirState:
    if not run_dir.exists():
        return DirState(False)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: exists and is not a directory; choose another --run-dir")
    entries = sorted(n for n in os.listdir(run_dir) if n != LOCK)
    return DirState(True, entries, read_marker(run_dir), list_checkpoints(run_dir),
                    (run_dir / "model.safetensors").exists())


class RunDirectory:
    """Rank 0's ownership of a run directory for one training (see the module docstring).

    ``mode`` after :meth:`open`: ``new`` (nothing to resume), ``resume`` (from the newest checkpoint) or
    ``restart`` (a run killed before its first checkpoint, same config). ``check_checkpoint``: how a resume's
    newest checkpoint is checked before any work (:data:`CheckpointCheck`)."""

    def __init__(self, cfg: Config, path: str | Path, resume: bool, check_checkpoint: CheckpointCheck) -> None:
        self.cfg, self.path, self.resume, self.check_checkpoint = cfg, Path(path), resume, check_checkpoint
        self.hash = config_hash(cfg)
        self.mode = "new"
        self.lock = RunLock(self.path)
        self.created_root: Path | None = None  # the topmost directory this process created
        self.before: set[str] | None = None  # entries of RUN when this process took it over
        self.is_started = False

    # --- the checks ------------------------------------------------------------------------------

    def _decide(self, st: DirState) -> str:
        """``new``, ``resume`` or ``restart``, or a one-line refusal (nothing is written here)."""
        path = self.path
        if not st.entries:
            return "new"
        weights_only = CheckpointError(
            f"{path} holds model.safetensors but no checkpoints/: nothing to resume from (a restart would "
            "overwrite the trained weights); train into a new --run-dir")
        if st.marker is None:
            if not self.resume:
                if st.steps or st.has_weights:
                    raise CheckpointError(f"{path} already holds a training run: pass --resume to continue it "
                                          "or choose another --run-dir")
                raise CheckpointError(f"{path}: not empty and not a run directory of aiayn (it holds "
                                      f"{_listing(st.entries)}); train into a new or empty --run-dir")
            if st.steps:
                return "resume"  # a run written before run directories had a marker
            if st.has_weights:
                raise weights_only
            raise CheckpointError(f"{path}: nothing to resume (no checkpoints, and not a run directory of aiayn: "
                                  f"it holds {_listing(st.entries)})")
        if not self.resume:
            raise CheckpointError(f"{path} already holds a training run (started {st.marker.get('created', '?')}): "
                                  "pass --resume to continue it or choose another --run-dir")
        if st.steps:
            return "resume"
        if st.has_weights:
            raise weights_only
        old = migrate(st.marker["config"], str(path / MARKER))  # a marker written before a key moved: its new place
        if recipe_hash(old) != self.hash:
            diff = config_diff(old, recipe(self.cfg))
            tok = any(k.startswith(f"data.{t}:") for k in diff for t in TOKENIZER_KEYS)
            why = "; its tokenizer was made for the old values" if tok else ""
            raise CheckpointError(
                f"{path} was stopped before its first checkpoint with another config ({', '.join(diff)}){why}: "
                "--resume restarts it only with the same config; or train into a new --run-dir")
        return "restart"

    def _check_resumable(self, st: DirState) -> None:
        """The newest checkpoint's state and the tokenizer keys, checked before any work starts."""
        step = st.steps[-1]
        try:
            self.check_checkpoint(self.path, step)
        except CheckpointError as e:
            hint = (f"; delete {checkpoint_dir(self.path) / f'step_{step:06d}'}.* to resume from step {st.steps[-2]}"
                    if len(st.steps) > 1 else "")
            raise CheckpointError(f"{e}{hint}") from None
        old = self._run_data_section(st)
        new = self.cfg.data
        for key in TOKENIZER_KEYS:
            if key in old and old[key] != getattr(new, key):
                raise ConfigError(f"{self.path}: the run's tokenizer was made with data.{key}={old[key]!r} but the "
                                  f"config says data.{key}={getattr(new, key)!r}; resume with the run's value or "
                                  "train into a new --run-dir")

    def _run_data_section(self, st: DirState) -> dict[str, Any]:
        if st.marker is not None:
            return dict(st.marker["config"].get("data") or {})
        try:  # a run from before markers: its config.yaml says what its tokenizer was made with
            data = load_yaml(self.path / "config.yaml").get("data")
        except (ConfigError, OSError):
            return {}
        return dict(data) if isinstance(data, dict) else {}

    def _check(self) -> DirState:
        st = inspect(self.path)
        self.mode = self._decide(st)
        if self.mode == "resume":
            self._check_resumable(st)
        return st

    # --- taking it over --------------------------------------------------------------------------

    def open(self) -> None:
        """Check, then create and lock RUN and write its marker. Raises a one-line UserError / OSError
        with nothing written when RUN may not be used."""
        path = self.path
        if (path / LOCK).exists():  # a training in progress is the first thing to report
            self.lock.acquire(create=False)
        try:
            st = self._check()
            if st.exists:
                check_writable(path)
                if checkpoint_dir(path).is_dir():
                    check_writable(checkpoint_dir(path))
            else:
                self._make_dirs()
            if self.lock.fd is None:
                self.lock.acquire()
            st = self._check()  # again, under the lock: another process may have got here first
            self.before = set(st.entries) | ({LOCK} if not self.lock.created else set())
            agent = torchrun_agent()
            if st.marker is None:
                marker = {"aiayn_run": 1,
                          "created": now(),
                          "config_sha256": self.hash, "config": recipe(self.cfg),
                          **({"torchrun": agent} if agent else {})}
                atomic_write_json(path / MARKER, marker, allow_nan=True)
            elif agent and st.marker.get("torchrun") != agent:  # resumed by another torchrun job: its agent now
                atomic_write_json(path / MARKER, {**st.marker, "torchrun": agent}, allow_nan=True)
            self.lock.write_pid()
        except BaseException:
            self.close(failed=True)
            raise

    def _make_dirs(self) -> None:
        """Create RUN and its missing parents, remembering the topmost one this process made (no other)."""
        for d in reversed([p for p in [self.path, *self.path.parents] if not p.exists()]):
            try:
                d.mkdir()
            except FileExistsError:  # made by another process meanwhile: not ours to remove
                continue
            except OSError as e:
                raise CheckpointError(f"{self.path}: cannot create the run directory ({e.strerror or e})") from None
            if self.created_root is None:
                self.created_root = d

    def started(self) -> None:
        """Training has begun: from now on a failure keeps what is in RUN (it resumes with --resume)."""
        self.is_started = True

    def close(self, failed: bool = False) -> None:
        """Release the lock; after a failed start, first remove what this process created."""
        try:
            if failed and not self.is_started:
                self._remove_created()
        finally:
            self.lock.release()

    def _remove_created(self) -> None:
        if self.lock.fd is None:  # never owned RUN: another process may be using what this one created
            for d in [self.path, *self.path.parents] if self.created_root is not None else []:
                with contextlib.suppress(OSError):
                    d.rmdir()  # only while empty
                if d == self.created_root:
                    break
            return
        if self.created_root is not None:
            shutil.rmtree(self.created_root, ignore_errors=True)
            return
        if self.before is None:  # refused under the lock: only the lock file may be new
            if self.lock.created:
                self.lock.path.unlink(missing_ok=True)
            return
        if not self.lock.created:  # a failed start leaves the run's files as they were, the lock file's too
            self.lock.restore()
        for name in sorted(set(os.listdir(self.path)) - self.before):
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _listing(entries: list[str], limit: int = 3) -> str:
    shown = ", ".join(entries[:limit])
    return shown + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


def check_every_process_sees(run_dir: Path, d: Processes) -> None:
    """Rank 0 writes the run directory (tokenizer, prepared data, checkpoints) and every other process reads it,
    so processes on several machines need the same run directory on a file system they share. Rank 0 writes a probe
    file there; each process says which directory it was given, whether it sees the probe there, and on which host it
    runs; if any was given another directory or does not see it, every process raises the same one line naming each
    process's host, rank and directory, within seconds, instead of a missing-file error on one node and a broken
    collective (or a watchdog timeout) on the others."""
    if d.world == 1:
        return
    import secrets
    import socket

    host = socket.gethostname()
    token = d.gather_objects(secrets.token_hex(8) if d.main else None)[0]
    probe = run_dir / f".probe-{token}"
    if d.main:
        probe.write_text(host, encoding="utf-8")
    d.barrier()
    # also the barrier before rank 0 removes the probe
    seen = d.gather_objects((host, probe.exists(), os.path.abspath(run_dir)))
    if d.main:
        probe.unlink(missing_ok=True)
    problem = _unshared_run_dir(seen)
    if problem is not None:
        raise CheckpointError(problem)


def _unshared_run_dir(seen: list[tuple[str, bool, str]]) -> str | None:
    """The line for processes (``(host, sees rank 0's probe, its run directory)`` in rank order) that do not share
    rank 0's run directory, None when all do."""
    def ranks(rows: list[int]) -> str:
        by_host: dict[str, list[int]] = {}
        for r in rows:
            by_host.setdefault(seen[r][0], []).append(r)
        return ", ".join(f"{h} (rank {', '.join(map(str, rs))})" for h, rs in by_host.items())

    host0, _, dir0 = seen[0]
    elsewhere: dict[str, list[int]] = {}
    for r, (_, _, d) in enumerate(seen):
        if d != dir0:
            elsewhere.setdefault(d, []).append(r)
    need = "several machines need one run directory, the same --run-dir on a file system they share " \
           "(docs/distributed.md)"
    if elsewhere:
        given = "; ".join(f"{ranks(rs)} {'was' if len(rs) == 1 else 'were'} given {d}" for d, rs in elsewhere.items())
        return f"the processes of this job were given other run directories: rank 0 on {host0} writes {dir0}; " \
               f"{given}: {need}"
    blind = [r for r, (_, ok, _) in enumerate(seen) if not ok]
    if blind:
        return f"{dir0}: written by rank 0 on {host0}, but not seen by {ranks(blind)} at that path: {need}"
    return None


@contextlib.contextmanager
def own_run_dir(cfg: Config, run_dir: str | Path, resume: bool, d: Processes, device: torch.device,
                check_checkpoint: CheckpointCheck) -> Iterator[RunDirectory | None]:
    """Rank 0 takes ``run_dir`` over (:class:`RunDirectory`) for the block and yields it; the other ranks of a
    torchrun job yield None once rank 0 has succeeded (and fail, without writing, when it has not).
    An exception in the block before :meth:`RunDirectory.started` removes what rank 0 created."""
    owner: RunDirectory | None = None
    error: BaseException | None = None
    if d.main:
        owner = RunDirectory(cfg, run_dir, resume, check_checkpoint)
        try:
            owner.open()
        except Exception as e:  # whatever it is, the other ranks must hear of it (or wait at the broadcast)
            error = e
    if d.world > 1 and not d.broadcast_flag(error is None, device) and error is None:
        error = CheckpointError(f"{run_dir}: rank 0 refused the run directory (its error says why)")
    if error is not None:
        raise error
    try:
        check_every_process_sees(Path(run_dir), d)
        yield owner
    except BaseException:
        if owner is not None:
            owner.close(failed=True)
        raise
    if owner is not None:
        owner.close()
