"""Atomic file writes: the one place that writes a file the user may rely on.

A file is written to a temporary name in the same directory, flushed to disk, given the permissions
a plain ``open(path, "w")`` would have (``0o666`` minus the umask: ``mkstemp`` creates ``0o600``, which
would make a run shared with another user unreadable), and renamed over the target. A reader sees
the old file or the new one, never half of one; a kill leaves at most a ``.NAME.*.tmp`` file (and, inside
a safetensors write, that library's own ``.tmpXXXXXX``), which :func:`remove_stale_temporaries` cleans up.
An error while writing names the target file (``OSError.filename``), so the command line can say which
file could not be written and why ("No space left on device"). A device, a pipe or /dev/stdout is written into
as it is (:func:`written_in_place`): a rename over it would replace the node itself.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import math
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from aiayn.errors import CheckpointError, ConfigError, one_line

try:  # POSIX; on Windows a run directory is not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

TMP_SUFFIX = ".tmp"
# A run directory's marker (written first by the training that owns it) and lock (held while one writes it).
MARKER = ".aiayn-run.json"
LOCK = ".aiayn-run.lock"
# safetensors (>= 0.5) writes through its own temporary, named by Rust's tempfile crate: ".tmp" + 6 characters.
RUST_TMP_RE = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")
# safetensors reports an I/O failure as SafetensorError("... No space left on device (os error 28) ...").
OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; restored at once
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file under the current umask."""
    return 0o666 & ~_umask()


CACHE_DIR_ENV = "AIAYN_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/aiayn")


def cache_dir() -> Path:
    """Where aiayn keeps what it downloads or works out once per machine (corpora, prepared token stores, the CPU's
    bf16 probe): ``$AIAYN_CACHE_DIR`` or ``~/.cache/aiayn``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def written_in_place(path: str | Path) -> bool:
    """Whether a write to ``path`` goes into it as it is, not through a temporary renamed over it: a device, a
    named pipe or a socket, and a name that leads into /proc (``--out /dev/stdout`` links to /proc/self/fd/1, the
    process's output, which may be a regular file). Renaming over such a name, as root, would replace the device
    node or the link itself with a file. A regular file anywhere else (/dev/shm too) is written atomically."""
    p = os.path.abspath(path)
    for _ in range(40):  # the links of the last component, one by one (realpath would leave /proc behind)
        if os.path.realpath(os.path.dirname(p)).startswith("/proc/"):
            return True
        if not os.path.islink(p):
            break
        p = os.path.join(os.path.dirname(p), os.readlink(p))
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` to fill a temporary file, then rename it over ``path``; returns ``path``.

    The parent directory is created if needed. On any error the temporary file is removed and
    ``path`` is left as it was. A device or a pipe (:func:`written_in_place`) is written into as it is."""
    path = Path(path)
    tmp = None
    try:
        if written_in_place(path):
            write(str(path))
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as f:  # whatever wrote it, its bytes reach the disk before the rename
            os.fsync(f.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is None or is_temporary(os.path.basename(str(e.filename))):  # the user's name, not ours
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return atomic_write(path, write)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, data: Any, indent: int | None = 1, allow_nan: bool = False) -> Path:
    """Write ``data`` as JSON (UTF-8, non-ASCII kept) to ``path`` atomically. NaN and infinities are refused
    (ValueError: they are not JSON) unless ``allow_nan`` (internal state files that only aiayn reads)."""
    text = json.dumps(data, indent=indent, ensure_ascii=False, allow_nan=allow_nan)
    return atomic_write_text(path, text + "\n")


@contextmanager
def os_errors_named(path: str | Path) -> Iterator[None]:
    """Inside the block, an I/O failure that names no file (``write()``'s bare "No space left on device") and
    safetensors' (SafetensorError "... No space left on device (os error 28)", also from a library that saves with
    it, e.g. transformers' ``save_pretrained``) become the OSError they are, naming ``path``, so that the command line
    reports them as one line."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except Exception as e:
        m = OS_ERROR_RE.search(str(e)) if type(e).__name__ == "SafetensorError" else None
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def atomic_write_safetensors(path: str | Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None,
                             save_file: Callable[..., None] | None = None) -> Path:
    """Write ``tensors`` to ``path`` atomically with safetensors' ``save_file`` (or the function given, of its
    signature), its I/O failures ("No space left on device (os error 28)", raised as SafetensorError) turned
    into the OSError they are, naming ``path``, so the command line reports them as one line."""
    if save_file is None:
        from safetensors.torch import save_file

    def write(tmp: str) -> None:
        with os_errors_named(tmp):
            save_file(tensors, tmp, metadata=metadata)

    if written_in_place(path):  # safetensors renames its own temporary over the name it is given: not a device's
        with tempfile.TemporaryDirectory() as scratch:
            staged = os.path.join(scratch, "tensors.safetensors")
            write(staged)

            def copy(target: str) -> None:
                with open(staged, "rb") as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)

            return atomic_write(path, copy)
    return atomic_write(path, write)


def now() -> str:
    """The time a file records as its creation (a store's manifest, a run's marker, an eval record): UTC, to the
    second, ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary of :func:`atomic_write` (``.NAME.*.tmp``) or of safetensors (``.tmpXXXXXX``)."""
    return (name.startswith(".") and name.endswith(TMP_SUFFIX)) or bool(RUST_TMP_RE.match(name))


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the temporaries (:func:`is_temporary`) an interrupted write left in ``directory``.

    Only for directories a single writer owns (a run directory under its lock), at a moment when that
    writer has no write in flight. Returns what was removed."""
    directory = Path(directory)
    removed = []
    if not directory.is_dir():
        return removed
    for p in directory.iterdir():
        if is_temporary(p.name) and p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def check_writable(directory: str | Path) -> None:
    """Raise ``OSError`` (naming ``directory``) unless a file can be created in it: checked before work
    starts, so that a read-only or full place fails at once instead of after hours of work. The probe
    file is removed at once (a kill leaves a ``.tmp`` that :func:`remove_stale_temporaries` removes)."""
    directory = Path(directory)
    try:
        fd, probe = tempfile.mkstemp(prefix=".aiayn-probe.", suffix=TMP_SUFFIX, dir=directory)
    except OSError as e:
        raise OSError(e.errno or errno.EACCES, e.strerror or str(e), str(directory)) from None
    os.close(fd)
    os.unlink(probe)


@contextmanager
def staged_directory(path: str | Path) -> Iterator[Path]:
    """Build a directory out of sight and put it in place whole: yields an empty temporary directory beside
    ``path``; when the block ends without error its files get plain permissions (as :func:`atomic_write`
    gives) and it is renamed to ``path`` (what was there is replaced, so callers decide beforehand whether
    they may, :func:`check_output_dir`). On error the temporary directory is removed and
    ``path`` is left as it was. A reader sees the old directory or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0o700
    old = None
    try:
        yield tmp
        # What third-party writers put there (safetensors writes 0600) gets a plain file's mode, as ours do.
        file_mode, dir_mode = default_file_mode(), 0o777 & ~_umask()
        for sub in tmp.rglob("*"):
            if not sub.is_symlink():
                os.chmod(sub, dir_mode if sub.is_dir() else file_mode)
        if path.exists():  # renamed aside first: rename() cannot replace a non-empty directory
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", suffix=TMP_SUFFIX, dir=path.parent))
            os.rename(path, old / path.name)
        try:
            os.rename(tmp, path)
        except BaseException:
            if old is not None:  # put the old directory back before the cleanup below removes it
                os.rename(old / path.name, path)
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a lock file removed or replaced meanwhile does not)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


# The descriptors of the flocks this process holds. A forked child (a DataLoader worker) shares them, and a flock
# lasts while any descriptor of it is open: a worker outliving a killed training would keep its run directory or
# store locked. The child closes its copies first (close_inherited_locks); the parent's locks stay as they were.
_HELD: set[int] = set()


def close_inherited_locks() -> None:
    """In a forked child: close this process's copies of its parent's lock descriptors (the parent keeps its locks;
    they end when the parent's own descriptors close, whatever the child does)."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


def _overwrite(fd: int, text: bytes) -> None:
    """Make the lock file open as ``fd`` hold ``text``: written over, then cut to length, never emptied first, so a
    reader (a waiter naming the holder) never finds it empty, even when the writer is stopped between the calls."""
    os.pwrite(fd, text, 0)
    os.ftruncate(fd, len(text))


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock, as the exclusive holder of :func:`file_lock` wrote it into the lock file: its pid, its host,
    and what it is doing (:meth:`HeldLock.doing`); "?" and None where it wrote nothing."""

    pid: str = "?"
    host: str | None = None
    doing: str | None = None

    @classmethod
    def read(cls, fd: int) -> LockHolder:
        text = os.pread(fd, 512, 0).decode("utf-8", "replace")
        first, _, rest = text.partition("\n")
        words = first.split()
        pid = words[0] if words and words[0].isdigit() else "?"
        return cls(pid, words[1] if len(words) > 1 else None, rest.strip() or None)

    def state(self) -> str | None:
        """What the holder is now, where this machine can tell (its host, Linux /proc): "stopped" (SIGSTOP or a
        debugger), "gone" (no such process), "running"; None elsewhere."""
        if not self.pid.isdigit() or self.host != socket.gethostname():
            return None
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return "gone"
        except OSError:
            return None
        code = stat.rsplit(")", 1)[-1].split()[:1]
        return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(code[0] if code else "", "running")

    def describe(self) -> str:
        """``pid N on HOST (DOING), which is stopped (...)``: as much as is known, and what to do about it."""
        where = f" on {self.host}" if self.host else ""
        doing = f" ({self.doing})" if self.doing else ""
        state = {"stopped": f"which is stopped (resume it with kill -CONT {self.pid}, or end it)",
                 "gone": "which is gone", "running": "which is still running (slow, or stuck)",
                 None: "which has not finished (stopped, frozen or slow)"}[self.state()]
        return f"pid {self.pid}{where}{doing}, {state}"


class LockTimeout(TimeoutError):
    """:func:`file_lock` waited its ``timeout_s`` for ``holder``; the caller says what that means in one line."""

    def __init__(self, path: Path, holder: LockHolder, waited_s: float) -> None:
        super().__init__(f"{path}: held by {holder.describe()} for more than {waited_s:g} s")
        self.path, self.holder, self.waited_s = path, holder, waited_s


class HeldLock:
    """A lock :func:`file_lock` holds; an exclusive holder can say what it is doing (:meth:`doing`), for the
    processes that wait on it."""

    def __init__(self, fd: int | None, exclusive: bool) -> None:
        self.fd, self.exclusive = fd, exclusive

    def doing(self, what: str) -> None:
        """Write ``pid host`` and ``what`` into the lock file: the line a waiter that gives up shows."""
        if self.fd is None or not self.exclusive:
            return
        _overwrite(self.fd, f"{os.getpid()} {socket.gethostname()}\n{one_line(what)}\n".encode())


def _acquire(fd: int, mode: int, path: Path, waiting: Callable[[str], None] | None, timeout_s: float | None) -> None:
    """``flock(fd, mode)``: at once, or after ``waiting(pid)``, blocking (``timeout_s`` None) or polling until
    ``timeout_s`` has passed (then :class:`LockTimeout`)."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    if waiting is not None:
        waiting(LockHolder.read(fd).pid)
    if timeout_s is None:
        fcntl.flock(fd, mode)
        return
    start = time.monotonic()
    pause = 0.02
    while True:  # a poll: a blocking flock cannot be given up (a holder frozen by SIGSTOP never releases it)
        left = start + timeout_s - time.monotonic()
        if left <= 0:
            raise LockTimeout(path, LockHolder.read(fd), timeout_s)
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            continue


@contextlib.contextmanager
def file_lock(path: str | Path, shared: bool = False, waiting: Callable[[str], None] | None = None,
              timeout_s: float | None = None, doing: str = "") -> Iterator[HeldLock]:
    """Hold an ``flock`` on the file ``path``: exclusive for a writer (the file is created if missing, in an existing
    directory), ``shared`` for readers (the file must exist), who then see no writer at work. ``waiting(holder)`` is
    called when another process holds it (``holder``: the pid the exclusive holder wrote, or "?"), before waiting: at
    most ``timeout_s`` seconds (then :class:`LockTimeout`, naming the holder and what it was doing), else for as long
    as it takes. A lock file removed while we waited is opened again (FileNotFoundError when its directory is gone
    too: a failed writer removed what it had made). An exclusive holder writes its pid, host and ``doing`` into the
    file as it takes the lock (what a waiter that gives up shows). Yields a :class:`HeldLock`."""
    if fcntl is None:  # pragma: no cover
        yield HeldLock(None, not shared)
        return
    path = Path(path)
    while True:
        fd: int | None = os.open(path, os.O_RDONLY) if shared else os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            _acquire(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, path, waiting, timeout_s)
            if not _names(path, fd):  # opened again (FileNotFoundError when its directory went too)
                os.close(fd)
                fd = None
                continue
            held = HeldLock(fd, not shared)
            held.doing(doing)
            _HELD.add(fd)
            yield held
            return
        finally:
            if fd is not None:
                _HELD.discard(fd)
                os.close(fd)  # closing the descriptor releases the flock


@contextlib.contextmanager
def claim(path: str | Path) -> Iterator[bool]:
    """Try once to take an exclusive ``flock`` on the file ``path`` (created if missing, in an existing directory):
    yields True while this process holds it, False at once when another process does (several workers sharing a
    list of jobs: each job is done by the one that claims it). The lock ends with the block, or with the process."""
    if fcntl is None:  # pragma: no cover
        yield True
        return
    fd = os.open(Path(path), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        _HELD.add(fd)
        yield True
    finally:
        _HELD.discard(fd)
        os.close(fd)  # closing the descriptor releases the flock


class RunLock:
    """The exclusive ``flock`` on RUN/.aiayn-run.lock; :meth:`acquire` fails at once when another process holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self.fd: int | None = None
        self.created = False
        self.old: bytes | None = None  # the lock file's content before write_pid

    def acquire(self, create: bool = True) -> None:
        if fcntl is None:  # pragma: no cover
            return
        fd = None
        if create:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
                self.created = True
            except FileExistsError:
                pass
        if fd is None:
            fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise CheckpointError(f"{self.path.parent}: in use by another aiayn process{who}; wait for it to end "
                                  "or choose another --run-dir") from None
        # The path must still name the file we locked: a start that failed meanwhile may have removed it.
        if not _names(self.path, fd):
            os.close(fd)
            raise CheckpointError(f"{self.path.parent}: changed while this process started; try again")
        self.fd = fd
        _HELD.add(fd)

    def write_pid(self) -> None:
        """The holder's pid into the lock file (for the "in use" message); :meth:`restore` puts the old one back."""
        if self.fd is not None:
            self.old = os.pread(self.fd, 64, 0)
            _overwrite(self.fd, f"{os.getpid()}\n".encode("ascii"))

    def restore(self) -> None:
        if self.fd is not None and self.old is not None:
            _overwrite(self.fd, self.old)

    def release(self) -> None:
        if self.fd is not None:
            _HELD.discard(self.fd)
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None


@contextlib.contextmanager
def locked(run_dir: str | Path) -> Iterator[None]:
    """Hold the run's lock (when it has a lock file) for a command that writes into a finished run
    (``aiayn average``): refused while a training writes into it."""
    lock = RunLock(Path(run_dir))
    if lock.path.exists():
        lock.acquire(create=False)
    try:
        yield
    finally:
        lock.release()


def lock_holder(directory: str | Path) -> str | None:
    """The pid (as written in it) of a live process holding ``directory``'s run lock, "?" when one holds it
    without a pid, None when nobody does (or there is no lock file)."""
    path = Path(directory) / LOCK
    if fcntl is None or not path.is_file():
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return holder if holder.isdigit() else "?"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def guard_output_dir(out: str | Path, inputs: Sequence[str | Path] = (), flag: str = "") -> Path:
    """The output guard of a directory a command creates or fills: refuse (one-line ConfigError), before any work,
    the same directory as an input (symlinks resolved), one inside an input, one that contains an input, one inside
    a run directory or a token store, and an existing file that is not a directory. Returns ``out``."""
    out = Path(out)
    name = f"{flag} {out}" if flag else str(out)
    target = _real(out)
    for given in inputs:
        src = _real(given)
        if target == src:
            raise ConfigError(f"{name}: is the input {given} itself; write to another directory")
        if src in target.parents:
            raise ConfigError(f"{name}: is inside the input {given}; write outside it")
        if target in src.parents:
            raise ConfigError(f"{name}: contains the input {given}; write elsewhere")
    owner = _owner(target)
    if owner is not None:
        kind_of = "run directory" if is_run_dir(owner) else "token store"
        raise ConfigError(f"{name}: is inside the {kind_of} {owner}, whose files only aiayn's own commands write; "
                          "write outside it")
    if out.exists() and not out.is_dir():
        what = "a device or a pipe" if written_in_place(out) else "a file"
        raise ConfigError(f"{name}: is {what}, not a directory; name a new directory")
    _check_above(out, name)
    return out


def check_output_dir(out: str | Path, inputs: Sequence[str | Path], force: bool) -> None:
    """Refuse, before anything is read or written, an output directory that would destroy an input or a run in
    use (:func:`guard_output_dir`), or a token store (shared by the runs trained from it); an existing non-empty
    directory without ``force``; with ``force`` (which replaces the directory whatever it holds), a directory a live
    process holds (a training's run lock). One-line ConfigError naming both paths."""
    out = Path(out)
    guard_output_dir(out, inputs)
    if is_store_dir(out):  # shared by every run trained from it
        raise ConfigError(f"{out}: is a token store; --force never replaces one: choose another directory")
    if not out.exists() or not any(out.iterdir()):
        return
    if not force:
        raise ConfigError(f"{out} already exists and is not empty: choose a new directory or pass --force")
    holder = lock_holder(out)
    if holder is not None:
        who = f"pid {holder}" if holder != "?" else "another process"
        raise ConfigError(f"{out}: a run in use ({who} holds its lock): --force never replaces it; wait for it "
                          "to end or choose another directory")

# Bounded reads ----------------------------------------------------------------------------------------------------

JSON_MAX_BYTES = 64 << 20  # a manifest, a marker, a checkpoint's state: far smaller
HASH_CHUNK = 1 << 24  # bytes read at a time when a file is hashed


def read_bounded(path: str | Path, max_bytes: int, pipes: bool = True) -> bytes:
    """The bytes of the regular file (or, with ``pipes``, pipe: ``<(zcat recipe.yaml.gz)``) ``path``, at most
    ``max_bytes``: a ValueError for a device (a symlink to /dev/zero, which would never end), a pipe without
    ``pipes`` (opened without waiting for a writer, which may never come: a store's file is never a pipe) or a file
    past ``max_bytes``. FileNotFoundError / OSError as open()."""
    if pipes:
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    else:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
    with f:
        st = os.fstat(f.fileno())
        if not (stat.S_ISREG(st.st_mode) or (pipes and stat.S_ISFIFO(st.st_mode))):
            raise ValueError("not a regular file (a device, a pipe or a directory)")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes:,} bytes")
    return data


def sha256_file(file: str | Path | BinaryIO, size: int | None = None) -> str:
    """sha256 (hex) of a file's bytes (a path, or a binary file open at its start), read :data:`HASH_CHUNK` bytes at
    a time: at most ``size`` bytes when given (a bound whatever the file turns out to be), else to its end."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            return sha256_file(f, size)
    h, left = hashlib.sha256(), math.inf if size is None else size
    while left > 0 and (block := file.read(min(HASH_CHUNK, left))):
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def load_json(data: bytes | str) -> Any:
    """``json.loads``, with nesting too deep for Python's recursion limit a ValueError like any other bad JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json(path: str | Path, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """A JSON file read boundedly (:func:`read_bounded`) and parsed (:func:`load_json`): ValueError when it is not
    a regular file, too large, not JSON or nested too deeply."""
    return load_json(read_bounded(path, max_bytes))


# The one output guard ---------------------------------------------------------------------------------------------

# What marks a run directory (a training's marker; config.yaml beside its weights, checkpoints or tokenizer: an
# imported run) and a token store (its marker; a manifest beside its tokenizer).
STORE_MARKER = ".aiayn-store"
RUN_FILES = ("model.safetensors", "checkpoints", "tokenizer")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HEAD_BYTES = 1 << 16  # what a content check reads of an existing file, at most


def is_run_dir(directory: str | Path) -> bool:
    """Whether ``directory`` is an aiayn run directory (trained, or imported)."""
    d = Path(directory)
    return (d / MARKER).is_file() or ((d / "config.yaml").is_file() and any((d / n).exists() for n in RUN_FILES))


def is_store_dir(directory: str | Path) -> bool:
    """Whether ``directory`` is a prepared token store (complete or being built)."""
    d = Path(directory)
    return (d / STORE_MARKER).exists() or ((d / "manifest.json").is_file() and (d / "tokenizer").is_dir())


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEAD_BYTES)


def _is_text(head: bytes) -> bool:
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a character cut at the end of what was read is still text
        return e.start >= len(head) - 3 and e.reason == "unexpected end of data"
    return True


def _is_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 8 + n <= size and head[8:9] == b"{"


# The kinds of file a command writes: what an existing file must hold to be written over (an empty one is any kind).
KINDS: dict[str, tuple[str, Callable[[bytes, int], bool]]] = {
    "weights": ("a safetensors weights file", _is_safetensors),
    "png": ("a PNG image", lambda head, size: head.startswith(PNG_SIGNATURE)),
    "json": ("a JSON record", lambda head, size: _is_text(head) and head.lstrip()[:1] in (b"{", b"[")),
    "text": ("a text file", lambda head, size: _is_text(head) and not head.startswith(PNG_SIGNATURE)),
    "zip": ("a zip package", lambda head, size: head.startswith(b"PK\x03\x04")),
}


def _real(path: str | Path) -> Path:
    """``path`` absolute with its symlinks followed (a loop left as it is, never an error)."""
    return Path(os.path.realpath(path))


def _same(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (symlinks and hard links too) or one place."""
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return _real(a) == _real(b)


def _owner(target: Path) -> Path | None:
    """The run directory or token store ``target`` (resolved) lies in, if any."""
    for parent in target.parents:
        if is_run_dir(parent) or is_store_dir(parent):
            return parent
    return None


def _check_above(out: Path, name: str) -> None:
    """Refuse (one-line ConfigError) ``out`` whose nearest existing ancestor is a file, not a directory (where
    creating its parents would say only "File exists")."""
    above = next((p for p in Path(os.path.abspath(out)).parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(f"{name}: {above} is a file, not a directory; write inside a directory")


def guard_output(path: str | Path, kind: str, inputs: Sequence[str | Path] = (), flag: str = "--out",
                 creates: Sequence[str | Path] = (), replace: bool = True) -> Path:
    """Refuse (one-line ConfigError), before any work, to write the file ``path``, of ``kind`` (:data:`KINDS`),
    when it is one of the command's ``inputs`` (the same file through a symlink or a hard link; a file inside an
    input directory), a file of a run directory or a token store other than those the command itself
    ``creates`` there, a directory (or a name ending in ``/``), ``-`` (stdout, which the commands that can write
    there take before this guard), a path under a file, or an existing file whose content is not of ``kind``; and,
    unless ``replace`` (a command's ``--force``), any existing file. A device, a pipe or /dev/stdout is written into
    as it is. Returns ``path``."""
    out = Path(path)
    what, fits = KINDS[kind]
    name = f"{flag} {out}" if flag else str(out)
    if str(path) == "-":  # the commands that write to stdout take "-" before this guard; the others write a file
        raise ConfigError(f"{name}: {what} is not written to stdout here; name the file to write")
    if str(path).endswith(os.sep):
        raise ConfigError(f"{name}{os.sep}: names a directory; name the file to write")
    ours = any(_same(out, Path(c)) for c in creates)
    for given in inputs:
        src = Path(given)
        if not src.exists() and not src.is_symlink():
            continue
        if _same(out, src):
            raise ConfigError(f"{name}: is the input {given} itself; write to another file")
        if src.is_dir() and _real(src) in _real(out).parents and not ours:
            raise ConfigError(f"{name}: is inside the input {given}; write outside it")
    if written_in_place(out):
        return out
    owner = _owner(_real(out))
    if owner is not None and not ours:
        kind_of = "run directory" if is_run_dir(owner) else "token store"
        raise ConfigError(f"{name}: is inside the {kind_of} {owner}, whose files only aiayn's own commands write; "
                          "write outside it")
    if out.is_dir():
        raise ConfigError(f"{name}: is a directory; name the file to write")
    _check_above(out, name)
    if not out.exists():
        return out
    try:
        st = os.stat(out)
        head = _head(out)
    except OSError as e:
        raise ConfigError(f"{name}: cannot be read to check what it holds ({e.strerror or e})") from None
    if head and not fits(head, st.st_size):
        raise ConfigError(f"{name}: exists and is not {what}; it is never written over: name a new file")
    if not replace and not ours:
        raise ConfigError(f"{name}: already exists; pass --force to replace it")
    return out


__all__ = ["LOCK", "MARKER", "HeldLock", "LockHolder", "LockTimeout", "RunLock", "atomic_write", "atomic_write_bytes",
           "atomic_write_json", "atomic_write_safetensors", "atomic_write_text", "check_output_dir", "check_writable",
           "claim", "default_file_mode", "file_lock", "guard_output", "guard_output_dir", "is_run_dir", "is_store_dir",
           "is_temporary", "load_json", "lock_holder", "locked", "now", "os_errors_named", "read_bounded", "read_json",
           "remove_stale_temporaries", "sha256_file", "staged_directory"]
