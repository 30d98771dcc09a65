"""Prepared corpora: a translation corpus tokenized once into flat, memory-mapped arrays of token ids, read lazily
by any number of runs and torchrun ranks (``aiayn prepare CONFIG --out DIR``, or the first ``aiayn train``).

    DIR/manifest.json          what the store holds and from what: inputs, settings, tokenizer, counts (written last)
    DIR/tokenizer/             the tokenizer the ids belong to (trained on a sample of the corpus, or given)
    DIR/<split>.src.bin        every kept pair's source ids back to back (uint16 when the vocabulary fits, else uint32)
    DIR/<split>.src.idx        int64 offsets into it, one more than the pairs (pair i is ids[idx[i]:idx[i + 1]])
    DIR/<split>.tgt.bin / .idx the same for the target side

Raw little-endian arrays whose dtype and length the manifest states, each pair read by position (``pread``): no
pickle, and only the offsets' differences (the pair lengths the batches are planned from) live in memory while
training. Not memory-mapped: the pages of a mapping that training touches at random, with their neighbours, would
stay in the process's resident memory and make it grow with the store (:class:`Side`).

The manifest's ``key`` is a sha256 over everything the ids depend on: the input files' bytes (or a known dataset's
published checksums), the settings that tokenize, filter or cut the text, the tokenizer's own files when one is
given, and :data:`STORE_VERSION`. A store is reused only when its key matches, so a changed input, setting or
tokenizer is never read from a stale store; an incomplete one (no manifest) is rebuilt. Preparing streams the
input (plain or .gz text pairs, TSV, JSONL: never all of it in memory), trains the tokenizer on a seeded sample
(``data.tokenizer_sample`` sentences), and encodes in chunks on every core (worker processes when the corpus is
large enough to pay for them), with progress lines on stderr.
"""

from __future__ import annotations

import array
import contextlib
import datetime
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import Config
from aiayn.data.corpus import clean_pairs
from aiayn.data.datasets import sha256_file
from aiayn.errors import DataError
from aiayn.files import atomic_write_json
from aiayn.progress import ItemProgress

log = logging.getLogger("aiayn.data")

STORE_VERSION = 1  # bump when preparing produces other ids from the same inputs
MANIFEST = "manifest.json"
MARKER = ".aiayn-store"  # written first and kept: a directory without a manifest but with it may be rebuilt
CHUNK = 20_000  # pairs encoded per task
PARALLEL_BYTES = 32 << 20  # inputs at least this big are encoded by worker processes (below, one process is faster)

PairSource = Callable[[], Iterator[tuple[str, str]]]  # a fresh stream of (source, target) texts each call


class Side:
    """One side of a prepared split: its offsets (pairs + 1,) in memory (8 bytes a pair), its ids read from the
    file by position (``pread``), pair by pair.

    Not memory-mapped: a mapped file's page faults map whole neighbourhoods of pages (the kernel's fault-around),
    so a training that reads pairs scattered over the store would see its resident memory grow with the store
    (BENCHMARKS.md, "The data path"). A positional read leaves the pages in the kernel's
    page cache, not in the process."""

    def __init__(self, ids: Path, offsets: Path, dtype: np.dtype, pairs: int) -> None:
        self.dtype = dtype.newbyteorder("<")
        size = (pairs + 1) * 8
        with open(offsets, "rb") as f:
            data = f.read(size + 1)
        if len(data) != size:
            raise DataError(f"{offsets.name} holds {len(data)} bytes, {size} expected")
        # array.array: indexing gives Python ints at list speed, with numpy's 8 bytes a pair (numpy's own scalars
        # would cost more per pair than the read itself)
        self._bounds = array.array("q")
        self._bounds.frombytes(data)
        if sys.byteorder == "big":
            self._bounds.byteswap()
        self.offsets = np.frombuffer(self._bounds, dtype=np.int64)  # (pairs + 1,) a view, not a copy
        self._fd = os.open(ids, os.O_RDONLY)
        self.n_ids = os.fstat(self._fd).st_size // self.dtype.itemsize

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def lengths(self) -> np.ndarray:
        """(pairs,) int32: the token count of every pair (no specials)."""
        return np.diff(self.offsets).astype(np.int32)

    def __getitem__(self, i: int) -> list[int]:
        if not 0 <= i < len(self.offsets) - 1:
            raise IndexError(f"pair {i} of {len(self.offsets) - 1}")
        a, b = self._bounds[i], self._bounds[i + 1]
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self._fd, (b - a) * size, a * size), dtype=self.dtype).tolist()


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
    """An opened store: its directory, its manifest and its splits."""

    path: Path
    manifest: dict[str, Any]
    splits: dict[str, Split]

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


def store_key(cfg: Config, inputs: dict[str, str], tokenizer: Path | None) -> str:
    """sha256 of the version, the settings, the inputs' identities and, when given, the tokenizer's files."""
    from aiayn.data.cache import tokenizer_files

    parts: dict[str, Any] = {"version": STORE_VERSION, "settings": settings(cfg), "inputs": inputs}
    if tokenizer is not None:
        parts["tokenizer"] = {p.name: sha256_file(p) for p in tokenizer_files(tokenizer)}
        parts["settings"] = {k: v for k, v in parts["settings"].items() if k in ("task", "max_len")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def tokenizer_matches(a: Path, b: Path) -> bool:
    """Whether two tokenizer directories hold the same tokenizer files, byte for byte."""
    from aiayn.data.cache import tokenizer_files

    def digest(d: Path) -> dict[str, str]:
        return {p.name: sha256_file(p) for p in tokenizer_files(d)}

    return digest(a) == digest(b)


# Opening -----------------------------------------------------------------------------------------------------


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a complete store, None when there is none or it cannot be read (then it is rebuilt)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("version") == STORE_VERSION else None


def open_store(directory: str | Path) -> Store:
    """The prepared store in ``directory``, memory-mapped (a damaged or missing file is one DataError)."""
    path = Path(directory)
    manifest = read_manifest(path)
    if manifest is None:
        raise DataError(f"{path}: not a prepared corpus (no readable {MANIFEST}; run aiayn prepare)")
    dtype = np.dtype(manifest["dtype"])
    splits = {}
    for name, info in manifest["splits"].items():
        sides = []
        for side in ("src", "tgt"):
            try:
                side_ = Side(path / f"{name}.{side}.bin", path / f"{name}.{side}.idx", dtype, info["pairs"])
                offsets = side_.offsets
            except (OSError, ValueError, DataError) as e:
                raise DataError(f"{path}: {name}.{side}: cannot read it ({e})") from None
            if int(offsets[-1]) != side_.n_ids or offsets[0] != 0:
                raise DataError(f"{path}: {name}.{side} does not match its manifest (truncated?): prepare it again")
            sides.append(side_)
        splits[name] = Split(*sides)
    return Store(path, manifest, splits)


# Preparing ---------------------------------------------------------------------------------------------------


class _Writer:
    """Appends encoded pairs of one split to its .bin files; offsets written at the end."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.files = {side: open(directory / f"{split}.{side}.bin.tmp", "wb") for side in ("src", "tgt")}
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
            os.replace(self.directory / f"{self.split}.{side}.bin.tmp", self.directory / f"{self.split}.{side}.bin")
            info[f"{side}_tokens"] = int(offsets[-1])
        return info


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, max_len: int, cut_source: bool) -> None:
    from aiayn.data.tokenizer import TokenizerPair

    _WORKER.update(tok=TokenizerPair.load(tokenizer_dir), max_len=max_len, cut=cut_source)


def _encode(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Encode and filter a chunk of pairs (in a worker, or in this process) as the in-memory path does
    (:func:`aiayn.data.corpus.clean_pairs`): the kept pairs' ids back to back, their lengths per side, and the
    counts of what was dropped."""
    tok, max_len, cut = _WORKER["tok"], _WORKER["max_len"], _WORKER["cut"]
    ids = [(tok.src.encode(s), tok.tgt.encode(t)) for s, t in pairs]
    if cut:  # summarization: a long document is cut (as the translator does at inference), not dropped
        ids = [(s[: max_len - 1], t) for s, t in ids]
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
def _encoders(tokenizer_dir: Path, max_len: int, cut: bool, workers: int) -> Iterator[Callable]:
    """A function chunks -> encoded chunks, in order: worker processes (``workers`` > 1) or this process."""
    if workers <= 1:
        _init_worker(str(tokenizer_dir), max_len, cut)
        yield lambda chunks: map(_encode, chunks)
        return
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds torch's threads
    with ctx.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_dir), max_len, cut)) as pool:
        yield lambda chunks: pool.imap(_encode, chunks)


def prepare(cfg: Config, out: str | Path, sources: dict[str, PairSource], inputs: dict[str, str],
            tokenizer: str | Path | None = None, workers: int | None = None) -> Store:
    """Tokenize ``sources`` (split -> a function streaming its pairs) into the store ``out`` and open it; an
    existing store with the same key is opened as it is. ``inputs`` names what the sources read (for the key);
    ``tokenizer``: use this tokenizer directory instead of training one on a sample of the training pairs."""
    from aiayn.data.tokenizer import TokenizerPair, TokenizerSpec, tokenizer_plan, train_tokenizer_pair

    out = Path(out)
    tok_dir = Path(tokenizer) if tokenizer is not None else None
    key = store_key(cfg, inputs, tok_dir)
    manifest = read_manifest(out)
    if manifest is not None and manifest.get("key") == key:
        return open_store(out)
    if out.exists() and any(out.iterdir()) and manifest is None and not (out / MARKER).exists():
        raise DataError(f"{out}: exists and is not a prepared corpus; choose an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("a token store prepared by aiayn (aiayn prepare): aiayn may rebuild this directory\n")
    (out / MANIFEST).unlink(missing_ok=True)  # what follows is incomplete until the manifest is written again
    d = cfg.data
    tdir = out / "tokenizer"
    if tdir.exists():
        shutil.rmtree(tdir)
    if tok_dir is not None:
        shutil.copytree(tok_dir, tdir)
    else:  # two passes over the training pairs (sources, then targets): a sample, never the corpus in memory
        train = sources["train"]
        log.info("training %s on a sample of at most %s sentences",
                 tokenizer_plan(d.tokenizer, d.vocab_size, d.shared_vocab), f"{d.tokenizer_sample:,}")
        train_tokenizer_pair((s for s, _ in train()), (t for _, t in train()), tdir, TokenizerSpec.from_config(cfg))
    tok = TokenizerPair.load(tdir)
    vocab = max(tok.src.vocab_size, tok.tgt.vocab_size)
    dtype = np.dtype(np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32)
    max_len = d.max_len or cfg.model.max_positions
    big = sum(os.path.getsize(p) for p in inputs if os.path.isfile(p)) >= PARALLEL_BYTES
    if workers is None:
        from aiayn.engine import usable_cores

        workers = usable_cores() if big else 1
    splits: dict[str, Any] = {}
    with _encoders(tdir, max_len, cfg.task == "summarization", workers) as encode:
        for name, source in sources.items():
            writer = _Writer(out, name, dtype)
            progress = ItemProgress(None, "pair", f"prepare {name}")
            for encoded in encode(_chunks(source(), CHUNK)):
                writer.add(encoded)
                progress.update(encoded["kept"] + encoded["empty"] + encoded["too_long"])
            progress.close()
            splits[name] = writer.close()
            if not splits[name]["pairs"]:
                raise DataError(f"{name}: no usable pairs left after dropping empty and too-long ones")
    manifest = {"version": STORE_VERSION, "key": key, "created": datetime.datetime.now(datetime.timezone.utc)
                .isoformat(timespec="seconds"), "settings": settings(cfg), "inputs": inputs, "dtype": dtype.name,
                "vocab_size": vocab, "splits": splits}
    atomic_write_json(out / MANIFEST, manifest)  # last: its presence marks a complete store
    return open_store(out)
