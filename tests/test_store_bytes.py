"""A prepared store's bytes are pinned: a tiny pairs store and a tiny stream store, prepared from fixed synthetic
inputs with fixed settings (and a fixed clock), hold exactly these files with exactly these sha256s, manifest.json
included. A change to how stores are written (their layout, dtype, offsets, manifest, key or checksums) fails here;
a refactor of the store code must leave every byte as it is."""

from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path

import pytest

from aiayn.config import config_from_dict, load_config
from aiayn.data.synthetic import reverse_pairs

CREATED = "2026-01-02T03:04:05+00:00"
TINY = {"d_model": 32, "n_heads": 2, "d_ff": 64, "dropout": 0.0, "n_decoder_layers": 1}
# written by opening and locking, not by preparing: what they hold depends on the process and the file system
NOT_PINNED = {".aiayn-checked.json", ".aiayn-store.lock"}


@pytest.fixture(autouse=True)
def _fixed_clock(monkeypatch):
    """The manifest's ``created`` (and so its checksum) fixed, wherever the store code keeps its clock."""
    importlib.import_module("aiayn.data.pipeline")  # every kind of store imported before its clock is fixed
    for name, module in list(sys.modules.items()):
        if name.startswith("aiayn.data") and callable(getattr(module, "now", None)):
            monkeypatch.setattr(module, "now", lambda: CREATED)


def _digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in sorted(out.rglob("*")) if p.is_file() and p.name not in NOT_PINNED}


def _lines(n: int, seed: int, empty: int) -> list[tuple[str, str]]:
    pairs = [(s, t + " ." * (i % 3)) for i, (s, t) in enumerate(reverse_pairs(n, seed))]  # sides of other lengths
    pairs[empty] = ("", " ")  # dropped and counted
    return pairs


PAIRS_STORE = {
    ".aiayn-store": "d2c8d8ae504cb05a",
    "manifest.json": "ccbeb3e7303aa7e3",
    "tokenizer/shared.json": "6b9983ff7a6e3eba",
    "tokenizer/tokenizer.json": "bddba73941e7f98c",
    "train.src.bin": "d9f89e838e88c9e4",
    "train.src.idx": "70600123f19a2e6c",
    "train.tgt.bin": "527611098540aa4a",
    "train.tgt.idx": "a2e037bf14c77dd6",
    "valid.src.bin": "0ebb1515ecb34e59",
    "valid.src.idx": "dd37691a31fe191e",
    "valid.tgt.bin": "dcdab1bafc45cc09",
    "valid.tgt.idx": "98673d2e72d86b43",
}

STREAM_STORE = {
    ".aiayn-store": "d2c8d8ae504cb05a",
    "manifest.json": "e7373aa45b1fa272",
    "tokenizer/shared.json": "004d14ead8507b4f",
    "tokenizer/tokenizer.json": "72137d7090a7bfa6",
    "train.bin": "63c9995b08978cac",
    "valid.bin": "f110d365a47ed9ce",
}


def test_a_pairs_store_holds_these_bytes(tmp_path):
    from aiayn.data.store import PairRecipe, prepare_store

    cfg = load_config("tiny_reverse", ["data.dataset=null", "data.tokenizer=char", "data.vocab_size=100",
                                       "model.max_positions=24"])
    train, valid = _lines(300, 1, 7), _lines(40, 2, 3)
    sources = {"train": lambda: iter(train), "valid": lambda: iter(valid)}
    out = tmp_path / "pairs"
    inputs = {"train": "pinned-train", "valid": "pinned-valid"}
    store = prepare_store(out, PairRecipe(cfg=cfg, sources=sources, inputs=inputs, workers=1))
    assert store.manifest["created"] == CREATED and store.manifest["splits"]["train"]["stats"]["too_long"] > 0
    assert _digests(out) == PAIRS_STORE
    assert sorted(p.name for p in out.iterdir() if p.name in NOT_PINNED) == sorted(NOT_PINNED)


def test_a_stream_store_holds_these_bytes(tmp_path):
    from aiayn.data.store import prepare_store
    from aiayn.data.stream_store import StreamRecipe

    text = tmp_path / "text.txt"
    text.write_text("".join(f"{s}. {t}!{' é' * (i % 7 == 0)}\n" + ("\n" if i % 5 == 0 else "") for i, (s, t) in
                            enumerate(reverse_pairs(200, 3))), encoding="utf-8")
    cfg = config_from_dict({"task": "lm", "model": {**TINY, "max_positions": 32},
                            "data": {"train_src": str(text), "tokenizer": "char", "block_size": 16}})
    out = tmp_path / "stream"
    store = prepare_store(out, StreamRecipe(cfg, text, {"text": "pinned-text"}, workers=1))
    assert store.manifest["created"] == CREATED and store.manifest["kind"] == "stream"
    assert _digests(out) == STREAM_STORE
