"""A prepared store's integrity: a sha256 of every file in its manifest, written when it is prepared, the manifest's
own checksum, and a memo of the files found good, so that an unchanged store is not read again at every start.

The manifest's ``files`` maps each file of the store (``train.src.bin``, ``tokenizer/tokenizer.json``, ...) to its
sha256, and its ``checksum`` is the sha256 of the rest of the manifest (canonical JSON): one integer edited in the
manifest, or one id overwritten by another in range (which no bounds check sees), is found when the store is opened.
A file is read and hashed only when it changed since it was last found good: the memo (``.aiayn-checked.json`` in the
store) remembers each good file by its size, modification and change times (ns) and inode; any write changes the
change time, which cannot be set back. The memo is written once per opening, after every check passed: a damaged
store is left exactly as it was. A store in a read-only directory is checked every time. A store without checksums
(no ``files`` or no ``checksum``: prepared by an older aiayn, or stripped) is refused unless the user allows it
(``--allow-unverified``); then it opens with its shape and ids checked, and the log says it is unverified.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.errors import DataError
from aiayn.files import JSON_MAX_BYTES, atomic_write_json, load_json, read_bounded, sha256_file

MANIFEST = "manifest.json"
CHECKED = ".aiayn-checked.json"  # the memo: files found good, by identity
CHECK_CHUNK = 1 << 22  # ids read at a time when a file is scanned (8-16 MB: memory stays flat)


def open_regular(path: str | Path, name: str | Path | None = None) -> int:
    """A read-only descriptor of the store file ``path``; a DataError naming it (``name``, else ``path``) unless it
    is a regular file: a directory, a device (a symlink to /dev/zero) or a pipe in its place is damage (its size says
    nothing; reading it might never end; a pipe is opened without waiting for a writer). OSError as ``os.open``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{name or path}: not a regular file (a directory, a device or a pipe stands in its place)")
    return fd


def file_checksums(directory: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory`` (a store being built), in name order."""
    return {p.relative_to(directory).as_posix(): sha256_file(p)
            for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink()}  # regular files alone


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of a manifest's canonical JSON without its own ``checksum``."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def seal(manifest: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``manifest`` with the checksums of the files in ``directory`` (``files``) and its own (``checksum``)."""
    sealed = {**manifest, "files": file_checksums(directory)}
    sealed["checksum"] = manifest_checksum(sealed)
    return sealed


def load_manifest(directory: Path, version: int) -> dict[str, Any]:
    """The manifest of the store in ``directory``, checked: a DataError saying what is wrong with it (missing, not
    JSON, another store version, edited or damaged since it was written)."""
    path = directory / MANIFEST
    try:
        data = read_bounded(path, JSON_MAX_BYTES, pipes=False)  # a pipe in its place: refused, not waited on
    except FileNotFoundError:
        raise DataError(f"{path}: missing (not a prepared corpus, or its preparing never finished)") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    try:
        manifest = load_json(data)
    except ValueError as e:
        what = "empty (0 bytes)" if not data.strip() else f"not JSON ({str(e).split(':')[0]})"
        raise DataError(f"{path}: {what}") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: not a store manifest (a JSON {type(manifest).__name__}, not an object)")
    if manifest.get("version") != version:
        raise DataError(f"{path}: store version {manifest.get('version')!r}, where this aiayn reads {version}")
    if "checksum" in manifest and manifest["checksum"] != manifest_checksum(manifest):
        raise DataError(f"{path}: does not match its checksum (edited or damaged since it was written)")
    if not isinstance(manifest.get("files"), dict) or "checksum" not in manifest:
        if not unverified_allowed():
            raise DataError(f"{path}: has no checksums (prepared by an older aiayn, or they were removed), so its "
                            f"files cannot be verified; pass --allow-unverified (or set {ALLOW_UNVERIFIED}=1) to use "
                            "it as it is, or prepare it again into a new directory")
    return manifest


# Set (to 1) by --allow-unverified: a store without checksums may be opened. An environment variable, so that the
# ranks and loader workers a command starts read the same answer.
ALLOW_UNVERIFIED = "AIAYN_ALLOW_UNVERIFIED"


def unverified_allowed() -> bool:
    """Whether the user said --allow-unverified (or set ``AIAYN_ALLOW_UNVERIFIED=1``)."""
    return os.environ.get(ALLOW_UNVERIFIED, "") not in ("", "0")


def allow_unverified() -> None:
    """--allow-unverified: stores without checksums open in this process and those it starts."""
    os.environ[ALLOW_UNVERIFIED] = "1"


class Memo:
    """The files of one store found good at an earlier opening (see the module docstring). ``enabled=False``
    (``aiayn prepare --verify``): what earlier openings found is neither read nor written, so every file is read;
    ``entries`` lists those found good by this one alone."""

    def __init__(self, directory: Path, enabled: bool = True) -> None:
        self.path, self.enabled, self.changed = directory / CHECKED, enabled, False
        memo: Any = {}
        if enabled:
            try:
                data = read_bounded(self.path, JSON_MAX_BYTES, pipes=False)  # a pipe in its place: not waited on
            except FileNotFoundError:
                data = b"{}"
            except (OSError, ValueError):  # a directory, a device or a pipe in its place: not written into either
                data, self.enabled = b"{}", False
            with contextlib.suppress(ValueError):  # not JSON: written again
                memo = load_json(data)
        self.entries: dict[str, Any] = memo if isinstance(memo, dict) else {}

    @staticmethod
    def identity(fd_or_stat: int | os.stat_result, *extra: Any) -> list[Any]:
        """What the memo knows a file by: size, modification and change times (ns), inode, and ``extra``."""
        st = os.fstat(fd_or_stat) if isinstance(fd_or_stat, int) else fd_or_stat
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, *extra]

    def good(self, name: str, identity: list[Any]) -> bool:
        """Whether ``name`` was found good as it is now (``identity``: :meth:`identity` with what it was checked
        against)."""
        return self.enabled and self.entries.get(name) == identity

    def remember(self, name: str, identity: list[Any]) -> None:
        if self.entries.get(name) != identity:
            self.entries[name] = identity
            self.changed = True

    def save(self) -> None:
        """Write the memo (once per opening, when every check passed); a read-only store is checked again next
        time, nothing lost."""
        if self.changed and self.enabled:
            with contextlib.suppress(OSError):
                atomic_write_json(self.path, self.entries)
            self.changed = False


def scan_ids(fd: int, name: str, dtype: np.dtype, n_ids: int, vocab_size: int, digest: str | None) -> str | None:
    """None when every one of the ``n_ids`` ids of the open file ``fd`` (``name``) is below ``vocab_size`` and its
    bytes hash to ``digest`` (when given), else what is wrong. One pass, vectorized, in bounded chunks."""
    size, h = dtype.itemsize, hashlib.sha256() if digest is not None else None
    for start in range(0, n_ids, CHECK_CHUNK):
        data = os.pread(fd, CHECK_CHUNK * size, start * size)
        ids = np.frombuffer(data, dtype=dtype)
        if len(ids) and int(ids.max()) >= vocab_size:
            return f"{name}: holds id {int(ids.max())}, past the vocabulary of {vocab_size:,}"
        if h is not None:
            h.update(data)
    if h is not None and h.hexdigest() != digest:
        return f"{name}: does not match its checksum (an id overwritten, or the file damaged since it was prepared)"
    return None


def check_ids(fd: int, path: Path, dtype: np.dtype, n_ids: int, vocab_size: int,
              files: dict[str, str] | None, memo: Memo) -> str | None:
    """:func:`scan_ids` of a store's id file ``path``, unless the memo found it good as it is now (same identity,
    vocabulary and checksum); remembered when good."""
    digest = files.get(path.name) if files is not None else None
    if files is not None and digest is None:
        return f"{path.name}: not among the files its manifest lists"
    identity = Memo.identity(fd, vocab_size, digest)
    if memo.good(path.name, identity):
        return None
    problem = scan_ids(fd, path.name, dtype, n_ids, vocab_size, digest)
    if problem is None:
        memo.remember(path.name, identity)
    return problem


def check_files(directory: Path, files: dict[str, str], memo: Memo, skip: set[str] = frozenset()) -> list[str]:
    """What is wrong with the files the manifest lists (``files``: name -> sha256), ``skip`` aside (checked already:
    the id files, by :func:`check_ids`): each missing or changed one, one line each; unchanged files (memo) not read."""
    problems = []
    for name, digest in files.items():
        if name in skip:
            continue
        path = os.path.join(directory, name)  # a string: this loop runs at every opening (pathlib costs more)
        try:
            identity = Memo.identity(os.stat(path), digest)
            if memo.good(name, identity):  # unchanged since found good: not read
                continue
            with os.fdopen(open_regular(path, name), "rb") as f:
                identity = Memo.identity(f.fileno(), digest)  # what is hashed is what is remembered
                got = sha256_file(f, identity[0])  # at most its size when opened: bounded, whatever it is
        except FileNotFoundError:
            problems.append(f"{name}: missing (its manifest lists it)")
            continue
        except DataError as e:
            problems.append(str(e))
            continue
        except OSError as e:
            problems.append(f"{name}: unreadable ({e.strerror or e})")
            continue
        if got != digest:
            problems.append(f"{name}: does not match its checksum (damaged or edited since it was prepared)")
        else:
            memo.remember(name, identity)
    return problems


__all__ = ["CHECKED", "MANIFEST", "Memo", "check_files", "check_ids", "file_checksums", "load_manifest",
           "manifest_checksum", "open_regular", "scan_ids", "seal"]
