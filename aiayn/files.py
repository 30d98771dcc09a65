"""Atomic file writes: the one place that writes a file the user may rely on.

A file is written to a temporary name in the same directory, flushed to disk, given the permissions
a plain ``open(path, "w")`` would have (``0o666`` minus the umask: ``mkstemp`` creates ``0o600``, which
would make a run shared with another user unreadable), and renamed over the target. A reader sees
the old file or the new one, never half of one; a kill leaves at most a ``.NAME.*.tmp`` file, which
:func:`remove_stale_temporaries` cleans up.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it; restored at once
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file under the current umask."""
    return 0o666 & ~_umask()


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` to fill a temporary file, then rename it over ``path``; returns ``path``.

    The parent directory is created if needed. On any error the temporary file is removed and
    ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # whatever wrote it, its bytes reach the disk before the rename
            os.fsync(f.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
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


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the ``.NAME.*.tmp`` files an interrupted :func:`atomic_write` left in ``directory``.

    Only for directories a single writer owns (a run directory under its lock). Returns what was removed."""
    directory = Path(directory)
    removed = []
    if not directory.is_dir():
        return removed
    for p in directory.iterdir():
        if p.name.startswith(".") and p.name.endswith(TMP_SUFFIX) and p.is_file():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextmanager
def staged_directory(path: str | Path) -> Iterator[Path]:
    """Build a directory out of sight and put it in place whole: yields an empty temporary directory beside
    ``path``; when the block ends without error it is renamed to ``path`` (what was there is replaced,
    so callers decide beforehand whether they may). On error the temporary directory is removed and
    ``path`` is left as it was. A reader sees the old directory or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0o700
    old = None
    try:
        yield tmp
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


__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "default_file_mode",
           "remove_stale_temporaries", "staged_directory"]
