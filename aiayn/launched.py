"""What a process of a torchrun job does for the launcher that started it (``aiayn launch``, :mod:`aiayn.launch`).

- Its stderr goes back to the user's: the launcher keeps torchrun's own output (its agent's logs, tracebacks and
  C++ stack traces) in a log file, and its workers inherit that file as stderr; :func:`reattach_stderr` opens the
  launcher's saved stderr again (``AIAYN_LAUNCH_STDERR``, a ``/proc/PID/fd/N`` path) onto this process's.
- Its one error line goes into torchrun's error file (``TORCHELASTIC_ERROR_FILE``, :func:`record_error`), where
  torchrun's agent reads it for its report of a failed process: also under plain torchrun.
- A worker of plain torchrun that its agent stops (SIGTERM: another process or node of the job stopped, the
  rendezvous was lost, a node joined, or the agent itself was stopped) says so in one line before it ends
  (:func:`say_when_torchrun_stops_this`), instead of vanishing without a word.
- The job's processes of each rendezvous round (:func:`record_members`: rank, pid, host and the agent that started
  each) go to ``AIAYN_LAUNCH_DIR/job.json``, so that the launcher's last line can name a node that was lost.

Nothing here imports torch; every function does nothing outside a launched process and never fails the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
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


_STOPPED_BY_AGENT: list[bool] = []  # set once torchrun's agent stopped this process (SIGTERM)


def agent_stop_message() -> str:
    """The one line of a torchrun worker its agent stopped (without ``aiayn: error: ``), with what to do next."""
    from aiayn.errors import restart_hint

    return ("torchrun's agent stopped this process (SIGTERM), as it does when another process of this torchrun job "
            f"stopped, a node was lost or joined, or the agent itself was stopped; {restart_hint()}")


def stopped_by_agent() -> bool:
    """Whether torchrun's agent stopped this process (then its data loader workers, which the agent's SIGTERM to
    the process group also ended, are not the reason)."""
    return bool(_STOPPED_BY_AGENT)


def say_when_torchrun_stops_this() -> None:
    """In a worker of plain torchrun (not :mod:`aiayn.launch`, whose last line says it for the job): when the agent
    stops this process (SIGTERM to its process group), raise :class:`~aiayn.errors.StoppedError` at the next
    Python instruction, so the command's error boundary says why in one line (:func:`agent_stop_message`) and
    records it. The agent does so when another process or node stopped, often before this process's next
    collective would have failed on its own. Processes forked from this one (data loader workers) end as the
    default would; their deaths, which follow, are no longer reported (SIGCHLD back to its default)."""
    if not os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(DIR_ENV):
        return
    import sys

    from aiayn.errors import StoppedError

    mine = os.getpid()

    def stop(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM (or one in a fork) ends the process at once
        if os.getpid() != mine:
            os.kill(os.getpid(), signum)
            return
        _STOPPED_BY_AGENT.append(True)
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the data loader's workers end too: not the news
        if sys.exc_info()[0] is None:  # already ending with an error: that one says it
            raise StoppedError(agent_stop_message())

    with contextlib.suppress(ValueError):  # not the main thread: keep the default
        signal.signal(signal.SIGTERM, stop)


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
