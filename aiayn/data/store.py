"""Prepared corpora: one token store with kinds, a corpus tokenized once into flat files of token ids, read lazily,
by position, by any number of runs and torchrun ranks (``aiayn prepare CONFIG --out DIR``, or the first ``aiayn
train``). Its kinds: (source, target) pairs, here; a language model's text as one token stream
(:mod:`aiayn.data.stream_store`); summarization as language modelling is a :class:`PairRecipe` of (document,
summary) pairs (:func:`aiayn.data.summarization.summary_lm_recipe`).

    DIR/manifest.json          what the store holds and from what: kind, inputs, settings, counts (written last)
    DIR/tokenizer/             the tokenizer the ids belong to (trained on a sample of the corpus, or given)
    DIR/<split>.src.bin        every kept pair's source ids back to back (uint16 when the vocabulary fits, else uint32)
    DIR/<split>.src.idx        int64 offsets into it, one more than the pairs (pair i is ids[idx[i]:idx[i + 1]])
    DIR/<split>.tgt.bin / .idx the same for the target side
    DIR/.aiayn-store           marker: aiayn made this directory and may rebuild it
    DIR/.aiayn-store.lock      flock: exclusive while one process builds, shared while one opens

Raw little-endian arrays whose dtype and length the manifest states: no pickle, and only the offsets (the pair
lengths the batches are planned from) live in memory while training; ids are read by position, never mapped
(:class:`IdFile`), a batch's pairs into one buffer (:meth:`Side.gather`, :func:`aiayn.data.batching.collate_flat`).

What every kind shares: the manifest's ``key``, a sha256 over everything the ids depend on (the input files' bytes
or a known dataset's published checksums, the settings that tokenize, filter or cut the text, a given tokenizer's
files, :data:`STORE_VERSION`: :func:`store_key`), so a store is reused only when its key matches; the manifest
(:meth:`Recipe.manifest`), sealed with every file's checksum and its own (:mod:`aiayn.data.integrity`) and written
last; one lock (:func:`store_lock`): one process builds (:func:`prepare_store`), in a staging directory of its own,
the others wait and open the complete store; a killed build is rebuilt, a failed one removes the directory it
created; one opening (:func:`open_kind`) that checks every file (:meth:`IdFile._check`, vectorized; the memo skips
files unchanged since found good): a damaged store is one DataError naming the file and the fix. Preparing streams
the input (never all of it in memory), trains the tokenizer on a seeded sample (``data.tokenizer_sample``), and
encodes in chunks (worker processes when the corpus is large enough to pay for them), with progress on stderr.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import datetime
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import Config
from aiayn.data.corpus import clean_pairs
from aiayn.data.datasets import sha256_file
from aiayn.data.integrity import MANIFEST, Memo, check_files, check_ids, check_regular, load_manifest, seal
from aiayn.errors import DataError, PeerError
from aiayn.files import STORE_MARKER, TMP_SUFFIX, HeldLock, LockTimeout, atomic_write_json, file_lock, is_temporary
from aiayn.progress import ItemProgress

log = logging.getLogger("aiayn.data")

STORE_VERSION = 1  # bump when preparing produces other ids from the same inputs
MARKER = STORE_MARKER  # written first and kept: a directory without a manifest but with it may be rebuilt
LOCK = ".aiayn-store.lock"  # flock: exclusive while one process builds, shared while one opens
CHUNK = 20_000  # pairs encoded per task
PARALLEL_BYTES = 32 << 20  # inputs at least this big are encoded by worker processes (below, one process is faster)
PAIRS = "pairs"  # the manifest's kind of a store of (source, target) pairs (a manifest without a kind is one)
STREAM_KIND = "stream"  # the manifest's kind of a language model's token stream (aiayn.data.stream_store)

PairSource = Callable[[], Iterator[tuple[str, str]]]  # a fresh stream of (source, target) texts each call


class IdFile:
    """A flat file of token ids (uint16 or uint32, little-endian), read by position with ``pread``; pickles as what
    it was opened from (a DataLoader worker started by spawn or forkserver reopens the file), not its descriptor.

    Never mapped: a lasting mapping that training reads at random would keep every page it touched in the
    process's resident memory, which would grow with the store (BENCHMARKS.md, "The data path"). Read, the pages
    stay in the kernel's page cache, not in the process."""

    _state: dict[str, Any]

    def _open(self, path: Path, dtype: np.dtype | str) -> None:
        self.path, self.dtype = Path(path), np.dtype(dtype).newbyteorder("<")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            check_regular(fd, self.path)
        except DataError:
            os.close(fd)
            raise
        self._fd = fd
        self.file_bytes = os.fstat(self._fd).st_size

    def __getstate__(self) -> dict[str, Any]:
        return self._state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _check(self, n_ids: int, by: str, vocab_size: int, files: dict[str, str] | None, memo: Memo) -> str | None:
        """What is wrong with the file, None when nothing: its length (``n_ids``, as ``by`` says), every id below
        ``vocab_size``, and its checksum (``files``, the manifest's; None for a store prepared before checksums)
        unless ``memo`` found it good as it is. Vectorized, in bounded chunks."""
        need = n_ids * self.dtype.itemsize
        if self.file_bytes != need:
            return f"{self.path.name}: {self.file_bytes:,} bytes where its {by} {need:,} (truncated or damaged)"
        return check_ids(self._fd, self.path, self.dtype, n_ids, vocab_size, files, memo)

    def _read_into(self, buf: np.ndarray, starts: list[int], sizes: list[int], by: str) -> np.ndarray:
        """``buf`` filled with the runs of ids at ``starts`` (ids into the file), ``sizes`` ids each, back to back:
        one ``preadv`` a run, straight into its place; as int64."""
        view, at, size = memoryview(buf).cast("B"), 0, self.dtype.itemsize
        for start, n in zip(starts, sizes):
            n *= size
            if n and os.preadv(self._fd, [view[at : at + n]], start * size) != n:
                raise DataError(f"{self.path}: shorter than its {by} (truncated while read?)")
            at += n
        return buf.astype(np.int64)


class Side(IdFile):
    """One side of a prepared split: its offsets (pairs + 1,) in memory (8 bytes a pair), its ids read from the
    file by position (one pair, or a batch's pairs into one buffer: :meth:`gather`)."""

    def __init__(self, ids: Path, offsets: Path, dtype: np.dtype | str, pairs: int) -> None:
        self._state = {"ids": ids, "offsets": offsets, "dtype": np.dtype(dtype).newbyteorder("<").str, "pairs": pairs}
        self.offsets_path, size = offsets, (pairs + 1) * 8
        with open(offsets, "rb") as f:
            check_regular(f.fileno(), offsets)
            held = os.fstat(f.fileno()).st_size  # before reading: a manifest's count may be past any file's size
            data = f.read(size + 1) if held == size else b""
        if held != size or len(data) != size:
            raise DataError(f"{offsets}: holds {held:,} bytes where its manifest says {size:,} ({pairs:,} pairs)")
        # array.array: indexing gives Python ints at list speed, with numpy's 8 bytes a pair (numpy's own scalars
        # would cost more per pair than the read itself)
        self._bounds = array.array("q")
        self._bounds.frombytes(data)
        if sys.byteorder == "big":
            self._bounds.byteswap()
        self.offsets = np.frombuffer(self._bounds, dtype=np.int64)  # (pairs + 1,) a view, not a copy
        self._open(ids, dtype)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def check(self, vocab_size: int, files: dict[str, str] | None, memo: Memo) -> str | None:
        """What is wrong with this side, None when nothing: offsets from 0, non-decreasing, ending at the ids
        file's length; then :meth:`IdFile._check`."""
        o = self.offsets
        if o[0] != 0 or (len(o) > 1 and bool((o[1:] < o[:-1]).any())):
            return f"{self.offsets_path.name}: its offsets are not non-decreasing from 0"
        return self._check(int(o[-1]), "offsets need", vocab_size, files, memo)

    def lengths(self) -> np.ndarray:
        """(pairs,) int32: the token count of every pair (no specials)."""
        o = self.offsets
        out = np.empty(len(o) - 1, dtype=np.int32)
        np.subtract(o[1:], o[:-1], out=out, casting="unsafe")  # no int64 copy on the way (36 MB at 4.5M pairs)
        return out

    def __getitem__(self, i: int) -> list[int]:
        if not 0 <= i < len(self.offsets) - 1:
            raise IndexError(f"pair {i} of {len(self.offsets) - 1}")
        a, b = self._bounds[i], self._bounds[i + 1]
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self._fd, (b - a) * size, a * size), dtype=self.dtype).tolist()

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids of the pairs ``indices`` (B,), back to back in that order, (sum of lengths,) int64, and their
        lengths (B,) int64: one ``preadv`` for each run of pairs that lie one after another in the file (a pair
        alone, mostly: a batch's pairs are scattered), straight into its place in one buffer.

        Read, not mapped: a mapping made for each gather pays for a page table and a page fault per pair (the
        pairs of a batch lie far apart in a large store), which costs more than a read, and a lasting mapping's
        pages would stay in the process's resident memory (``benchmarks.data_scale``, BENCHMARKS.md)."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"pairs {int(idx.min())}..{int(idx.max())} of {len(self)}")
        starts, ends = self.offsets[idx], self.offsets[idx + 1]
        lens = ends - starts
        joined = starts[1:] == ends[:-1]  # pair k + 1 follows pair k in the file: one read for both
        first = np.flatnonzero(np.concatenate(([True], ~joined))) if len(idx) else idx  # where each run begins
        buf = np.empty(int(lens.sum()), dtype=self.dtype)
        reads = np.add.reduceat(lens, first) if len(idx) else lens
        return self._read_into(buf, starts[first].tolist(), reads.tolist(), "offsets"), lens
        joined = starts[1:] == ends[:-1]  # pair k + 1 follows pair k in the file: one read for both
        if joined.any():
            first = np.flatnonzero(np.concatenate(([True], ~joined)))  # where each run of pairs begins
            starts, lens_read = starts[first], np.add.reduceat(lens, first)
        else:
            lens_read = lens
        size = self.dtype.itemsize
        view, at, fd = memoryview(buf).cast("B"), 0, self._fd
        for start, n in zip((starts * size).tolist(), (lens_read * size).tolist()):
            if n and os.preadv(fd, [view[at : at + n]], start) != n:
                raise DataError(f"{self.path}: shorter than its offsets (truncated while read?)")
            at += n
        return buf.astype(np.int64), lens


@dataclass(frozen=True)
class Split:
    """A prepared split: the source and target sides of its kept pairs."""

    src: Side
    tgt: Side

    def __len__(self) -> int:
        return len(self.src)

    def pairs(self, indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """The id lists of the pairs ``indices`` (source, target)."""
        return [self.src[i] for i in indices], [self.tgt[i] for i in indices]


@dataclass(frozen=True)
class Store:
    """An opened store of any kind: its directory, its manifest and its splits (:class:`Split` of pairs, or a
    stream's :class:`~aiayn.data.stream_store.Stream`)."""

    path: Path
    manifest: dict[str, Any]
    splits: dict[str, Any]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"


# What a store depends on -----------------------------------------------------------------------------------


def settings(cfg: Config) -> dict[str, Any]:
    """The config values the prepared ids depend on (the tokenizer's training, the filtering, the cutting)."""
    d = cfg.data
    return {"task": cfg.task, "max_len": d.max_len or cfg.model.max_positions, "tokenizer": d.tokenizer,
            "vocab_size": d.vocab_size, "shared_vocab": d.shared_vocab, "byte_fallback": d.byte_fallback,
            "lowercase": d.lowercase, "pretokenize": d.pretokenize, "langs": [d.src_lang, d.tgt_lang],
            "tokenizer_sample": d.tokenizer_sample, "seed": cfg.train.seed}


def store_key(cfg: Config, inputs: dict[str, str], tokenizer: Path | None, extra: dict[str, Any] | None = None
              ) -> str:
    """sha256 of the version, the settings, the inputs' identities and, when given, the tokenizer's files.
    ``extra``: settings of another kind of store (a language model's split, its separator), kept with a given
    tokenizer too; a translation store has none, so its key is what it always was."""
    parts: dict[str, Any] = {"version": STORE_VERSION, "settings": settings(cfg), "inputs": inputs}
    if tokenizer is not None:
        parts["tokenizer"] = tokenizer_digest(tokenizer)
        parts["settings"] = {k: v for k, v in parts["settings"].items() if k in ("task", "max_len")}
    if extra:
        parts["settings"] = {**parts["settings"], **extra}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cached_store_dir(key: str) -> Path:
    """Where a training that names no ``data.prepared`` keeps its store: ``$AIAYN_CACHE_DIR/stores/<key>``
    (default ``~/.cache/aiayn``), so every run of the same inputs and settings shares one store."""
    from aiayn.data.datasets import cache_dir

    return cache_dir() / "stores" / key[:24]


def describe_store(manifest: dict[str, Any]) -> list[str]:
    """One line per split of a store: its pairs (or a stream's tokens) and their dtype."""
    dtype = manifest["dtype"]
    if "pairs" not in next(iter(manifest["splits"].values()), {"pairs": 0}):  # a language model's token stream
        return [f"{name}: {info['tokens']:,} tokens ({dtype})" for name, info in manifest["splits"].items()]
    return [f"{name}: {info['pairs']:,} pairs, {info['src_tokens']:,} source + {info['tgt_tokens']:,} target tokens "
            f"({dtype})" for name, info in manifest["splits"].items()]


def tokenizer_digest(d: Path) -> dict[str, str]:
    """``{name: sha256}`` of a tokenizer directory's files (the key of a store given it; two compared)."""
    from aiayn.data.tokenizer import tokenizer_files

    return {p.name: sha256_file(p) for p in tokenizer_files(d)}


def tokenizer_matches(a: Path, b: Path) -> bool:
    """Whether two tokenizer directories hold the same tokenizer files, byte for byte."""
    return tokenizer_digest(a) == tokenizer_digest(b)


# Opening -----------------------------------------------------------------------------------------------------


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a complete store, None when there is none or it cannot be trusted (unreadable, another
    version, edited: :func:`~aiayn.data.integrity.load_manifest` says which); then aiayn's cache rebuilds it."""
    try:
        return load_manifest(directory, STORE_VERSION)
    except DataError:
        return None


def damaged(path: Path, problem: str) -> DataError:
    """The one line of a damaged store ``path``: ``problem`` (naming the file) and the fix."""
    return DataError(f"{problem}: rebuild it: aiayn prepare CONFIG --out {path} (CONFIG: the recipe it was prepared "
                     "from)")


def opened_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest of the store ``path`` for an opening: a missing one says the store is not (yet) prepared,
    a damaged one names the problem and the fix; one DataError either way."""
    if not (path / MANIFEST).exists():
        raise DataError(f"{path}: not a prepared corpus (no readable {MANIFEST}): aiayn prepare CONFIG --out {path} "
                        "prepares it")
    try:
        return load_manifest(path, STORE_VERSION)
    except DataError as e:
        raise damaged(path, str(e)) from None


def check_store_files(path: Path, manifest: dict[str, Any], memo: Memo, id_files: set[str]) -> None:
    """The files of an opened store beside its id files (those are checked as they are read): their checksums when
    its manifest has them (the offsets, the tokenizer), else only its tokenizer's presence and a note in the log
    that the store is unverified. One DataError naming the first problem and the fix; the memo is written once
    every check has passed."""
    files = manifest.get("files")
    if isinstance(files, dict):
        problems = check_files(path, files, memo, skip=id_files)
        if problems:
            raise damaged(path, f"{path}/{problems[0]}")
    else:
        log.warning("%s: prepared without checksums (by an older aiayn): its shape and ids are checked, its "
                    "contents unverified; aiayn prepare into a new directory gives a verified store", path)
    tokenizer = path / "tokenizer" / "tokenizer.json"
    if not tokenizer.is_file():
        raise damaged(path, f"{tokenizer}: missing (the store's tokenizer)")
    memo.save()


def _manifest_problem(manifest: dict[str, Any], need: tuple[str, ...]) -> str | None:
    """What makes a manifest unusable (its shape, or a split ``need`` names that it lacks), None when nothing."""
    if manifest.get("kind", PAIRS) != PAIRS:
        return f"holds a {manifest.get('kind')!r} store, not (source, target) pairs"
    splits = manifest.get("splits")
    sizes = [manifest.get(k, 1) for k in ("src_vocab_size", "tgt_vocab_size")] + [manifest.get("vocab_size")]
    if manifest.get("dtype") not in ("uint16", "uint32") or not all(isinstance(v, int) for v in sizes):
        return "its dtype or vocabulary sizes are missing or wrong"
    if not isinstance(splits, dict) or not all(isinstance(i, dict) and isinstance(i.get("pairs"), int)
                                               and i["pairs"] >= 0 for i in splits.values()):
        return "its splits are missing or malformed"
    if "files" in manifest and not isinstance(manifest["files"], dict):
        return "its list of files is malformed"
    missing = [n for n in need if n not in splits]
    return f"names no {', '.join(missing)} split" if missing else None


@dataclass
class Opening:
    """A store being opened (its lock held, or none exists): its directory, manifest and memo, and the id files
    checked so far (the other files are checked by their checksums: :func:`check_store_files`)."""

    path: Path
    manifest: dict[str, Any]
    memo: Memo
    id_files: set[str] = field(default_factory=set)

    def id_file(self, split: str, label: str, make: Callable[[], IdFile], vocab_size: int,
                unreadable: tuple[type[Exception], ...] = (OSError, DataError)) -> Any:
        """``make()``: an id file of split ``split`` opened and checked (:meth:`IdFile._check`): one DataError
        naming the file and the fix for anything wrong (``unreadable``: errors named as ``label`` unreadable)."""
        try:
            opened = make()
        except FileNotFoundError as e:
            raise damaged(self.path, f"{e.filename}: missing (the manifest names split {split})") from None
        except unreadable as e:
            raise damaged(self.path, f"{self.path}/{label}: unreadable ({e})") from None
        problem = opened.check(vocab_size, self.manifest.get("files"), self.memo)
        if problem is not None:
            raise damaged(self.path, f"{self.path}/{problem}")
        self.id_files.add(opened.path.name)
        return opened


def open_kind(path: Path, problem: Callable[[dict[str, Any]], str | None],
              open_splits: Callable[[Opening], dict[str, Any]], verify_all: bool = False) -> Store:
    """Open and check the store in ``path`` (the caller holds its lock, or none exists), of the kind that
    ``problem`` (what makes its manifest unusable) and ``open_splits`` (its splits, opened and checked) say: one
    DataError naming the file and the fix for anything wrong. ``verify_all``: every file read and checked, none
    skipped as unchanged (``aiayn prepare --verify``)."""
    manifest = opened_manifest(path)
    wrong = problem(manifest)
    if wrong is not None:
        raise damaged(path, f"{path / MANIFEST}: {wrong}")
    opening = Opening(path, manifest, Memo(path, enabled=not verify_all))
    splits = open_splits(opening)
    check_store_files(path, manifest, opening.memo, opening.id_files)
    return Store(path, manifest, splits)


def open_pairs(path: Path, need: tuple[str, ...], verify_all: bool = False) -> Store:
    """Open and check the pairs store in ``path`` (:func:`open_kind`; ``need``: splits it must hold)."""
    def splits(o: Opening) -> dict[str, Split]:
        m, dtype = o.manifest, np.dtype(o.manifest["dtype"])
        return {name: Split(*(o.id_file(name, f"{name}.{side}", partial(
            Side, path / f"{name}.{side}.bin", path / f"{name}.{side}.idx", dtype, info["pairs"]),
            int(m.get(f"{side}_vocab_size", m["vocab_size"]))) for side in ("src", "tgt")))
            for name, info in m["splits"].items()}

    return open_kind(path, lambda manifest: _manifest_problem(manifest, need), splits, verify_all)


def open_store(directory: str | Path, need: tuple[str, ...] = (), wait_s: float | None = None) -> Store:
    """The prepared store in ``directory``, checked (:meth:`Side.check`; ``need``: splits it must hold): a
    missing, incomplete or damaged store is one DataError naming the file and the fix. Opened under the
    store's shared lock, so never while a builder replaces its files (waiting at most ``wait_s`` for one)."""
    return open_locked(Path(directory), lambda path: open_pairs(path, need), wait_s)


@contextlib.contextmanager
def store_lock(path: Path, shared: bool, wait_s: float | None) -> Iterator[HeldLock]:
    """The lock of the store ``path`` (:data:`LOCK`), waited for at most ``wait_s`` seconds (``train.setup_timeout_s``;
    None: as long as it takes): then one line (:class:`~aiayn.errors.PeerError`) naming the process that holds it,
    what it was doing, and the setting."""
    def waiting(who: str) -> None:
        limit = f" (at most train.setup_timeout_s={wait_s:g} s)" if wait_s is not None else ""
        log.info("%s: waiting for the process (pid %s) that prepares it%s", path, who, limit)

    try:
        with file_lock(path / LOCK, shared=shared, waiting=waiting, timeout_s=wait_s,
                       doing="preparing it: looking at what is there") as held:
            yield held
    except LockTimeout as e:
        raise PeerError(f"{path}: waited train.setup_timeout_s={e.waited_s:g} s for the process that prepares this "
                        f"store, {e.holder.describe()}; or raise train.setup_timeout_s, or prepare the store before "
                        "training (aiayn prepare CONFIG --out DIR, then --set data.prepared=DIR)") from None


def open_locked(path: Path, opener: Callable[[Path], Any], wait_s: float | None = None) -> Any:
    """``opener(path)`` under the store's shared lock (any kind of store), so never while a builder replaces its
    files (waited for at most ``wait_s`` seconds: :func:`store_lock`); a directory without a lock file (no store, or
    one of an earlier version) is opened as it is."""
    if not (path / LOCK).is_file():
        return opener(path)
    try:
        with store_lock(path, True, wait_s):
            return opener(path)
    except FileNotFoundError:  # the directory went while this waited: a failed build removed it
        raise DataError(f"{path}: not a prepared corpus (removed while this process waited for it)") from None


# Preparing ---------------------------------------------------------------------------------------------------


class _Writer:
    """Appends encoded pairs of one split to its .bin files in this builder's own staging directory; offsets
    written at the end."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.files = {side: open(directory / f"{split}.{side}.bin", "wb") for side in ("src", "tgt")}
        self.lengths: dict[str, list[np.ndarray]] = {"src": [], "tgt": []}
        self.stats = {"empty": 0, "too_long": 0, "kept": 0}

    def add(self, encoded: dict[str, Any]) -> None:
        for side in ("src", "tgt"):
            try:
                self.files[side].write(encoded[side].astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
            except OSError as e:  # a full disk: name the store's file, not a bare "No space left on device"
                raise OSError(e.errno, e.strerror, str(self.directory / f"{self.split}.{side}.bin")) from e
            self.lengths[side].append(encoded[f"{side}_lens"])
        for k in self.stats:
            self.stats[k] += encoded[k]

    def close(self) -> dict[str, Any]:
        info: dict[str, Any] = {"pairs": self.stats["kept"], "stats": dict(self.stats)}
        for side in ("src", "tgt"):
            self.files[side].close()
            lens = np.concatenate(self.lengths[side]) if self.lengths[side] else np.zeros(0, np.int64)
            offsets = np.zeros(len(lens) + 1, dtype="<i8")
            np.cumsum(lens, out=offsets[1:])
            offsets.tofile(self.directory / f"{self.split}.{side}.idx")
            info[f"{side}_tokens"] = int(offsets[-1])
        return info


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, max_len: int | None, cut_source: bool) -> None:
    from aiayn.data.tokenizer import TokenizerPair

    _WORKER.update(tok=TokenizerPair.load(tokenizer_dir), max_len=max_len, cut=cut_source)


def _encode(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Encode and filter a chunk of pairs (in a worker, or in this process) as the in-memory path does
    (:func:`aiayn.data.corpus.clean_pairs`): the kept pairs' ids back to back, their lengths per side, and the
    counts of what was dropped."""
    tok, max_len, cut = _WORKER["tok"], _WORKER["max_len"], _WORKER["cut"]
    ids = [(tok.src.encode(s), tok.tgt.encode(t)) for s, t in pairs]
    if cut:  # summarization: a long document is cut (as the translator does at inference), not dropped
        ids = [(s[: max_len - 1], t) for s, t in ids]  # max_len is set whenever cut is
    kept, stats = clean_pairs(pairs, ids, max_len)
    out: dict[str, Any] = dict(stats)
    for k, side in enumerate(("src", "tgt")):
        seqs = [ids[i][k] for i in kept]
        out[side] = np.fromiter(chain.from_iterable(seqs), np.int64)
        out[f"{side}_lens"] = np.fromiter(map(len, seqs), np.int64, len(seqs))
    return out


def _chunks(pairs: Iterator[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    while True:
        chunk = list(islice(pairs, size))
        if not chunk:
            return
        yield chunk


@contextlib.contextmanager
def worker_pool(workers: int, init: Callable[..., None], args: tuple[Any, ...], fn: Callable[[Any], Any]
                ) -> Iterator[Callable[[Iterable[Any]], Iterator[Any]]]:
    """A function items -> ``fn(item)``, in order: in ``workers`` processes (> 1; spawned, each set up by
    ``init(*args)``: never fork a process that holds torch's threads), else in this one."""
    if workers <= 1:
        init(*args)
        yield lambda items: map(fn, items)
        return
    with multiprocessing.get_context("spawn").Pool(workers, initializer=init, initargs=args) as pool:
        yield lambda items: pool.imap(fn, items)


class Recipe:
    """One kind of store as the shared machinery sees it (:func:`prepare_store`: the lock, the staging directory,
    the manifest written last, the key), and what every kind shares: its key, the settings its manifest records, the
    manifest's head, its tokenizer, the processes that encode it. Kinds: pairs (:class:`PairRecipe`), a language
    model's token stream (:class:`~aiayn.data.stream_store.StreamRecipe`); each a dataclass of these fields."""

    cfg: Config
    inputs: dict[str, str]  # what the store is prepared from, for the key and the manifest
    tokenizer: Path | None  # a tokenizer directory to use, else the store trains one
    workers: int | None
    key: str  # sha256 of everything the store's ids depend on (:func:`store_key`), made when not given

    def kind_settings(self) -> dict[str, Any] | None:
        """Settings of this kind of store beside :func:`settings`, for the key and the manifest."""
        return None

    def __post_init__(self) -> None:
        self.key = self.key or store_key(self.cfg, self.inputs, self.tokenizer, self.kind_settings())

    def manifest_settings(self) -> dict[str, Any]:
        """The settings the manifest records (:func:`settings` and those of this kind of store)."""
        return {**settings(self.cfg), **(self.kind_settings() or {})}

    def manifest(self, kind: str, dtype: np.dtype, vocab_size: int, **rest: Any) -> dict[str, Any]:
        """The manifest to write (sealed by :func:`_build_with`): what every kind records, then ``rest``."""
        return {"version": STORE_VERSION, "key": self.key, "kind": kind, "created": now(),
                "settings": self.manifest_settings(), "inputs": self.inputs, "dtype": dtype.name,
                "vocab_size": vocab_size, **rest}

    def place_tokenizer(self, stage: Path, train: Callable[[Path], None]) -> tuple[Path, Any]:
        """``stage/tokenizer`` and its :class:`~aiayn.data.tokenizer.TokenizerPair`: a copy of the given
        ``tokenizer`` directory, else the one ``train(dir)`` writes."""
        from aiayn.data.tokenizer import TokenizerPair

        tdir = stage / "tokenizer"
        if self.tokenizer is not None:
            shutil.copytree(self.tokenizer, tdir)
        else:
            note("preparing it: training its tokenizer")
            train(tdir)
            release_free_memory()
        return tdir, TokenizerPair.load(tdir)

    def train_tokenizer_on(self, tdir: Path, src: Iterable[str], tgt: Iterable[str], what: str) -> None:
        """Train the config's tokenizer into ``tdir`` on the ``src`` and ``tgt`` texts (``what`` they are, logged)."""
        from aiayn.data.tokenizer import TokenizerSpec, tokenizer_plan, train_tokenizer_pair

        d = self.cfg.data
        log.info("training %s on %s", tokenizer_plan(d.tokenizer, d.vocab_size, d.shared_vocab), what)
        train_tokenizer_pair(src, tgt, tdir, TokenizerSpec.from_config(self.cfg))

    def worker_count(self, big: bool) -> int:
        """``workers`` when set, else every usable core for a ``big`` input (below, one process is faster)."""
        if self.workers is not None:
            return self.workers
        from aiayn.engine import usable_cores

        return usable_cores() if big else 1

    def build_into(self, stage: Path) -> dict[str, Any]:
        """Write the store's files into the empty directory ``stage``; the manifest to write (with ``key``)."""
        raise NotImplementedError

    def open(self, path: Path) -> Store:
        """Open and check the complete store in ``path``: one DataError naming the file and the fix."""
        raise NotImplementedError


def prepare(cfg: Config, out: str | Path, sources: dict[str, PairSource], inputs: dict[str, str],
            tokenizer: str | Path | None = None, workers: int | None = None, rebuild: bool = True) -> Store:
    """Tokenize ``sources`` (split -> a function streaming its pairs) into the store ``out`` and open it
    (:func:`prepare_store` of a :class:`PairRecipe`, waiting at most ``train.setup_timeout_s`` for another process
    that prepares it). ``inputs`` names what the sources read (for the key); ``tokenizer``: use this tokenizer
    directory instead of training one on a sample of the training pairs."""
    recipe = PairRecipe(cfg=cfg, sources=sources, inputs=inputs,
                        tokenizer=Path(tokenizer) if tokenizer is not None else None, workers=workers)
    return prepare_store(out, recipe, rebuild, cfg.train.setup_timeout_s)


def prepare_store(out: str | Path, recipe: Recipe, rebuild: bool = True, wait_s: float | None = None) -> Any:
    """Build ``recipe``'s store in ``out`` and open it; an existing store with the same key is opened as it is
    (checked: a damaged one is rebuilt). ``rebuild=False`` (a store the user named, ``data.prepared``): a store
    that is there is only read (:func:`open_only`: another key or any damage is one line), and only a new or empty
    directory is built.

    Safe under concurrent starts: one process builds under ``out``'s lock, the others wait for it (at most
    ``wait_s`` seconds, ``train.setup_timeout_s``: :func:`store_lock`) and open what it built. A builder writes into
    its own staging directory and moves the files in at the end, the manifest last; a failure leaves the store that
    was there (and removes ``out`` when this call created it)."""
    out, key = Path(out), recipe.key
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory (a prepared store is one); choose another directory")
    if not rebuild and out.is_dir():  # read under the shared lock (a waiter writes nothing): a store, or leftovers
        store = open_locked(out, lambda path: _named(path, recipe), wait_s)
        if store is not None:
            return store
    store = _reused(out, key, lambda path: open_locked(path, recipe.open, wait_s))  # the common case: no exclusive lock
    if store is not None:
        return store
    _refuse_foreign(out)
    with contextlib.ExitStack() as held:
        while True:
            made = _make_dirs(out)
            try:
                lock = held.enter_context(store_lock(out, False, wait_s))
                break
            except FileNotFoundError:  # a builder that had made ``out`` failed and removed it while we waited
                continue
        try:
            # built by another process while we waited?
            store = _named(out, recipe) if not rebuild else _reused(out, key, recipe.open)
            if store is not None:
                return store
            _refuse_foreign(out)
            _build_with(out, recipe, lock)
            return recipe.open(out)
        except BaseException:
            if made is not None and read_manifest(out) is None:  # nothing of this failed call stays behind
                shutil.rmtree(made, ignore_errors=True)
            raise


def _reused(out: Path, key: str, opener: Callable[[Path], Any]) -> Any:
    """The store in ``out`` opened by ``opener`` when its manifest has ``key`` and its files check out, else None
    (to be built; a damaged store is logged, then rebuilt)."""
    manifest = read_manifest(out)
    if manifest is None or manifest.get("key") != key:
        return None
    try:
        store = opener(out)
    except DataError as e:
        log.warning("%s; rebuilding it", e)
        return None
    return store if store.manifest.get("key") == key else None  # not rebuilt for other inputs while we waited


def open_only(out: Path, recipe: Recipe) -> Any:
    """Open the store ``out`` the user named (``data.prepared``) for ``recipe``, never rebuilding it: a damaged
    manifest or file, or a store of other settings or inputs (another key), is one DataError naming the store and
    the ``aiayn prepare`` command. The caller holds its lock (or there is none)."""
    manifest = opened_manifest(out)
    if manifest.get("key") != recipe.key:
        raise DataError(f"{out}: prepared from other {explain_mismatch(manifest, recipe)}: a store named by "
                        "data.prepared is only read, never rebuilt; prepare one for this config (aiayn prepare "
                        "CONFIG --out NEW_DIR, then --set data.prepared=NEW_DIR), or train with the store's settings")
    return recipe.open(out)


# How the settings a store depends on (:func:`settings`) are named in a config.
SETTING_NAMES = {"task": "task", "langs": "data.src_lang/data.tgt_lang", "seed": "train.seed"}


def explain_mismatch(manifest: dict[str, Any], recipe: Recipe) -> str:
    """``settings (data.vocab_size: 300 in the store, 512 in this config)`` or ``inputs (...)``: the first few
    differences between a store's manifest and what ``recipe`` would prepare."""
    def diff(kind: str, have: Any, want: dict[str, Any], name: Callable[[str], str]) -> str | None:
        have = have if isinstance(have, dict) else {}
        keys = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        shown = [f"{name(k)}: {have.get(k, 'none')!r} in the store, {want.get(k, 'none')!r} in this config"
                 for k in keys[:3]]
        return f"{kind} ({'; '.join(shown)}{'; ...' if len(keys) > 3 else ''})" if keys else None

    return (diff("settings", manifest.get("settings"), recipe.manifest_settings(),
                 lambda k: SETTING_NAMES.get(k, f"data.{k}"))
            or diff("inputs", manifest.get("inputs"), recipe.inputs, str)
            or "settings (its key differs: prepared with another tokenizer, or by another aiayn)")


def _named(out: Path, recipe: Recipe) -> Any:
    """A store the user named, as it is: opened (:func:`open_only`) when it has a manifest; refused when an
    unfinished build left its files (``aiayn prepare`` rebuilds it, a training does not); None when there is
    nothing yet (a new or empty directory: it is built). The caller holds its lock."""
    if (out / MANIFEST).exists():
        return open_only(out, recipe)
    left = sorted(p.name for p in out.iterdir() if p.name not in (LOCK, MARKER) and not is_temporary(p.name))
    if left and not (out / MARKER).exists():  # nothing aiayn wrote: the user's own files
        raise DataError(f"{out}: not a prepared corpus (no {MANIFEST}, and it holds {', '.join(left[:3])}"
                        f"{' ...' if len(left) > 3 else ''}, which aiayn did not write); name the directory that "
                        f"aiayn prepare CONFIG --out DIR made, or a new one")
    if left:
        raise DataError(f"{out}: an incomplete store (no {MANIFEST}, but {', '.join(left[:3])}"
                        f"{' ...' if len(left) > 3 else ''}): its preparing never finished; a store named by "
                        f"data.prepared is never rebuilt by a training: aiayn prepare CONFIG --out {out} prepares it")
    return None


def _make_dirs(out: Path) -> Path | None:
    """Create ``out`` (and its missing parents); the topmost directory this call created, None if it existed."""
    top = None
    for p in (out, *out.parents):
        if p.exists():
            break
        top = p
    try:
        out.mkdir(parents=True)
    except FileExistsError:
        return None
    return top


def _refuse_foreign(out: Path) -> None:
    """Refuse a non-empty directory that is not a store (no manifest, no marker): preparing would write into it."""
    if not out.is_dir() or read_manifest(out) is not None or (out / MARKER).exists():
        return
    if any(p.name != LOCK for p in out.iterdir()):
        raise DataError(f"{out}: exists and is not a prepared corpus; choose an empty or new directory")


# The lock of the store this process builds now: what it is doing is written there (:func:`note`), for the
# processes that wait on it (and name it when they give up).
_BUILDING: list[HeldLock] = []


def note(doing: str) -> None:
    """Say what the build of a store is doing now (training its tokenizer, encoding a split) in its lock file."""
    for lock in _BUILDING:
        lock.doing(doing)


def _build_with(out: Path, recipe: Recipe, lock: HeldLock | None = None) -> None:
    """Build the store in a staging directory inside ``out`` (this builder's own: no other writer's temporaries
    can mix with it) and move it in, the manifest last, with the checksum of every file and its own
    (:func:`~aiayn.data.integrity.seal`). The caller holds ``out``'s exclusive lock (``lock``: where :func:`note`
    writes what the build is doing)."""
    (out / MARKER).write_text("a token store prepared by aiayn (aiayn prepare): aiayn may rebuild this directory\n")
    for p in out.iterdir():  # what a killed builder left: no process writes there now (we hold the lock)
        if is_temporary(p.name):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".build.", suffix=TMP_SUFFIX, dir=out))
    _BUILDING[:] = [lock] if lock is not None else []
    try:
        note("preparing it: reading the corpus")
        manifest = recipe.build_into(stage)
        note("preparing it: writing the checksums of its files")
        manifest = seal(manifest, stage)
        (out / MANIFEST).unlink(missing_ok=True)  # from here until the manifest is written, the store is incomplete
        if (out / "tokenizer").exists():
            shutil.rmtree(out / "tokenizer")
        for p in stage.iterdir():
            os.replace(p, out / p.name)
        atomic_write_json(out / MANIFEST, manifest)  # last: its presence marks a complete store
        note("opening it")
    finally:
        _BUILDING.clear()
        shutil.rmtree(stage, ignore_errors=True)
        release_free_memory()


def storage_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary: uint16, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). Training a
    tokenizer and encoding a corpus free memory that the C allocator would otherwise keep for the process, which then
    trains for hours with it resident (``benchmarks.rss_timeline`` shows it, BENCHMARKS.md "The data path")."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def now() -> str:
    """The manifest's creation time, UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass(kw_only=True)
class PairRecipe(Recipe):
    """A store of (source, target) pairs from ``sources`` (split -> a function streaming its pairs), named for
    the key by ``inputs``; ``tokenizer``: a tokenizer directory to use, else one is trained on a sample of the
    training pairs (``train_tokenizer(dir)`` when given: summarization as language modelling trains its own
    way). Pairs with an empty side are dropped; so are pairs longer than the config's ``max_len`` unless
    ``length_filter`` is off (then no pair is cut or dropped for its length), or ``cut_sources`` cuts a source too
    long to fit (a summarizer's documents: :data:`aiayn.data.pipeline.DOCUMENTS`). ``extra``: settings of this kind of
    pair store for the key and the manifest."""

    cfg: Config
    sources: dict[str, PairSource]
    inputs: dict[str, str]
    tokenizer: Path | None = None
    workers: int | None = None
    train_tokenizer: Callable[[Path], None] | None = None
    length_filter: bool = True
    cut_sources: bool = False
    extra: dict[str, Any] | None = None
    key: str = ""

    def kind_settings(self) -> dict[str, Any] | None:
        return self.extra

    def open(self, path: Path) -> Store:
        return open_pairs(path, tuple(self.sources))

    def _train(self, tdir: Path) -> None:
        """The default tokenizer: two passes over the training pairs (sources, then targets), a sample of each,
        never the corpus in memory."""
        train = self.sources["train"]
        self.train_tokenizer_on(tdir, (s for s, _ in train()), (t for _, t in train()),
                                f"a sample of at most {self.cfg.data.tokenizer_sample:,} sentences")

    def build_into(self, stage: Path) -> dict[str, Any]:
        """Train or copy the tokenizer and encode every split into ``stage``; the manifest to write."""
        cfg = self.cfg
        # Every input read through once before any work: a malformed file (parallel files of other lengths, a bad
        # TSV row or JSON line, bad UTF-8) is one line now, not after the tokenizer's training; the counts give the
        # encoding's progress a total.
        counts = {name: sum(1 for _ in source()) for name, source in self.sources.items()}
        tdir, tok = self.place_tokenizer(stage, self.train_tokenizer or self._train)
        vocab = max(tok.src.vocab_size, tok.tgt.vocab_size)
        dtype = storage_dtype(vocab)
        max_len = (cfg.data.max_len or cfg.model.max_positions) if self.length_filter else None
        big = sum(os.path.getsize(p) for p in self.inputs if os.path.isfile(p)) >= PARALLEL_BYTES
        workers = self.worker_count(big)
        splits: dict[str, Any] = {}
        cut = self.cut_sources and max_len is not None
        with worker_pool(workers, _init_worker, (str(tdir), max_len, cut), _encode) as encode:
            for name, source in self.sources.items():
                note(f"preparing it: encoding its {name} split")
                writer = _Writer(stage, name, dtype)
                progress = ItemProgress(counts[name], "pair", f"prepare {name}")
                for encoded in encode(_chunks(source(), CHUNK)):
                    writer.add(encoded)
                    progress.update(encoded["kept"] + encoded["empty"] + encoded["too_long"])
                progress.close()
                splits[name] = writer.close()
                if not splits[name]["pairs"]:
                    raise DataError(f"{name}: no usable pairs left after dropping empty and too-long ones")
        return self.manifest(PAIRS, dtype, vocab, src_vocab_size=tok.src.vocab_size,
                             tgt_vocab_size=tok.tgt.vocab_size, splits=splits)
