"""What a process of a torchrun job does for the launcher that started it (``aiayn launch``, :mod:`aiayn.launch`).

- Its stderr goes back to the user's: the launcher keeps torchrun's own output (its agent's logs, tracebacks and
  C++ stack traces) in a log file, and its workers inherit that file as stderr; :func:`reattach_stderr` opens the
  launcher's saved stderr again (``AIAYN_LAUNCH_STDERR``, a ``/proc/PID/fd/N`` path) onto this process's.
- Its one error line goes into torchrun's error file (``TORCHELASTIC_ERROR_FILE``, :func:`record_error`), where
  torchrun's agent reads it for its report of a failed process: also under plain torchrun.
- The job's processes of each rendezvous round (:func:`record_members`: rank, pid, host and the agent that started
  each) go to ``AIAYN_LAUNCH_DIR/job.json``, so that the launcher's last line can name a node that was lost.

Nothing here imports torch; every function does nothing outside a launched process and never fails the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from aiayn.files import atomic_write_json

STDERR_ENV = "AIAYN_LAUNCH_STDERR"  # the launcher's stderr, as a path this process can open
DIR_ENV = "AIAYN_LAUNCH_DIR"  # the launcher's own folder (its log, the job's members)
MEMBERS_FILE = "job.json"


def reattach_stderr() -> None:
    """Point this process's stderr (fd 2) at the launcher's (see the module docstring); a path that cannot be opened
    (the launcher gone) leaves it as it is."""
    path = os.environ.get(STDERR_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.dup2(fd, 2)
    os.close(fd)


def record_error(line: str, status: int, refusal: bool = False) -> None:
    """Write this process's one line (without ``aiayn: error: ``) where torchrun's agent reads a failed worker's
    message (``TORCHELASTIC_ERROR_FILE``, the format of torch's ``record``), the exit status it ends with, and
    whether it refuses the input (:func:`aiayn.errors.is_refusal`: the launcher then says it as it is, without a
    resume command)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": line, "timestamp": int(time.time()), "status": status,
              "aiayn": "refusal" if refusal else "stop"}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(record), encoding="utf-8")


def said_by_launcher(refusal: bool) -> bool:
    """Whether ``aiayn launch`` says this process's refusal for it: its last line is the job's first refusal, so
    the processes themselves stay quiet and it is said once per machine (a stop from outside is said at once by the
    process that meets it, as it happens)."""
    return refusal and bool(os.environ.get(DIR_ENV)) and bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))


def record_members(members: list[tuple[int, str, int]], local_rank: int) -> None:
    """The job's processes in rank order, each ``(pid, host, agent pid)``, written once per node (local rank 0)."""
    folder = os.environ.get(DIR_ENV)
    if not folder or local_rank != 0:
        return
    with contextlib.suppress(OSError):
        atomic_write_json(Path(folder) / MEMBERS_FILE, {"processes": [list(m) for m in members]})


def read_members(folder: str | Path) -> list[tuple[int, str, int]]:
    """What :func:`record_members` wrote in ``folder``; [] when nothing (no round completed, a damaged file)."""
    try:
        data = json.loads((Path(folder) / MEMBERS_FILE).read_text(encoding="utf-8"))
        return [(int(p), str(h), int(a)) for p, h, a in data["processes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
