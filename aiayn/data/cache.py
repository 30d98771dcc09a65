"""The tokenized corpus, cached in the run directory: ``--resume`` and every DDP rank skip re-encoding.

``RUN/cache/<kind>-<key>.safetensors`` holds id sequences (one flat int32 tensor and a lengths tensor per
field; safetensors, never pickle) and, in its metadata, what the build reported (kept / dropped counts).
The key is a sha256 over everything the ids depend on: the tokenizer's files, the text itself (hashed: far
cheaper than encoding it), the config values that filter or cut it, and :data:`CACHE_VERSION`. Anything
else gives another key, so a stale cache is never read; the main process writes the file (atomically) and
removes the older files of the same kind, the other processes read it after the barrier.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from aiayn.files import atomic_write_safetensors

log = logging.getLogger("aiayn.data")

CACHE_VERSION = 1  # bump when the encoding pipeline changes what it produces from the same inputs
Fields = dict[str, list[list[int]]]


def cache_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "cache"


def fingerprint(parts: dict[str, Any], texts: Iterable[str] = (), files: Iterable[Path] = ()) -> str:
    """sha256 of JSON ``parts``, every text (length-prefixed, so boundaries count) and every file's bytes."""
    h = hashlib.sha256(json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True).encode())
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def tokenizer_files(tokenizer_dir: str | Path) -> list[Path]:
    """The files that define a run's tokenizer (its model files and tokenizer.json)."""
    return sorted(p for p in Path(tokenizer_dir).iterdir() if p.is_file() and not p.name.startswith("."))


def _pack(fields: Fields) -> dict[str, torch.Tensor]:
    out = {}
    for name, seqs in fields.items():
        out[f"{name}.lengths"] = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        out[f"{name}.ids"] = torch.tensor([i for s in seqs for i in s], dtype=torch.int32)
    return out


def _unpack(tensors: dict[str, torch.Tensor]) -> Fields:
    fields: Fields = {}
    for key in tensors:
        if key.endswith(".lengths"):
            name = key[: -len(".lengths")]
            flat = tensors[f"{name}.ids"].tolist()
            lengths = tensors[key].tolist()
            seqs, start = [], 0
            for n in lengths:
                seqs.append(flat[start : start + n])
                start += n
            fields[name] = seqs
    return fields


def _read(path: Path, key: str) -> tuple[Fields, dict[str, Any]] | None:
    """The cache file's contents, or None when it is missing, unreadable or of another key."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("key") != key:
            raise ValueError("written for other inputs")
        return _unpack(load_file(str(path))), json.loads(meta["info"])
    except (OSError, SafetensorError, ValueError, KeyError) as e:
        log.warning("%s: unreadable token cache (%s); encoding again", path, e)
        return None


def load_or_build(run_dir: str | Path, kind: str, key: str, build: Callable[[], tuple[Fields, dict[str, Any]]],
                  is_main: bool = True, barrier: Callable[[], None] = lambda: None) -> tuple[Fields, dict[str, Any]]:
    """The cached fields and info of ``kind`` under ``key``, or ``build()``'s, cached for the next time.

    ``build`` returns ({field: id sequences}, a JSON-able info dict). The main process reads the cache or
    builds and writes it, then every process passes ``barrier`` and the others read it; a missing or
    damaged file is rebuilt, never trusted."""
    path = cache_dir(run_dir) / f"{kind}-{key[:20]}.safetensors"
    found = _read(path, key) if is_main else None
    if is_main and found is None:
        found = build()
        meta = {"info": json.dumps(found[1]), "key": key}
        atomic_write_safetensors(path, _pack(found[0]), meta)
        for old in cache_dir(run_dir).glob(f"{kind}-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
    elif is_main:
        log.info("%s: read the tokenized %s data from the cache", path, kind)
    barrier()
    if not is_main:
        found = _read(path, key) or build()
    return found
