"""The token store: a corpus tokenized once into flat files of token ids, read by position by any number of runs and
torchrun ranks (``aiayn prepare CONFIG --out DIR``, or the first ``aiayn train``). One store, two kinds:

    DIR/manifest.json           kind, inputs, settings, counts, every file's sha256 and its own (written last)
    DIR/tokenizer/              the tokenizer the ids belong to (trained on a sample of the corpus, or given)
    DIR/<split>.<side>.bin,idx  pairs: a side's (src, tgt) kept ids back to back (uint16, or uint32), int64 offsets
    DIR/<split>.bin             stream: a language model's text as one run of ids (:mod:`aiayn.data.stream_store`)
    DIR/.aiayn-store            marker: aiayn made this directory and may rebuild it
    DIR/.aiayn-store.lock       flock: exclusive while one process builds, shared while one opens

Every kind shares the key and the build (:class:`Recipe`, :func:`prepare_store`), the id files (:class:`IdWriter`,
:class:`IdFile`) and their opening (:func:`open_kind`); a kind gives its id files and counts (:data:`KINDS`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import KW_ONLY, dataclass
from functools import partial, reduce
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import Config
from aiayn.data.corpus import clean_pairs
from aiayn.data.integrity import MANIFEST, Memo, check_files, check_ids, load_manifest, open_regular, seal
from aiayn.data.tokenizer import TokenizerPair, TokenizerSpec, tokenizer_files, tokenizer_plan, train_tokenizer_pair
from aiayn.engine import release_free_memory, worker_pool
from aiayn.errors import DataError, PeerError
from aiayn.files import (
    STORE_MARKER,
    TMP_SUFFIX,
    HeldLock,
    LockTimeout,
    atomic_write_json,
    cache_dir,
    file_lock,
    is_temporary,
    now,
    os_errors_named,
    sha256_file,
)
from aiayn.progress import ItemProgress

log = logging.getLogger("aiayn.data")

STORE_VERSION = 1  # bump when preparing produces other ids from the same inputs
MARKER = STORE_MARKER  # written first and kept: a directory without a manifest but with it may be rebuilt
LOCK = ".aiayn-store.lock"  # flock: exclusive while one process builds, shared while one opens
CHUNK = 20_000  # pairs encoded per task
PARALLEL_BYTES = 32 << 20  # inputs this big (pairs: in characters) are encoded by processes (below, one is faster)
PAIRS = "pairs"  # the manifest's kind of a store of (source, target) pairs (a manifest without a kind is one)
STREAM_KIND = "stream"  # the manifest's kind of a language model's token stream (aiayn.data.stream_store)

PairSource = Callable[[], Iterator[tuple[str, str]]]  # a fresh stream of (source, target) texts each call
IdOpener = Callable[..., Any]  # (split, make, vocab_size) -> the id file ``make()``, checked
# How the settings a store depends on (:func:`settings`) are named in a config.
SETTING_NAMES = {"task": "task", "langs": "data.src_lang/data.tgt_lang", "seed": "train.seed"}
_BUILDING: list[HeldLock] = []  # the lock of the store this process builds, where :func:`note` writes


class IdFile:
    """A flat file of ``tokens`` ids, read by position with ``pread``, never mapped (a lasting mapping read at random
    keeps every page it touched resident: BENCHMARKS.md, "The data path"); pickles as what it was opened from."""

    by = ("manifest needs", "manifest says")  # what states its length, in its messages

    def __init__(self, path: Path, dtype: np.dtype | str, tokens: int) -> None:
        self.path, self.dtype, self.tokens = Path(path), np.dtype(dtype).newbyteorder("<"), tokens
        self._args = (path, self.dtype.str, tokens)
        self._fd = open_regular(self.path)

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return type(self), self._args

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # AttributeError: never opened
            os.close(self._fd)

    def check(self, vocab_size: int, files: dict[str, str] | None, memo: Memo) -> str | None:
        """What is wrong with the file, None when nothing: its length, then its ids and checksum (``check_ids``)."""
        need = self.tokens * self.dtype.itemsize
        if (held := os.fstat(self._fd).st_size) != need:
            return f"{self.path.name}: {held:,} bytes where its {self.by[0]} {need:,} (truncated or damaged)"
        return check_ids(self._fd, self.path, self.dtype, self.tokens, vocab_size, files, memo)

    def _read_into(self, buf: np.ndarray, starts: list[int], sizes: list[int]) -> np.ndarray:
        """``buf`` filled with the runs of ``sizes`` ids at ``starts``, back to back (one ``preadv`` a run); int64."""
        view, at, size = memoryview(buf.reshape(-1)).cast("B"), 0, self.dtype.itemsize  # flat: (1, 0) casts too
        for start, n in zip(starts, sizes):
            n *= size
            if n and os.preadv(self._fd, [view[at : at + n]], start * size) != n:
                raise DataError(f"{self.path}: shorter than its {self.by[1]} (truncated while read?)")
            at += n
        return buf.astype(np.int64)


class Stream(IdFile):
    """A split of a stream, read by windows."""

    def __len__(self) -> int:
        return self.tokens

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """ids[start:stop] (n,) int64; a range outside the stream, or backwards, is refused."""
        stop = self.tokens if stop is None else stop
        if not 0 <= start <= stop <= self.tokens:
            raise IndexError(f"ids {start}..{stop} of {self.tokens}")
        return self.windows(np.array([start]), stop - start)[0]

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """(B, width) int64: row b is ids[starts[b] : starts[b] + width]."""
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) and (int(starts.min()) < 0 or int(starts.max()) + width > self.tokens):
            raise IndexError(f"windows of {width} at {int(starts.min())}..{int(starts.max())} of {self.tokens}")
        return self._read_into(np.empty((len(starts), width), dtype=self.dtype), starts.tolist(), [width] * len(starts))


class Side(IdFile):
    """One side of a split of pairs: its ids, and its offsets (pairs + 1,) in memory (8 bytes a pair)."""

    by = ("offsets need", "offsets")

    def __init__(self, ids: Path, offsets: Path, dtype: np.dtype | str, pairs: int) -> None:
        self.offsets_path, size = offsets, (pairs + 1) * 8
        with os.fdopen(open_regular(offsets), "rb") as f:
            held = os.fstat(f.fileno()).st_size  # before reading: a manifest's count may be past any file's size
            data = f.read(size + 1) if held == size else b""
        if held != size or len(data) != size:
            raise DataError(f"{offsets}: holds {held:,} bytes where its manifest says {size:,} ({pairs:,} pairs)")
        self.offsets = np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)  # (pairs + 1,) a view
        super().__init__(ids, dtype, int(self.offsets[-1]))
        self._args = (ids, offsets, self.dtype.str, pairs)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def check(self, vocab_size: int, files: dict[str, str] | None, memo: Memo) -> str | None:
        o = self.offsets
        if o[0] != 0 or bool((o[1:] < o[:-1]).any()):
            return f"{self.offsets_path.name}: its offsets are not non-decreasing from 0"
        return super().check(vocab_size, files, memo)

    def lengths(self) -> np.ndarray:
        """(pairs,) int32: the token count of every pair (no specials)."""
        out = np.empty(len(self), dtype=np.int32)
        np.subtract(self.offsets[1:], self.offsets[:-1], out=out, casting="unsafe")  # no int64 copy on the way
        return out

    def __getitem__(self, i: int) -> list[int]:
        return self.gather(np.array([i]))[0].tolist()

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids of the pairs ``indices`` (B,) back to back, int64, and their lengths (B,): one ``preadv`` per
        run of pairs that follow each other in the file (read, not mapped: ``benchmarks.data_scale``)."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"pairs {int(idx.min())}..{int(idx.max())} of {len(self)}")
        starts, ends = self.offsets[idx], self.offsets[idx + 1]
        lens = ends - starts
        first = np.flatnonzero(np.concatenate(([True], starts[1:] != ends[:-1]))) if len(idx) else idx  # run starts
        reads = np.add.reduceat(lens, first) if len(idx) else lens
        return self._read_into(np.empty(int(lens.sum()), self.dtype), starts[first].tolist(), reads.tolist()), lens


@dataclass(frozen=True)
class Split:
    """A split of pairs: the source and target sides of its kept pairs."""

    src: Side
    tgt: Side

    def __len__(self) -> int:
        return len(self.src)

    def pairs(self, indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """The id lists of the pairs ``indices`` (source, target)."""
        return [self.src[i] for i in indices], [self.tgt[i] for i in indices]


@dataclass(frozen=True)
class Store:
    """An opened store of any kind: its directory, its manifest and its splits (:class:`Split` or :class:`Stream`)."""

    path: Path
    manifest: dict[str, Any]
    splits: dict[str, Any]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"


def settings(cfg: Config) -> dict[str, Any]:
    """The config values the prepared ids depend on (the tokenizer's training, the filtering, the cutting)."""
    d = cfg.data
    return {"task": cfg.task, "max_len": d.max_len or cfg.model.max_positions, "tokenizer": d.tokenizer,
            "vocab_size": d.vocab_size, "shared_vocab": d.shared_vocab, "byte_fallback": d.byte_fallback,
            "lowercase": d.lowercase, "pretokenize": d.pretokenize, "langs": [d.src_lang, d.tgt_lang],
            "tokenizer_sample": d.tokenizer_sample, "seed": cfg.train.seed}


def cached_store_dir(key: str) -> Path:
    """The store of every training of ``key`` that names no ``data.prepared`` (``$AIAYN_CACHE_DIR``: ~/.cache/aiayn)."""
    return cache_dir() / "stores" / key[:24]


def describe_store(manifest: dict[str, Any]) -> list[str]:
    """One line per split of an opened store (its kind checked): its pairs (or a stream's tokens) and their dtype."""
    line = KINDS[manifest.get("kind", PAIRS)].line
    return [f"{name}: {line.format(**info)} ({manifest['dtype']})" for name, info in manifest["splits"].items()]


def tokenizer_digest(d: Path) -> dict[str, str]:
    """``{name: sha256}`` of a tokenizer directory's files (the key of a store given it; two compared)."""
    return {p.name: sha256_file(p) for p in tokenizer_files(d)}


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a complete store, None when there is none or it cannot be trusted (then a cache rebuilds)."""
    with contextlib.suppress(DataError):
        return load_manifest(directory, STORE_VERSION)
    return None


def damaged(path: Path, problem: str) -> DataError:
    """The one line of a damaged store ``path``: ``problem`` (naming the file) and the fix."""
    return DataError(f"{problem}: rebuild it: aiayn prepare CONFIG --out {path} (CONFIG: the recipe it was prepared "
                     "from)")


def opened_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest of the store ``path``, else one DataError (not prepared; or the problem and the fix)."""
    if not (path / MANIFEST).exists():
        raise DataError(f"{path}: not a prepared corpus (no readable {MANIFEST}): aiayn prepare CONFIG --out {path} "
                        "prepares it")
    try:
        return load_manifest(path, STORE_VERSION)
    except DataError as e:
        raise damaged(path, str(e)) from None


def _pair_split(id_file: IdOpener, path: Path, m: dict[str, Any], name: str) -> Split:
    return Split(*(id_file(name, partial(Side, path / f"{name}.{side}.bin", path / f"{name}.{side}.idx", m["dtype"],
                                         m["splits"][name]["pairs"]), int(m.get(f"{side}_vocab_size", m["vocab_size"])))
                   for side in ("src", "tgt")))


def _stream_split(id_file: IdOpener, path: Path, m: dict[str, Any], name: str) -> Stream:
    return id_file(name, partial(Stream, path / f"{name}.bin", m["dtype"], m["splits"][name]["tokens"]),
                   m["vocab_size"])


@dataclass(frozen=True)
class Kind:
    """What a kind adds to the shared store: how its manifest is checked and described, and how a split opens."""

    count: str  # what its manifest counts per split
    splits: tuple[str, ...]  # the splits it always holds (none: those its manifest names)
    noun: str  # what it holds
    bad: tuple[str, str]  # its dtype or vocabulary sizes are wrong; its splits are
    line: str  # a split, described
    open_split: Callable[[IdOpener, Path, dict[str, Any], str], Any]  # a split opened, its id files checked


KINDS = {PAIRS: Kind("pairs", (), "(source, target) pairs", ("its dtype or vocabulary sizes are missing or wrong",
                                                              "its splits are missing or malformed"),
                     "{pairs:,} pairs, {src_tokens:,} source + {tgt_tokens:,} target tokens", _pair_split),
         STREAM_KIND: Kind("tokens", ("train", "valid"), "a language model's token stream",
                           ("its dtype, vocabulary size or splits are missing or wrong",) * 2, "{tokens:,} tokens",
                           _stream_split)}


def _manifest_problem(m: dict[str, Any], kind: str, need: tuple[str, ...]) -> str | None:
    """What makes a manifest unusable as a store of ``kind`` holding the splits ``need``, None when nothing."""
    have = m.get("kind", PAIRS)
    if not isinstance(have, str) or have not in KINDS:  # any JSON value (a list is no dictionary key)
        return f"its kind {have!r} is none that this aiayn reads ({', '.join(KINDS)})"
    k, splits = KINDS[kind], m.get("splits")
    if have != kind:
        return f"holds a {have!r} store, not {k.noun}"
    sizes = [m.get(s, 1) for s in ("src_vocab_size", "tgt_vocab_size")] + [m.get("vocab_size")]
    if m.get("dtype") not in ("uint16", "uint32") or not all(isinstance(v, int) for v in sizes):
        return k.bad[0]
    if not isinstance(splits, dict) or not all(isinstance(splits.get(n), dict) and isinstance(
            splits[n].get(k.count), int) and splits[n][k.count] >= 0 for n in k.splits or splits):
        return k.bad[1]
    if "files" in m and not isinstance(m["files"], dict):
        return "its list of files is malformed"
    missing = [n for n in need if n not in splits]
    return f"names no {', '.join(missing)} split" if missing else None


def open_kind(path: Path, kind: str | None = None, need: tuple[str, ...] = (), memo: Memo | None = None) -> Store:
    """Open and check the store in ``path`` (its lock held, or none exists) as a ``kind`` (None: its manifest's)
    holding the splits ``need``: its id files by length, ids and checksum, the others by checksum (none: logged as
    unverified), those ``memo`` knows unchanged since found good skipped (None: the store's own :class:`Memo`); one
    DataError naming the file and the fix."""
    manifest = opened_manifest(path)
    kind = kind or manifest.get("kind", PAIRS)
    if (wrong := _manifest_problem(manifest, kind, need)) is not None:
        raise damaged(path, f"{path / MANIFEST}: {wrong}")
    files, memo, checked = manifest.get("files"), memo or Memo(path), set()

    def id_file(split: str, make: Callable[[], IdFile], vocab_size: int) -> Any:
        try:
            opened = make()
        except FileNotFoundError as e:
            raise damaged(path, f"{e.filename}: missing (the manifest names split {split})") from None
        except OSError as e:
            raise damaged(path, f"{e.filename or path}: unreadable ({e.strerror or e})") from None
        except DataError as e:  # not a regular file (open_regular), offsets of another size (Side)
            raise damaged(path, str(e)) from None
        if (problem := opened.check(vocab_size, files, memo)) is not None:
            raise damaged(path, f"{path}/{problem}")
        checked.add(opened.path.name)
        return opened

    splits = {name: KINDS[kind].open_split(id_file, path, manifest, name)
              for name in KINDS[kind].splits or manifest["splits"]}
    if not isinstance(files, dict):
        log.warning("%s: prepared without checksums (by an older aiayn): its shape and ids are checked, its "
                    "contents unverified; aiayn prepare into a new directory gives a verified store", path)
    elif problems := check_files(path, files, memo, skip=checked):
        raise damaged(path, f"{path}/{problems[0]}")
    tokenizer = path / "tokenizer" / "tokenizer.json"
    if not tokenizer.is_file():
        raise damaged(path, f"{tokenizer}: missing (the store's tokenizer)")
    memo.save()
    return Store(path, manifest, splits)


def open_store(directory: str | Path, need: tuple[str, ...] = (), wait_s: float | None = None) -> Store:
    """:func:`open_kind` of the pairs store in ``directory`` under its shared lock (waited for at most ``wait_s``)."""
    return open_locked(Path(directory), lambda path: open_kind(path, PAIRS, need), wait_s)


@contextlib.contextmanager
def store_lock(path: Path, shared: bool, wait_s: float | None) -> Iterator[HeldLock]:
    """The lock of the store ``path``, waited for at most ``wait_s`` seconds (``train.setup_timeout_s``; None: as
    long as it takes), then one line (PeerError) naming the process that holds it, what it does, and the setting."""
    limit = f" (at most train.setup_timeout_s={wait_s:g} s)" if wait_s is not None else ""
    waiting = lambda who: log.info("%s: waiting for the process (pid %s) that prepares it%s", path, who, limit)
    try:
        with file_lock(path / LOCK, shared=shared, waiting=waiting, timeout_s=wait_s,
                       doing="preparing it: looking at what is there") as held:
            yield held
    except LockTimeout as e:
        raise PeerError(f"{path}: waited train.setup_timeout_s={e.waited_s:g} s for the process that prepares this "
                        f"store, {e.holder.describe()}; or raise train.setup_timeout_s, or prepare the store before "
                        "training (aiayn prepare CONFIG --out DIR, then --set data.prepared=DIR)") from None


def open_locked(path: Path, opener: Callable[[Path], Any], wait_s: float | None = None) -> Any:
    """``opener(path)`` under the store's shared lock (never while a builder replaces its files); a directory
    without a lock file (no store, or an older one) is opened as it is."""
    if not (path / LOCK).is_file():
        return opener(path)
    try:
        with store_lock(path, True, wait_s):
            return opener(path)
    except FileNotFoundError:  # the directory went while this waited: a failed build removed it
        raise DataError(f"{path}: not a prepared corpus (removed while this process waited for it)") from None


@dataclass
class Recipe:
    """How to build a store of one kind, and what every kind shares: the key, the manifest, the tokenizer, the
    processes that encode. A kind adds ``inputs`` (what it is prepared from, for the key and the manifest)."""

    kind = PAIRS
    cfg: Config
    _: KW_ONLY
    tokenizer: Path | None = None  # a tokenizer directory to use, else the store trains one
    workers: int | None = None
    key: str = ""  # sha256 of everything the store's ids depend on, made when not given
    extra: dict[str, Any] | None = None  # :meth:`kind_settings` where a kind does not say

    def kind_settings(self) -> dict[str, Any] | None:
        """Settings of this kind of store beside :func:`settings`, for the key and the manifest."""
        return self.extra

    def __post_init__(self) -> None:
        """The key, when not given: sha256 of the version, the settings (with a given tokenizer: its files, the task
        and max_len), the inputs' identities and the kind's settings."""
        if self.key:
            return
        parts: dict[str, Any] = {"version": STORE_VERSION, "settings": settings(self.cfg), "inputs": self.inputs}
        if self.tokenizer is not None:
            parts["tokenizer"] = tokenizer_digest(self.tokenizer)
            parts["settings"] = {k: v for k, v in parts["settings"].items() if k in ("task", "max_len")}
        parts["settings"].update(self.kind_settings() or {})
        self.key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def manifest_settings(self) -> dict[str, Any]:
        return {**settings(self.cfg), **(self.kind_settings() or {})}

    def manifest(self, dtype: np.dtype, vocab_size: int, **rest: Any) -> dict[str, Any]:
        """The manifest to write (sealed by :func:`_build_with`): what every kind records, then ``rest``."""
        return {"version": STORE_VERSION, "key": self.key, "kind": self.kind, "created": now(),
                "settings": self.manifest_settings(), "inputs": self.inputs, "dtype": dtype.name,
                "vocab_size": vocab_size, **rest}

    def place_tokenizer(self, stage: Path, train: Callable[[Path], None]) -> tuple[Path, TokenizerPair]:
        """``stage/tokenizer`` and its TokenizerPair: a copy of ``tokenizer``, else the one ``train(dir)`` writes."""
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
        d = self.cfg.data
        log.info("training %s on %s", tokenizer_plan(d.tokenizer, d.vocab_size, d.shared_vocab), what)
        train_tokenizer_pair(src, tgt, tdir, TokenizerSpec.from_config(self.cfg))

    def build_into(self, stage: Path) -> dict[str, Any]:
        """Write the store's files into the empty directory ``stage``; the manifest to write."""
        raise NotImplementedError

    def open(self, path: Path) -> Store:
        return open_kind(path, self.kind)


def prepare_store(out: str | Path, recipe: Recipe, rebuild: bool = True, wait_s: float | None = None) -> Any:
    """Build ``recipe``'s store in ``out`` and open it; a store of its key is opened as it is (a damaged one
    rebuilt). ``rebuild=False`` (``data.prepared``): a store there is only read (:func:`open_only`), only a new or
    empty directory built. One process builds, under the lock; the others wait at most ``wait_s`` and open it; a
    failure leaves the store that was there (and removes ``out`` when this call created it)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory (a prepared store is one); choose another directory")
    found = partial(_reused if rebuild else _named, recipe=recipe)  # what is there, opened (under its lock), or None
    if out.is_dir() and (store := open_locked(out, found, wait_s)) is not None:  # the common case: no exclusive lock
        return store
    _refuse_foreign(out)
    with contextlib.ExitStack() as held:
        while True:
            made = _make_dirs(out)
            with contextlib.suppress(FileNotFoundError):  # a failed builder removed ``out`` meanwhile: made again
                lock = held.enter_context(store_lock(out, False, wait_s))
                break
        try:
            return found(out) or _build_with(out, recipe, lock)  # built by another process while we waited?
        except BaseException:
            if made is not None and read_manifest(out) is None:  # nothing of this failed call stays behind
                shutil.rmtree(made, ignore_errors=True)
            raise


def _reused(out: Path, recipe: Recipe) -> Any:
    """The store in ``out`` when it has ``recipe``'s key and checks out, else None (to be built; damage logged)."""
    if (read_manifest(out) or {}).get("key") != recipe.key:
        return None
    try:
        store = recipe.open(out)
    except DataError as e:
        log.warning("%s; rebuilding it", e)
        return None
    return store if store.manifest.get("key") == recipe.key else None  # not rebuilt for other inputs meanwhile


def open_only(out: Path, recipe: Recipe) -> Any:
    """Open the store ``out`` the user named (``data.prepared``) for ``recipe``, never rebuilding it: damage or
    another key is one DataError naming the store and the ``aiayn prepare`` command. The caller holds its lock."""
    manifest = opened_manifest(out)
    if manifest.get("key") != recipe.key:
        raise DataError(f"{out}: prepared from other {explain_mismatch(manifest, recipe)}: a store named by "
                        "data.prepared is only read, never rebuilt; prepare one for this config (aiayn prepare "
                        "CONFIG --out NEW_DIR, then --set data.prepared=NEW_DIR), or train with the store's settings")
    return recipe.open(out)


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
    """A store the user named, as it is: opened when it has a manifest; refused when an unfinished build or the
    user left files there; None when there is nothing yet. The caller holds its lock."""
    if (out / MANIFEST).exists():
        return open_only(out, recipe)
    left = sorted(p.name for p in out.iterdir() if p.name not in (LOCK, MARKER) and not is_temporary(p.name))
    if not left:
        return None
    shown = f"{', '.join(left[:3])}{' ...' if len(left) > 3 else ''}"
    if not (out / MARKER).exists():  # nothing aiayn wrote: the user's own files
        raise DataError(f"{out}: not a prepared corpus (no {MANIFEST}, and it holds {shown}, which aiayn did not "
                        "write); name the directory that aiayn prepare CONFIG --out DIR made, or a new one")
    raise DataError(f"{out}: an incomplete store (no {MANIFEST}, but {shown}): its preparing never finished; a store "
                    f"named by data.prepared is never rebuilt by a training: aiayn prepare CONFIG --out {out} prepares "
                    "it")


def _make_dirs(out: Path) -> Path | None:
    """Create ``out`` (and its missing parents); the topmost directory this call created, None if it existed."""
    top = next((p for p in reversed((out, *out.parents)) if not p.exists()), None)
    with contextlib.suppress(FileExistsError):
        out.mkdir(parents=True)
        return top
    return None


def _refuse_foreign(out: Path) -> None:
    """Refuse a non-empty directory that is not a store (no manifest, no marker): preparing would write into it."""
    if not out.is_dir() or read_manifest(out) is not None or (out / MARKER).exists():
        return
    if any(p.name != LOCK for p in out.iterdir()):
        raise DataError(f"{out}: exists and is not a prepared corpus; choose an empty or new directory")


def note(doing: str) -> None:
    """Say what the build of a store is doing now (training its tokenizer, encoding a split) in its lock file."""
    for lock in _BUILDING:
        lock.doing(doing)


def _build_with(out: Path, recipe: Recipe, lock: HeldLock | None = None) -> Store:
    """Build the store in this builder's own staging directory inside ``out`` and move it in, the sealed manifest
    last; then open it. The caller holds ``out``'s exclusive lock (``lock``, where :func:`note` writes)."""
    _refuse_foreign(out)
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
    return recipe.open(out)


def storage_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary: uint16, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)


class IdWriter:
    """An id file of either kind being written into the staging directory: runs of ids appended as ``dtype``
    (little-endian) and counted (``tokens``); with ``offsets`` (a side of pairs), the int64 offsets of the pairs
    whose lengths ``add`` is given are written there at the close. A failed write (a full disk) names the file."""

    def __init__(self, path: Path, dtype: np.dtype, offsets: Path | None = None) -> None:
        self.path, self.dtype, self.offsets, self.tokens = path, dtype.newbyteorder("<"), offsets, 0
        self.lengths: list[np.ndarray] = [np.zeros(1, np.int64)]  # offsets: the running sum of [0, every length]
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close)

    def add(self, ids: np.ndarray, lengths: np.ndarray | None = None) -> None:
        """Append ``ids`` (n,), of any integer dtype; those of pairs of ``lengths`` (pairs,) (summing to n)."""
        with os_errors_named(self.path):
            self.file.write(ids.astype(self.dtype, copy=False).tobytes())
        self.tokens += len(ids)
        if lengths is not None:
            self.lengths.append(lengths)

    def close(self) -> None:
        with os_errors_named(self.path):  # what is still buffered is written here
            self.file.close()
        if self.offsets is not None:
            with os_errors_named(self.offsets):
                np.concatenate(self.lengths).cumsum().astype("<i8").tofile(self.offsets)  # (pairs + 1,)


class PairEncoder:
    """Encodes and filters chunks of pairs as :func:`~aiayn.data.corpus.clean_pairs` does; ``cut``: a long
    document (summarization) is cut to ``max_len``, as the translator cuts it, not dropped."""

    def __init__(self, tokenizer_dir: str, max_len: int | None, cut: bool) -> None:
        self.tok, self.max_len, self.cut = TokenizerPair.load(tokenizer_dir), max_len, cut and max_len is not None

    def __call__(self, pairs: list[tuple[str, str]]) -> dict[str, Any]:
        """The kept pairs' ids back to back and their lengths, per side; the counts of what was dropped."""
        tok, max_len = self.tok, self.max_len
        ids = [(tok.src.encode(s), tok.tgt.encode(t)) for s, t in pairs]
        if self.cut:
            ids = [(s[: max_len - 1], t) for s, t in ids]  # max_len is set whenever cut is (__init__)
        kept, stats = clean_pairs(pairs, ids, max_len)
        out: dict[str, Any] = dict(stats)
        for k, side in enumerate(("src", "tgt")):
            seqs = [ids[i][k] for i in kept]
            out[side] = np.fromiter(chain.from_iterable(seqs), np.int64)
            out[f"{side}_lens"] = np.fromiter(map(len, seqs), np.int64, len(seqs))
        return out


@dataclass(kw_only=True)
class PairRecipe(Recipe):
    """The pairs of ``sources`` (split -> a function streaming them), named for the key by ``inputs``; a tokenizer
    is trained on a sample of the training pairs (by ``train_tokenizer(dir)`` when given). Pairs with an empty side
    are dropped, and those past ``max_len`` unless ``length_filter`` is off, or ``cut_sources`` cuts a source too
    long to fit (a summarizer's documents: :data:`aiayn.data.pipeline.DOCUMENTS`)."""

    sources: dict[str, PairSource]
    inputs: dict[str, str]
    train_tokenizer: Callable[[Path], None] | None = None
    length_filter: bool = True
    cut_sources: bool = False

    def open(self, path: Path) -> Store:
        return open_kind(path, PAIRS, tuple(self.sources))

    def _train(self, tdir: Path) -> None:  # two passes over the training pairs, a sample of each side
        train = self.sources["train"]
        self.train_tokenizer_on(tdir, (s for s, _ in train()), (t for _, t in train()),
                                f"a sample of at most {self.cfg.data.tokenizer_sample:,} sentences")

    def build_into(self, stage: Path) -> dict[str, Any]:
        # Every input read through once first: a malformed file is one line now, not after the tokenizer's training;
        # the counts give the progress a total, the characters read its processes (a dataset's inputs are no files).
        sizes = {name: reduce(lambda n, pair: (n[0] + 1, n[1] + len(pair[0]) + len(pair[1])), source(), (0, 0))
                 for name, source in self.sources.items()}  # (pairs, characters)
        tdir, tok = self.place_tokenizer(stage, self.train_tokenizer or self._train)
        vocab = max(tok.src.vocab_size, tok.tgt.vocab_size)
        dtype = storage_dtype(vocab)
        max_len = (self.cfg.data.max_len or self.cfg.model.max_positions) if self.length_filter else None
        big = sum(chars for _, chars in sizes.values()) >= PARALLEL_BYTES
        splits: dict[str, Any] = {}
        with worker_pool(self.workers, big, PairEncoder, (str(tdir), max_len, self.cut_sources)) as encode:
            for name, source in self.sources.items():
                note(f"preparing it: encoding its {name} split")
                sides = {side: IdWriter(stage / f"{name}.{side}.bin", dtype, stage / f"{name}.{side}.idx")
                         for side in ("src", "tgt")}
                stats = {"empty": 0, "too_long": 0, "kept": 0}
                progress = ItemProgress(sizes[name][0], "pair", f"prepare {name}")
                chunks = iter(lambda pairs=source(): list(islice(pairs, CHUNK)), [])  # CHUNK pairs a list, to the end
                for encoded in encode(chunks):
                    for side, ids in sides.items():
                        ids.add(encoded[side], encoded[f"{side}_lens"])
                    stats = {k: n + encoded[k] for k, n in stats.items()}
                    progress.update(sum(encoded[k] for k in stats))
                progress.close()
                for ids in sides.values():
                    ids.close()
                if not stats["kept"]:
                    raise DataError(f"{name}: no usable pairs left after dropping empty and too-long ones")
                splits[name] = {"pairs": stats["kept"], "stats": stats,
                                **{f"{side}_tokens": ids.tokens for side, ids in sides.items()}}
        return self.manifest(dtype, vocab, src_vocab_size=tok.src.vocab_size, tgt_vocab_size=tok.tgt.vocab_size,
                             splits=splits)
