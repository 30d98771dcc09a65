"""User errors: problems the user caused and can fix, reported as one line and exit status 2.

Every layer raises a subclass of :class:`UserError` for bad input (a config key, a corpus line, a
broken checkpoint, a device that is not there); the command line's single error boundary
(:func:`aiayn.cli.main`) prints ``aiayn: error: <message>`` and exits 2. Anything else is a bug and
keeps its traceback (shown with ``-v``). This module imports nothing of aiayn, so every layer can use it.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
from collections.abc import Iterable


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``" (did you mean X?)"`` naming the known word closest to a mistyped ``word`` (difflib's ratio at least
    0.6), or ``""`` when none is close."""
    close = difflib.get_close_matches(word, sorted(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def one_line(message: object) -> str:
    """``str(message)`` folded onto one line (a stderr line must never be broken up)."""
    return " ".join(str(message).split("\n")).strip()


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class UserError(Exception):
    """Base class of the errors a user can fix; ``str()`` is one line: what is wrong and where. ``every_rank``: a
    refusal every process of a torchrun job reaches alike (a resume at a world size that cannot share out the run's
    micro-batches), said once per machine (:func:`said_here`), not once per process."""

    def __init__(self, message: object = "", every_rank: bool = False) -> None:
        super().__init__(one_line(message))
        self.every_rank = every_rank


def is_refusal(e: BaseException) -> bool:
    """Whether ``e`` refuses the input (the same command fails again until the user changes something), rather than
    stopping work from outside (a peer lost or frozen, a signal, the machine, a desync: it goes on with --resume)."""
    return isinstance(e, UserError) and not isinstance(e, (PeerError, Interrupted, DesyncError, StoppedError))


def said_here(e: BaseException) -> bool:
    """Whether this process prints ``e``: always, except an ``every_rank`` refusal in a process of a torchrun job that
    is not its machine's first (LOCAL_RANK 0 says it for all of them)."""
    return not getattr(e, "every_rank", False) or os.environ.get("LOCAL_RANK", "0") == "0"


class ConfigError(UserError, ValueError):
    """A config or option that cannot be used: unknown key, wrong type, value out of range, impossible shape."""


class DataError(UserError, ValueError):
    """Unusable input data: missing or unreadable file, bad encoding, mismatched parallel files."""


class CheckpointError(UserError, RuntimeError):
    """A run directory or checkpoint that cannot be read, does not fit the model, or may not be written."""


class DeviceError(UserError, RuntimeError):
    """A device or precision this machine does not offer (``--device cuda`` without CUDA, bf16 on CPU, ...)."""


class PeerError(UserError, RuntimeError):
    """Another process this one waits for (a process of the same torchrun job, or one that prepares the data they
    share) stopped, froze or did not answer within the timeout the config gives it."""


class Interrupted(UserError, RuntimeError):
    """Work stopped from outside (a signal to one of a runner's worker processes); running it again goes on."""


class DesyncError(UserError, RuntimeError):
    """The processes of one training no longer hold the same model (their gradient or weight norms differ)."""


class StoppedError(UserError, RuntimeError):
    """Work stopped by a signal or the machine (a data loader worker killed, no memory left): not a bug; the
    message says what stopped and how to go on (a training: its resume command)."""


def require(module: str, extra: str, what: str) -> None:
    """Raise a one-line :class:`ConfigError` when the optional ``module`` is not installed, naming the extra
    that brings it (``pip install 'aiayn[extra]'``). Call it before any work starts."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs the {module} package: pip install 'aiayn[{extra}]'")


# OS errors that are the machine's state, not a bug, even when no file name comes with them.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                                errno.EFBIG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EMFILE, errno.ENFILE,
                                errno.ENOMEM, errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST, errno.ENOTEMPTY})


def user_error_message(e: BaseException) -> str | None:
    """The one line ``what: why`` for an error the user (or the machine's state) caused; None for a bug.

    User errors: :class:`UserError` and its kinds; an ``OSError`` naming a file, or one of the environment's
    (no space, read-only file system, permission, quota, ...); a ``UnicodeDecodeError`` (input that is not
    UTF-8); running out of (GPU) memory."""
    if isinstance(e, UserError):
        return one_line(e) or type(e).__name__
    machine = machine_state_message(e)  # signals, memory, descriptors, the network: never a bug
    if machine is not None:
        return machine
    if isinstance(e, OSError):
        why = e.strerror or one_line(e) or type(e).__name__
        if e.filename is not None:
            where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
            return one_line(f"{where}: {why}")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # no file named: say where the user can act
            return one_line(f"{why} (free space, or write elsewhere: the command's output, --out or --run-dir, "
                            "or $TMPDIR for its temporary files)")
        if e.errno in ENVIRONMENT_ERRNOS:
            return one_line(why)
        return None
    if isinstance(e, UnicodeDecodeError):
        bad = e.object[e.start : e.start + 1].hex() if isinstance(e.object, (bytes, bytearray)) else "?"
        return f"input is not valid UTF-8 (byte 0x{bad} at offset {e.start})"
    if type(e).__name__ == "OutOfMemoryError" or isinstance(e, MemoryError):
        first = one_line(e).split(". ")[0]
        return f"out of memory{': ' + first if first else ''} (lower data.max_tokens or --max-tokens)"
    if collective_timed_out(e):
        return (f"a collective of this torchrun job waited train.dist_timeout_s for another process, which did not "
                f"answer ({_torch_detail(e)}): that process is stopped, frozen, or busy far longer than the others; "
                f"this one stops too. {restart_hint()}; raise train.dist_timeout_s if one process legitimately works "
                "that much longer")
    if type(e).__name__ == "DistStoreError" and "timeout" in str(e):
        return (f"the processes of this torchrun job did not all meet in its store within train.dist_timeout_s "
                f"({_torch_detail(e)}): one of them did not start, stopped, or belongs to another attempt of the job. "
                f"{restart_hint()}")
    if _peer_lost(e):
        return (f"another process of this torchrun job stopped ({_torch_detail(e)}); this one stops too. "
                f"{restart_hint()}")
    return None


# What to do when a process of a torchrun job is lost: true whatever torchrun can still do (docs/distributed.md).
RESTART_HINT = ("torchrun --max-restarts N restarts the job from its newest checkpoint, unless the lost node hosted "
                "torchrun's rendezvous: then start the job again on every node with --resume (docs/distributed.md)")


def restart_hint() -> str:
    """:data:`RESTART_HINT`, as far as this process knows from torchrun (``TORCHELASTIC_MAX_RESTARTS``, and
    ``TORCHELASTIC_RESTART_COUNT``, which a replacement node's agent counts from 0): a restart still to come, or none
    left (then the job is over and goes on only with --resume)."""
    try:
        most = int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
        done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except (KeyError, ValueError):
        return RESTART_HINT
    if done >= most:
        return (f"torchrun has no restart left (--max-restarts {most}): start the job again on every node with "
                "--resume, which goes on from its newest checkpoint (docs/distributed.md)")
    return (f"torchrun restarts the job from its newest checkpoint (restart {done + 1} of --max-restarts {most}) once "
            "its nodes meet again, unless the lost node hosted torchrun's rendezvous: then start the job again on "
            "every node with --resume (docs/distributed.md)")


# What gloo says when a collective waited past the process group's timeout (train.dist_timeout_s).
COLLECTIVE_TIMEOUT = ("Timed out waiting",)


def collective_timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a collective that waited past its process group's timeout (gloo's "Timed out waiting")."""
    return isinstance(e, RuntimeError) and any(p in str(e) for p in COLLECTIVE_TIMEOUT)


def _torch_detail(e: BaseException) -> str:
    """The message of a torch.distributed error without its C++ source location (``[/path/file.cc:78] ``)."""
    text = one_line(e)
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:160]


# What gloo and NCCL say when a process of the group died (kill -9, a node lost): the machine's state, not a bug.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "connectFullMesh")


def _peer_lost(e: BaseException) -> bool:
    kind = type(e).__name__
    return kind in ("DistNetworkError", "DistBackendError") or (
        isinstance(e, RuntimeError) and any(p in str(e) for p in PEER_LOST))


# A DataLoader worker that died (torch's words): killed by a signal (the kernel's out-of-memory killer, kill -9, a
# bus error when /dev/shm is full) or exited without saying why.
LOST_WORKER = re.compile(r"DataLoader worker \(pids?\(?s?\)? ?([0-9, ]+)\) (is killed by signal: ([^.]*)|exited "
                         r"unexpectedly(?: with exit code (-?[0-9]+))?)")
# What torch and the OS say, inside a RuntimeError, when the machine ran out of something: (pattern, why, what to do).
MACHINE_SAYS = (
    ("can't allocate memory", "out of memory", "lower data.max_tokens or --max-tokens, or free memory"),
    ("Too many open files", "too many open files", "raise the limit (ulimit -n) or lower data.loader_workers"),
    ("received 0 items of ancdata", "too many open files (DataLoader workers pass batches as file descriptors)",
     "raise the limit (ulimit -n) or lower data.loader_workers"),
    ("No space left on device", "no space left on device", "free space; DataLoader workers pass batches through "
     "/dev/shm: a container needs a larger --shm-size, or set data.loader_workers=0"),
    ("unable to open shared memory", "out of shared memory", "a container needs a larger --shm-size, or set "
     "data.loader_workers=0"),
)
NETWORK_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT,
                            errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE, errno.EAGAIN})


def lost_worker(e: BaseException) -> str | None:
    """``data loader worker (pid N) was killed by signal: Killed`` when ``e`` is torch's word that a DataLoader
    worker died (the kernel's out-of-memory killer, a kill, no shared memory left); None otherwise."""
    found = LOST_WORKER.search(str(e)) if isinstance(e, RuntimeError) else None
    if found is None:
        return None
    pids = found.group(1).strip().rstrip(",")
    who = f"data loader worker (pid{'s' if ',' in pids else ''} {pids})"
    if found.group(3) is not None:
        signal = found.group(3).strip()
        why = " (/dev/shm is full: a container needs a larger --shm-size)" if "Bus error" in signal else (
            " (the kernel's out-of-memory killer, or a kill)" if signal == "Killed" else "")
        return f"{who} was killed by signal: {signal}{why}"
    code = found.group(4)
    return f"{who} exited unexpectedly{f' with exit code {code}' if code else ''}"


def machine_state_message(e: BaseException) -> str | None:
    """The one line for an error a signal or the machine caused (a DataLoader worker killed, memory, file
    descriptors or /dev/shm exhausted, a network connection lost or timed out); None for anything else."""
    worker = lost_worker(e)
    if worker is not None:
        return f"{worker}; a training resumes from its newest checkpoint: aiayn train --resume RUN"
    if isinstance(e, RuntimeError):
        for pattern, why, what in MACHINE_SAYS:
            if pattern in str(e):
                return f"{why}: {one_line(e)[:200]} ({what})"
    network = isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in ("URLError", "gaierror") or (
        isinstance(e, OSError) and e.filename is None and e.errno in NETWORK_ERRNOS)
    if network:
        why = getattr(e, "reason", None) or e.strerror or one_line(e) or type(e).__name__
        return one_line(f"the network or a connection failed: {why} (check the connection and retry)")
    return None


__all__ = ["CheckpointError", "ConfigError", "DataError", "DesyncError", "DeviceError", "Interrupted", "PeerError",
           "StoppedError", "UserError", "collective_timed_out", "first_line", "is_refusal", "lost_worker",
           "machine_state_message",
           "one_line", "require", "user_error_message"]
