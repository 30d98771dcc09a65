"""The prepared token store (aiayn.data.store): ids equal the tokenizer's, read back by position; a changed input
or setting is never served from a stale store; an incomplete store is rebuilt; a foreign directory is refused; a
damaged store is refused in one line by training and rebuilt by ``aiayn prepare``; concurrent prepares build
once; the batch collation of a store equals the id-list collation."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
import torch

from aiayn import files
from aiayn.config import load_config
from aiayn.data.corpus import iter_parallel
from aiayn.data.pipeline import prepare_corpus
from aiayn.data.store import MANIFEST, open_store
from aiayn.data.synthetic import reverse_pairs
from aiayn.data.tokenizer import TokenizerPair
from aiayn.errors import DataError


def write_pairs(tmp_path, name: str, n: int, seed: int, gz: bool = False):
    pairs = reverse_pairs(n, seed)
    pairs[3] = ("", "")  # an empty pair: dropped and counted
    paths = []
    for k, side in enumerate(("src", "tgt")):
        p = tmp_path / (f"{name}.{side}" + (".gz" if gz else ""))
        data = "".join(pair[k] + "\n" for pair in pairs).encode()
        p.write_bytes(gzip.compress(data) if gz else data)
        paths.append(p)
    return paths


def file_config(train, valid, overrides=()):
    return load_config("tiny_reverse", ["data.dataset=null", f"data.train_src={train[0]}", f"data.train_tgt={train[1]}",
                                        f"data.valid_src={valid[0]}", f"data.valid_tgt={valid[1]}", *overrides])


def make(tmp_path, out, seed=0, overrides=(), gz=False):
    train = write_pairs(tmp_path, f"train{seed}", 1500, seed, gz)
    valid = write_pairs(tmp_path, f"valid{seed}", 60, seed + 100, gz)
    return prepare_corpus(file_config(train, valid, overrides), out, workers=1), train, valid


def test_the_store_holds_the_tokenizers_ids(tmp_path):
    store, train, _ = make(tmp_path, tmp_path / "store", gz=True)
    tok = TokenizerPair.load(store.tokenizer_dir)
    split = store.splits["train"]
    assert len(split) == 1499 and store.manifest["splits"]["train"]["stats"]["empty"] == 1
    assert split.src.dtype == np.uint16
    pairs = [(s, t) for s, t in iter_parallel(*train) if s.strip() and t.strip()]
    src, tgt = split.pairs([0, 1, 1498])
    assert src == [tok.src.encode(pairs[i][0]) for i in (0, 1, 1498)]
    assert tgt == [tok.tgt.encode(pairs[i][1]) for i in (0, 1, 1498)]
    assert split.tgt.lengths().tolist() == [len(tok.tgt.encode(t)) for _, t in pairs]
    reopened = open_store(tmp_path / "store")
    assert reopened.splits["valid"].pairs([5]) == store.splits["valid"].pairs([5])


def test_a_changed_input_or_setting_is_prepared_again_and_an_incomplete_store_rebuilt(tmp_path):
    out = tmp_path / "store"
    first, _, _ = make(tmp_path, out)
    key = first.manifest["key"]
    mtime = (out / MANIFEST).stat().st_mtime_ns
    again, _, _ = make(tmp_path, out)  # same inputs and settings: opened as it is
    assert again.manifest["key"] == key and (out / MANIFEST).stat().st_mtime_ns == mtime
    other, _, _ = make(tmp_path, out, seed=1)  # other text
    assert other.manifest["key"] != key
    longer, _, _ = make(tmp_path, out, seed=1, overrides=["data.vocab_size=500"])  # another setting
    assert longer.manifest["key"] not in (key, other.manifest["key"])
    (out / MANIFEST).unlink()  # as if preparing had been killed before its last write
    with pytest.raises(DataError, match="not a prepared corpus"):
        open_store(out)
    rebuilt, _, _ = make(tmp_path, out, seed=1, overrides=["data.vocab_size=500"])
    assert rebuilt.manifest["key"] == longer.manifest["key"]


def test_a_truncated_file_and_a_foreign_directory_are_refused(tmp_path):
    out = tmp_path / "store"
    make(tmp_path, out)
    data = (out / "train.src.bin").read_bytes()
    (out / "train.src.bin").write_bytes(data[:-4])
    with pytest.raises(DataError, match=r"truncated or damaged\): rebuild it: aiayn prepare CONFIG --out"):
        open_store(out)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a prepared corpus"):
        make(tmp_path, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "notes.txt"  # was ".../notes.txt/.aiayn-store.lock: Not a directory"
    a_file.write_text("keep me too")
    with pytest.raises(DataError, match=r"notes.txt: exists and is not a directory \(a prepared store is one\)"):
        make(tmp_path, a_file)
    assert a_file.read_text() == "keep me too"
    assert json.loads((out / MANIFEST).read_text())["dtype"] == "uint16"


# --- training from a prepared store ----------------------------------------------------------------------


def test_training_data_from_a_store_plans_and_collates_the_batches_of_the_directly_encoded_pairs(tmp_path):
    """A config without data.prepared trains from a store it prepares in the cache; its plans and batches are those of
    encoding the pairs with the tokenizer and batching the id lists (what the retired in-memory path did)."""
    from aiayn.data.batching import collate, token_batches
    from aiayn.data.corpus import clean_pairs
    from aiayn.data.pipeline import build_translation_data
    from aiayn.data.store import cached_store_dir

    train = write_pairs(tmp_path, "train", 1500, 0)
    valid = write_pairs(tmp_path, "valid", 60, 100)
    data, tok = build_translation_data(file_config(train, valid), tmp_path / "run")
    assert data.src.path.parent.parent == cached_store_dir("x").parent  # in $AIAYN_CACHE_DIR/stores
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()  # the store's tokenizer is the run's
    pairs = list(iter_parallel(*train))
    ids = [(tok.src.encode(a), tok.tgt.encode(b)) for a, b in pairs]
    kept, _ = clean_pairs(pairs, ids, data.max_tokens)
    src, tgt = [ids[i][0] for i in kept], [ids[i][1] for i in kept]
    for epoch in (0, 1):
        want = token_batches([len(x) + 1 for x in src], [len(y) + 1 for y in tgt], data.max_tokens, data.seed, epoch)
        assert [b.tolist() for b in data.epoch_plan(epoch)] == [list(b) for b in want]
    sp = tok.specials
    for b in data.epoch_batches(0)[:5]:
        ref = collate([src[i] for i in b.indices], [tgt[i] for i in b.indices], b.indices, sp.pad, sp.decoder_start,
                      sp.eos)
        assert torch.equal(b.src, ref.src) and torch.equal(b.tgt_in, ref.tgt_in) and torch.equal(b.tgt_out, ref.tgt_out)
        assert b.ntokens == ref.ntokens == data.plan_tokens(b.indices)


def test_a_run_from_a_named_store_equals_the_run_from_the_cached_store_and_resumes_bit_exactly(tmp_path):
    from aiayn.run.weights import read_weights
    from aiayn.train.run import train

    train_files = write_pairs(tmp_path, "train", 1500, 0)
    valid = write_pairs(tmp_path, "valid", 60, 100)
    small = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
             "model.n_decoder_layers=1", "data.max_tokens=512", "train.eval_every=3", "train.save_every=3",
             "train.log_every=3", "train.threads=1"]
    prepared = [f"data.prepared={tmp_path / 'store'}"]
    train(file_config(train_files, valid, [*small, "train.max_updates=6"]), tmp_path / "plain", progress=False)
    train(file_config(train_files, valid, [*small, *prepared, "train.max_updates=6"]), tmp_path / "lazy",
          progress=False)
    train(file_config(train_files, valid, [*small, *prepared, "train.max_updates=3"]), tmp_path / "resumed",
          progress=False)
    train(file_config(train_files, valid, [*small, *prepared, "train.max_updates=6"]), tmp_path / "resumed",
          resume=True, progress=False)
    want = read_weights(tmp_path / "plain" / "model.safetensors")
    for run in ("lazy", "resumed"):
        got = read_weights(tmp_path / run / "model.safetensors")
        assert all(torch.equal(got[k], want[k]) for k in want), run


def test_update_tokens_is_the_budget_of_a_whole_update():
    from aiayn.data.pipeline import batch_budget
    from aiayn.errors import ConfigError

    cfg = load_config("paper-base")
    assert cfg.data.update_tokens == 25000
    assert batch_budget(cfg, world=1) == 25000 and batch_budget(cfg, world=8) == 3125
    assert batch_budget(load_config("paper-base", ["train.accum_steps=4"]), world=2) == 3125
    assert batch_budget(load_config("tiny_reverse"), world=8) == 2048  # max_tokens: per process, as before
    with pytest.raises(ConfigError, match="fewer than one token per batch"):
        batch_budget(load_config("paper-base", ["data.update_tokens=3"]), world=8)


class _Squares:
    """Training data whose plan items are numbers, collated to their squares (and one that fails)."""

    def collate_plan(self, item):
        if item == 404:
            raise ValueError("bad item 404")
        return item * item


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_yields_the_planned_updates_in_order_from_its_start_and_raises_where_collating_failed(workers):
    from aiayn.data.loader import UpdateLoader

    updates = [[i, i + 100] for i in range(10)]
    with UpdateLoader(_Squares(), workers) as loader:
        assert list(loader.epoch(updates, 3)) == [[i * i, (i + 100) ** 2] for i in range(3, 10)]
        it = loader.epoch(updates[:4], 0)  # the next epoch: the same workers, re-pointed
        assert next(it) == [0, 10000]
    with UpdateLoader(_Squares(), workers) as loader:
        it = loader.epoch([[1], [404], [2]], 0)
        assert next(it) == [1]
        with pytest.raises(ValueError, match="bad item 404"):
            next(it)
    if workers:
        with UpdateLoader(_Squares(), workers) as loader:  # left early: close() stops the workers
            next(loader.epoch([[i] for i in range(1000)], 0))
            procs = list(loader._iter._workers)
        assert procs and not any(p.is_alive() for p in procs)


def test_two_ranks_train_on_disjoint_shares_that_cover_the_epoch_and_collate_only_their_own(tmp_path):
    from aiayn.data.pipeline import build_translation_data, fit_model_to_vocab
    from aiayn.train.parallel import Dist
    from aiayn.train.plan import EpochPlanner

    train_files, valid = write_pairs(tmp_path, "train", 1500, 0), write_pairs(tmp_path, "valid", 60, 100)
    cfg = file_config(train_files, valid, ["model.d_model=32", "model.d_ff=64", "model.n_heads=2",
                                           "data.max_tokens=512", "train.accum_steps=2",
                                           f"data.prepared={tmp_path / 'store'}"])
    data, tok = build_translation_data(cfg, tmp_path / "run", world=2)
    cfg = fit_model_to_vocab(cfg, tok)
    collated = {0: [], 1: []}
    shares = {}
    for rank in (0, 1):
        planner = EpochPlanner(data, cfg.train.accum_steps, Dist(rank=rank, world=2))
        updates, _ = planner.updates(0)
        original = data.collate_plan
        data.collate_plan = lambda p, r=rank, f=original: (collated[r].append(p), f(p))[1]
        try:
            shares[rank] = [i for u in updates for p in u for i in data.collate_plan(p).indices]
        finally:
            data.collate_plan = original
        assert [p.tolist() for p in collated[rank]] == [p.tolist() for u in updates for p in u]  # only its own
    plan = data.epoch_plan(0)
    assert not set(shares[0]) & set(shares[1])
    left = [i for b in plan[len(plan) // 4 * 4:] for i in b]  # the remainder waits for the next epoch's shuffle
    assert sorted(shares[0] + shares[1] + left) == list(range(len(data.src)))


def test_input_hashes_are_remembered_while_size_and_time_are_unchanged(tmp_path, monkeypatch):
    """A restart from a prepared store does not read the whole corpus again to find it unchanged."""
    import time

    from aiayn.data import datasets

    monkeypatch.setenv(files.CACHE_DIR_ENV, str(tmp_path / "cache"))
    hashed = []
    real = datasets.sha256_file
    monkeypatch.setattr(datasets, "sha256_file", lambda p: hashed.append(p) or real(p))
    f = tmp_path / "corpus.txt"
    f.write_text("one\ntwo\n", encoding="utf-8")
    time.sleep(datasets.RACY_NS * 1.5 / 1e9)  # an entry taken right after a change is not trusted (racy)
    first = datasets.sha256_known(f)
    assert datasets.sha256_known(f) == first == real(f) and len(hashed) == 1  # the second read nothing
    f.write_text("one\ntwo\nthree\n", encoding="utf-8")  # another size
    assert datasets.sha256_known(f) == real(f) != first and len(hashed) == 2
    os.utime(f, ns=(1, 1))  # same size, another time: hashed again
    datasets.sha256_known(f)
    assert len(hashed) == 3
    gone = tmp_path / "gone.txt"
    gone.write_text("x", encoding="utf-8")
    datasets.sha256_known(gone)
    gone.unlink()
    datasets.sha256_known(tmp_path / "corpus.txt")
    os.utime(f, ns=(2, 2))
    datasets.sha256_known(f)  # a write drops entries of files that no longer exist
    assert str(gone.resolve()) not in json.loads((tmp_path / "cache" / "hashes.json").read_text())


def test_training_never_leaves_the_store_mapped(tmp_path, monkeypatch):
    """Resident memory must not grow with the part of the store an epoch reads: a batch's pairs are read, never
    mapped, so after an epoch no file of the store is mapped into the process (a lasting mapping keeps the pages
    it touched resident)."""
    from pathlib import Path

    from aiayn.data.pipeline import build_translation_data

    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    train = write_pairs(tmp_path, "train", 1500, 0)
    valid = write_pairs(tmp_path, "valid", 60, 100)
    lazy, _ = build_translation_data(file_config(train, valid, [f"data.prepared={tmp_path / 'store'}"]),
                                     tmp_path / "lazy")
    assert sum(len(b.indices) for b in lazy.epoch_batches(1)) > 1000  # an epoch read
    assert str(tmp_path / "store") not in maps.read_text()
    with pytest.raises(IndexError):
        lazy.src[len(lazy.src)]
    for asked in ([7, 3, 7], [3, 4, 5, 9, 10, 2], [0], [len(lazy.src) - 1, 0, 1]):  # runs of neighbours read as one
        ids, lens = lazy.src.gather(np.array(asked))  # in the asked order, repeats included
        assert lens.tolist() == [len(lazy.src[i]) for i in asked]
        assert ids.dtype == np.int64 and ids.tolist() == [t for i in asked for t in lazy.src[i]]
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: reads.append(at) or real(fd, bufs, at))
    lazy.src.gather(np.array([3, 4, 5, 9, 10, 2]))
    assert len(reads) == 3  # 3-5, 9-10 and 2
    monkeypatch.undo()
    assert lazy.src.gather(np.array([], dtype=np.int64))[0].shape == (0,)
    bin_file = lazy.src.path
    os.truncate(bin_file, os.path.getsize(bin_file) // 2)  # cut while training: one clear error, not garbage
    with pytest.raises(DataError, match="shorter than its offsets"):
        lazy.src.gather(np.arange(len(lazy.src)))


def test_the_next_epoch_is_planned_after_the_first_update_and_only_once(tmp_path, monkeypatch):
    """The first update never waits for the next epoch's plan (planning 4.5M pairs holds the interpreter for
    seconds), and each epoch is planned once, ahead of its start, so a later epoch starts without a pause."""
    from aiayn.data.pipeline import TranslationData
    from aiayn.train.run import train
    from aiayn.train.update import Update

    train_files, valid = write_pairs(tmp_path, "train", 300, 0), write_pairs(tmp_path, "valid", 20, 100)
    cfg = file_config(train_files, valid, ["model.d_model=32", "model.d_ff=64", "model.n_heads=2",
                                           "data.max_tokens=1024", "train.max_updates=40", "train.eval_every=100",
                                           "train.save_every=100", "train.threads=1", "data.vocab_size=300"])
    updates, planned = [0], []
    real_plan, real_update = TranslationData.epoch_plan, Update.run
    monkeypatch.setattr(TranslationData, "epoch_plan",
                        lambda self, epoch: planned.append((epoch, updates[0])) or real_plan(self, epoch))
    monkeypatch.setattr(Update, "run",
                        lambda *a, **k: (updates.__setitem__(0, updates[0] + 1), real_update(*a, **k))[1])
    state = train(cfg, tmp_path / "run", progress=False)
    assert state.epoch >= 2  # 40 updates span several epochs of this corpus
    epochs = [e for e, _ in planned]
    assert epochs == sorted(set(epochs)) and epochs[0] == 0  # each epoch planned once, in order
    assert planned[0][1] == 0 and all(n >= 1 for _, n in planned[1:])  # the next: after the first update


# --- store safety: damaged stores, concurrent and failed prepares, the input-hash cache ------------------------


def _swap_offsets(out):
    idx = np.fromfile(out / "train.src.idx", dtype="<i8")
    idx[5], idx[6] = idx[6], idx[5]
    idx.tofile(out / "train.src.idx")


def _id_past_vocab(out):
    ids = np.fromfile(out / "train.tgt.bin", dtype="<u2")
    ids[7] = json.loads((out / MANIFEST).read_text())["tgt_vocab_size"]
    ids.tofile(out / "train.tgt.bin")


def _manifest_without_valid(out):
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["splits"]["valid"]
    (out / MANIFEST).write_text(json.dumps(manifest))


def _id_in_range(out):
    """One id overwritten by another id of the vocabulary: no bounds check sees it, the checksum does."""
    ids = np.fromfile(out / "train.tgt.bin", dtype="<u2")
    ids[7] = 5 if ids[7] != 5 else 6
    ids.tofile(out / "train.tgt.bin")


def _manifest_integer_edited(out):
    text = (out / MANIFEST).read_text()
    tokens = json.loads(text)["splits"]["train"]["src_tokens"]
    (out / MANIFEST).write_text(text.replace(f'"src_tokens": {tokens}', f'"src_tokens": {tokens + 1}', 1))


def _rm_tokenizer(out):
    import shutil

    shutil.rmtree(out / "tokenizer")


DAMAGES = {
    "truncated": (lambda out: (out / "train.src.bin").write_bytes((out / "train.src.bin").read_bytes()[:-2]),
                  "train.src.bin: .* bytes where its offsets need"),
    "swapped offsets": (_swap_offsets, "train.src.idx: its offsets are not non-decreasing"),
    "id past the vocabulary": (_id_past_vocab, "train.tgt.bin: holds id .*, past the vocabulary"),
    "id overwritten in range": (_id_in_range, "train.tgt.bin: does not match its checksum"),
    "missing split file": (lambda out: (out / "valid.tgt.bin").unlink(), "valid.tgt.bin: missing"),
    "manifest without a split": (_manifest_without_valid, "manifest.json: does not match its checksum"),
    "manifest not JSON": (lambda out: (out / MANIFEST).write_text('{"version": 1, "ke'), "manifest.json: not JSON"),
    "manifest of 0 bytes": (lambda out: (out / MANIFEST).write_bytes(b""), r"manifest.json: empty \(0 bytes\)"),
    "manifest integer edited": (_manifest_integer_edited, "manifest.json: does not match its checksum"),
    "tokenizer deleted": (_rm_tokenizer, r"store/tokenizer/\S+: missing"),
}


def _snapshot(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_store_is_one_line_and_exit_2_for_training_and_rebuilt_by_prepare(tmp_path, capsys, damage):
    """A store named by data.prepared is only read: any damage, its manifest's included (not JSON, 0 bytes, one
    integer edited), an id overwritten by another in range, its tokenizer deleted, is one line naming the store and
    the `aiayn prepare` command, exit 2, and the store left byte for byte as it was; `aiayn prepare --verify` names
    the same problem; `aiayn prepare` rebuilds it."""
    from aiayn.cli import main

    out = tmp_path / "store"
    _, train, valid = make(tmp_path, out)
    sets = [x for kv in ("data.dataset=null", f"data.train_src={train[0]}", f"data.train_tgt={train[1]}",
                         f"data.valid_src={valid[0]}", f"data.valid_tgt={valid[1]}") for x in ("--set", kv)]
    hurt, message = DAMAGES[damage]
    hurt(out)
    before = _snapshot(out)
    capsys.readouterr()
    run = tmp_path / "run"
    assert main(["train", "tiny_reverse", "--run-dir", str(run), *sets, "--set", f"data.prepared={out}",
                 "--no-progress", "--set", "train.max_updates=1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "aiayn: " in line or "Traceback" in line]
    assert len(err) == 1 and err[0].startswith("aiayn: error: "), err
    assert f"aiayn prepare CONFIG --out {out}" in err[0]
    import re

    assert re.search(message, err[0]), err[0]
    assert not run.exists() and _snapshot(out) == before  # refused before any work: nothing written, nothing lost
    assert main(["prepare", "--verify", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(x.startswith("aiayn: error: ") for x in lines) and re.search(message, lines[0]), lines
    assert _snapshot(out) == before
    assert main(["prepare", "tiny_reverse", "--out", str(out), *sets]) == 0  # the fix the line names works
    capsys.readouterr()
    assert main(["prepare", "--verify", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: sound (every file read and checked)"
    store = open_store(out, ("train", "valid"))
    assert len(store.splits["train"]) == 1499 and not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_prepare_that_starts_while_another_builds_waits_for_it_and_uses_its_store(tmp_path):
    """A subprocess ``aiayn prepare --out X`` while this test builds X under the store's lock (as a concurrent
    prepare, training rank or table3 runner would): it says it waits, then opens the complete store, building
    nothing (no tokenizer trained), and the store holds no temporaries."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from aiayn.data.integrity import CHECKED
    from aiayn.data.pipeline import pair_sources
    from aiayn.data.store import LOCK, MARKER, PairRecipe, _build_with
    from aiayn.files import file_lock

    train = write_pairs(tmp_path, "train", 1500, 0)
    valid = write_pairs(tmp_path, "valid", 60, 100)
    cfg = file_config(train, valid)
    out = tmp_path / "store"
    out.mkdir()
    sets = [x for kv in ("data.dataset=null", f"data.train_src={train[0]}", f"data.train_tgt={train[1]}",
                         f"data.valid_src={valid[0]}", f"data.valid_tgt={valid[1]}") for x in ("--set", kv)]
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root, "AIAYN_CACHE_DIR": str(tmp_path / "cache")}
    log = tmp_path / "prepare.log"
    with file_lock(out / LOCK):
        (out / MARKER).write_text("x")
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "aiayn", "prepare", "tiny_reverse", "--out", str(out),
                                     *sets], env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=err, text=True)
        for _ in range(1200):  # until it blocks on the lock (a poll, not a timing assertion)
            if "waiting for the process" in log.read_text() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert f"(pid {os.getpid()}) that prepares it" in log.read_text(), log.read_text()
        sources, inputs = pair_sources(cfg)
        _build_with(out, PairRecipe(cfg=cfg, sources=sources, inputs=inputs, workers=1))
    assert proc.wait(timeout=300) == 0, log.read_text()
    assert "on a sample of at most" not in log.read_text()  # it built nothing: it used this one's store
    store = open_store(out, ("train", "valid"))
    assert len(store.splits["train"]) == 1499 and len(store.splits["valid"]) == 59
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [CHECKED, MARKER, LOCK]  # nothing else


def test_a_store_lock_names_its_holder_and_what_it_does_at_every_moment(tmp_path, monkeypatch):
    """CI seed 1049295618: a builder stopped (SIGSTOP) just after it took the store's lock had written its pid but
    not yet what it was doing, and the waiter's line said neither. The holder now writes what it is doing as it
    takes the lock; and a new ``doing`` is written over the old text, then cut to length, so a process stopped
    between the two calls still shows its pid (emptied first, the file said "pid ?")."""
    import socket

    import aiayn.files as files
    from aiayn.data.store import store_lock

    out = tmp_path / "store"
    out.mkdir()
    seen = []  # what a waiter would read after each write to the lock file, the moments between them included

    def watched(real):
        def call(fd: int, *args):
            result = real(fd, *args)
            seen.append(files.LockHolder.read(fd))
            return result
        return call

    monkeypatch.setattr(files.os, "ftruncate", watched(os.ftruncate))
    monkeypatch.setattr(files.os, "pwrite", watched(os.pwrite))
    with store_lock(out, False, None) as held:
        first = files.LockHolder.read(held.fd)
        held.doing("preparing it: training its tokenizer")
        second = files.LockHolder.read(held.fd)
        held.doing("x")
        last = files.LockHolder.read(held.fd)
    me, host = str(os.getpid()), socket.gethostname()
    assert first == files.LockHolder(me, host, "preparing it: looking at what is there")
    assert second == files.LockHolder(me, host, "preparing it: training its tokenizer")
    assert last == files.LockHolder(me, host, "x")  # cut to length: nothing of the longer text before it is left
    assert seen and all(h.pid == me and h.host == host for h in seen)


def test_a_killed_build_is_never_trusted_and_a_failed_prepare_leaves_no_new_folder(tmp_path):
    from aiayn.data.store import MARKER

    out = tmp_path / "store"
    make(tmp_path, out)
    stale = out / ".build.killed.tmp"  # what a builder killed mid-way leaves: its staging directory...
    stale.mkdir()
    (stale / "train.src.bin").write_bytes(b"\0" * 64)
    (out / MANIFEST).unlink()  # ...or, killed while moving its files in, no manifest
    with pytest.raises(DataError, match="not a prepared corpus"):
        open_store(out)
    make(tmp_path, out)  # rebuilt, the leftovers removed
    assert not stale.exists() and open_store(out, ("train", "valid"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    cfg = file_config((empty, empty), (empty, empty))
    new = tmp_path / "a" / "b" / "store"
    with pytest.raises(DataError):
        prepare_corpus(cfg, new, workers=1)
    assert not (tmp_path / "a").exists()  # nor its parents this call made
    assert (out / MARKER).exists()


def test_the_input_hash_cache_is_not_fooled_by_an_edit_that_restores_the_modification_time(tmp_path, monkeypatch):
    import time

    from aiayn.data import datasets

    monkeypatch.setenv(files.CACHE_DIR_ENV, str(tmp_path / "cache"))
    hashed = []
    real = datasets.sha256_file
    monkeypatch.setattr(datasets, "sha256_file", lambda p: hashed.append(p) or real(p))
    f = tmp_path / "corpus.txt"
    f.write_text("one\ntwo\n", encoding="utf-8")
    st = f.stat()
    time.sleep(datasets.RACY_NS * 1.5 / 1e9)  # past the racy window: the entry is trusted
    first = datasets.sha256_known(f)
    assert datasets.sha256_known(f) == first and len(hashed) == 1
    f.write_text("uno\ndos\n", encoding="utf-8")  # same size...
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # ...and the modification time put back
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert datasets.sha256_known(f) == real(f) != first and len(hashed) == 2
    racy = tmp_path / "racy.txt"  # hashed within the racy window of its last change: hashed again next time
    racy.write_text("x", encoding="utf-8")
    datasets.sha256_known(racy)
    datasets.sha256_known(racy)
    assert len(hashed) == 4

def test_collating_a_store_flat_gives_the_batches_of_collating_its_id_lists(tmp_path):
    """The vectorized collation (one read per run of adjacent pairs, numpy padding) equals :func:`collate` of the
    same pairs read one by one, for shuffled, adjacent and repeated pairs, with and without padded shapes."""
    from aiayn.data.batching import batch_shape, collate, collate_flat

    store, _, _ = make(tmp_path, tmp_path / "store")
    split = store.splits["train"]
    rng = np.random.default_rng(0)
    batches = [rng.permutation(len(split))[:40], np.arange(100, 130), np.array([5, 6, 7, 3, 4, 900, 5]),
               np.array([len(split) - 1]), rng.permutation(len(split))[:300]]
    for indices in batches:
        s, t = split.pairs(indices.tolist())
        s_flat, t_flat = split.src.gather(indices), split.tgt.gather(indices)
        assert s_flat[0].tolist() == [i for x in s for i in x] and t_flat[1].tolist() == [len(y) for y in t]
        shapes = [None, batch_shape([len(x) + 1 for x in s], [len(y) + 1 for y in t], 4096, 8),
                  batch_shape([len(x) + 1 for x in s], [len(y) + 1 for y in t], 1 << 14, 1, (16, 32, 64, 128))]
        for shape in shapes:
            a = collate(s, t, indices.tolist(), 0, 2, 3, shape=shape)
            b = collate_flat(s_flat, t_flat, indices.tolist(), 0, 2, 3, shape=shape)
            for x, y in ((a.src, b.src), (a.tgt_in, b.tgt_in), (a.tgt_out, b.tgt_out)):
                assert x.dtype == y.dtype and torch.equal(x, y)
            assert a.ntokens == b.ntokens and a.indices == b.indices


def test_a_store_found_good_is_not_scanned_again_until_a_file_changes(tmp_path, monkeypatch):
    """Every start and every rank opens the store: the id scan (all ids against the vocabulary) runs once per
    unchanged file, remembered by size, times and inode; a rewrite (same bytes, new change time) is scanned again,
    and a damaged file is still refused."""
    from aiayn.data import store as store_mod

    out = tmp_path / "store"
    make(tmp_path, out)
    scanned = []
    real = store_mod.os.pread
    monkeypatch.setattr(store_mod.os, "pread", lambda fd, n, at: scanned.append(fd) or real(fd, n, at))
    open_store(out)
    assert scanned == []  # prepare's own opening found every file good
    ids = out / "train.tgt.bin"
    ids.write_bytes(ids.read_bytes())  # the same bytes, written again
    open_store(out)
    assert len(scanned) == 1  # that file alone
    scanned.clear()
    open_store(out)
    assert scanned == []
    _id_past_vocab(out)
    with pytest.raises(DataError, match="past the vocabulary"):
        open_store(out)


def test_an_id_overwritten_in_range_is_caught_by_its_checksum_once_the_file_changed(tmp_path, monkeypatch):
    """The manifest holds a sha256 of every file; an opening hashes a file only when it changed since it was last
    found good (the memo's size, times and inode), so an unchanged store is not read again, and one overwritten id
    (still inside the vocabulary) is refused; `--verify` reads every file whatever the memo says."""
    from aiayn.files import sha256_file

    out = tmp_path / "store"
    store, _, _ = make(tmp_path, out)
    files = store.manifest["files"]
    assert sorted(files) == sorted(p.relative_to(out).as_posix() for p in out.rglob("*")  # all but the manifest
                                   if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST)
    assert all(sha256_file(out / name) == digest for name, digest in files.items())
    _id_in_range(out)
    with pytest.raises(DataError, match=r"train.tgt.bin: does not match its checksum .*aiayn prepare CONFIG --out"):
        open_store(out)
    from aiayn.data.pipeline import verify_store

    problems = verify_store(out)
    assert len(problems) == 1 and "train.tgt.bin: does not match its checksum" in problems[0]


def test_verify_reads_every_file_once_whatever_the_memo_says_and_lists_every_damaged_one(tmp_path, monkeypatch):
    """`aiayn prepare --verify` reads every file although the memo knows them all good, each once (it read each
    twice: the opening, then a second hash of every file), writes nothing, and still lists every damaged file, not
    only the first the opening stopped at (which alone is read twice)."""
    from aiayn.data import integrity
    from aiayn.data.pipeline import verify_store

    out = tmp_path / "store"
    store, _, _ = make(tmp_path, out)
    open_store(out)  # the memo: every file found good
    memo = (out / integrity.CHECKED).read_bytes()
    reads = []
    scan, digest = integrity.scan_ids, integrity.sha256_file
    monkeypatch.setattr(integrity, "scan_ids", lambda *a: reads.append("scan") or scan(*a))
    monkeypatch.setattr(integrity, "sha256_file", lambda *a: reads.append("hash") or digest(*a))
    assert verify_store(out) == []
    assert len(reads) == len(store.manifest["files"]) and (out / integrity.CHECKED).read_bytes() == memo
    _id_in_range(out)
    (out / "valid.src.idx").write_bytes((out / "valid.src.idx").read_bytes()[::-1])  # same size, damaged
    reads.clear()
    problems = verify_store(out)
    assert [p.split(": ")[0] for p in problems] == [f"{out}/train.tgt.bin", f"{out}/valid.src.idx"], problems
    assert len(reads) == len(store.manifest["files"]) + 1


@pytest.mark.parametrize("keys", [("files", "checksum"), ("files",), ("checksum",)])
def test_a_store_whose_checksums_were_stripped_is_refused_unless_allowed(tmp_path, capsys, monkeypatch, keys):
    """Issue 70: removing `files` and `checksum` from the manifest and changing one id passed `prepare --verify`
    (exit 0) and trained with a warning. Now one line, exit 2, unless the user says --allow-unverified."""
    from aiayn.cli import main
    from aiayn.data.integrity import ALLOW_UNVERIFIED

    monkeypatch.setenv(ALLOW_UNVERIFIED, "0")  # not allowed; --allow-unverified below sets it, undone at the end
    out = tmp_path / "store"
    make(tmp_path, out)
    manifest = json.loads((out / MANIFEST).read_text())
    for key in keys:
        del manifest[key]
    if "checksum" not in keys:  # the manifest's own checksum taken again, as one who strips them would
        from aiayn.data.integrity import manifest_checksum

        manifest["checksum"] = manifest_checksum(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))
    _id_in_range(out)
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(DataError, match="has no checksums .* --allow-unverified"):
        open_store(out, ("train", "valid"))
    capsys.readouterr()
    assert main(["prepare", "--verify", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no checksums" in err[0], err
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    if "files" in keys:  # said once: opened as before, its contents unverified
        assert main(["prepare", "--verify", str(out), "--allow-unverified"]) == 0
        assert "unverified" in capsys.readouterr().out
    else:  # the files' checksums are still there: they still find the changed id
        assert main(["prepare", "--verify", str(out), "--allow-unverified"]) == 2
        assert "does not match its checksum" in capsys.readouterr().err


def test_a_store_prepared_before_checksums_still_opens_and_says_it_is_unverified(tmp_path, caplog, capsys,
                                                                                 monkeypatch):
    from aiayn.cli import main
    from aiayn.data.integrity import ALLOW_UNVERIFIED

    monkeypatch.setenv(ALLOW_UNVERIFIED, "1")  # --allow-unverified
    out = tmp_path / "store"
    make(tmp_path, out)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["files"], manifest["checksum"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level("WARNING", logger="aiayn.data"):
        store = open_store(out, ("train", "valid"))
    assert len(store.splits["train"]) == 1499
    assert "prepared without checksums (by an older aiayn)" in caplog.text and "unverified" in caplog.text
    capsys.readouterr()
    assert main(["prepare", "--verify", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (f"{out}: its shape and ids are sound; prepared without checksums (by an "
                                               "older aiayn), its contents are unverified")
    _id_past_vocab(out)  # its shape and ids are still checked
    with pytest.raises(DataError, match="past the vocabulary"):
        open_store(out)


@pytest.mark.parametrize("other", [["data.vocab_size=300"], ["data.src_lang=fr"], "inputs"])
def test_a_named_store_of_other_settings_is_refused_never_rebuilt(tmp_path, capsys, other):
    """Issue 62: `aiayn prepare CONFIG --out S --set data.vocab_size=300`, then `aiayn train CONFIG --set
    data.prepared=S` (vocab 512) gave rc 0 and rebuilt S as a vocab-512 store. A store the user named is only read:
    one line naming the store, what differs and the `aiayn prepare` command, exit 2, S byte for byte as it was."""
    from aiayn.cli import main

    train, valid = write_pairs(tmp_path, "train", 1500, 0), write_pairs(tmp_path, "valid", 60, 100)
    sets = [x for kv in ("data.dataset=null", f"data.train_src={train[0]}", f"data.train_tgt={train[1]}",
                         f"data.valid_src={valid[0]}", f"data.valid_tgt={valid[1]}") for x in ("--set", kv)]
    out = tmp_path / "tr" / "other"
    if other == "inputs":  # the same settings, another corpus
        other_train = write_pairs(tmp_path, "train_b", 1500, 7)
        prep = [*sets[:2], "--set", f"data.train_src={other_train[0]}", "--set", f"data.train_tgt={other_train[1]}",
                *sets[6:]]
        want = r"prepared from other inputs \(.*train_b.src"
    else:
        prep = [*sets, "--set", other[0]]
        key, value = other[0].split("=")
        want = {"data.vocab_size": "settings \\(data.vocab_size: 300 in the store, 512 in this config",
                "data.src_lang": "settings \\(data.src_lang/data.tgt_lang: \\['fr', 'de'\\] in the store, "
                                 "\\['en', 'de'\\] in this config"}[key]
    assert main(["prepare", "tiny_reverse", "--out", str(out), *prep]) == 0
    before = _snapshot(out)
    capsys.readouterr()
    run = tmp_path / "run"
    code = main(["train", "tiny_reverse", "--run-dir", str(run), *sets, "--set", f"data.prepared={out}",
                 "--no-progress", "--set", "train.max_updates=1"])
    err = [line for line in capsys.readouterr().err.splitlines() if "aiayn: " in line or "Traceback" in line]
    assert code == 2 and len(err) == 1 and err[0].startswith(f"aiayn: error: {out}: "), err
    import re

    assert re.search(want, err[0]), err[0]
    assert "only read, never rebuilt" in err[0] and "aiayn prepare CONFIG --out" in err[0]
    assert not run.exists() and _snapshot(out) == before


def test_a_named_store_whose_preparing_never_finished_is_refused_by_training(tmp_path, capsys):
    from aiayn.cli import main

    out = tmp_path / "store"
    _, train, valid = make(tmp_path, out)
    sets = [x for kv in ("data.dataset=null", f"data.train_src={train[0]}", f"data.train_tgt={train[1]}",
                         f"data.valid_src={valid[0]}", f"data.valid_tgt={valid[1]}") for x in ("--set", kv)]
    (out / MANIFEST).unlink()  # as a killed `aiayn prepare` leaves it (or a deleted manifest)
    before = _snapshot(out)
    capsys.readouterr()
    assert main(["train", "tiny_reverse", "--run-dir", str(tmp_path / "run"), *sets, "--set",
                 f"data.prepared={out}", "--no-progress", "--set", "train.max_updates=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "an incomplete store (no manifest.json" in err[0], err
    assert f"aiayn prepare CONFIG --out {out}" in err[0] and _snapshot(out) == before


def test_the_budget_log_says_what_the_batches_are_and_a_budget_below_every_pair_is_refused(tmp_path, caplog):
    """Issue 58: with 3 processes data.update_tokens=100 is rounded down to 99, and the log says so and why; with 1
    process data.update_tokens=1 trained while the log said "batches of at most 1 tokens" (every pair formed a batch
    of its own, over the budget): refused in one line; a budget that some pairs exceed says how many train alone."""
    from aiayn.data.pipeline import build_translation_data
    from aiayn.errors import ConfigError

    train, valid = write_pairs(tmp_path, "train", 1500, 0), write_pairs(tmp_path, "valid", 60, 100)
    store = [f"data.prepared={tmp_path / 'store'}"]

    def build(world, *overrides):
        caplog.clear()
        with caplog.at_level("INFO", logger="aiayn.data"):
            return build_translation_data(file_config(train, valid, [*store, *overrides]), tmp_path / "run",
                                          world=world)[0]

    build(3, "data.update_tokens=100")
    assert ("batches of at most 33 tokens; an update: 3 process(es) x 1 batch(es) = at most 99 tokens "
            "(data.update_tokens=100 rounded down to 99: shared out in whole tokens over 3 process(es) x 1 batch(es))"
            ) in caplog.text
    build(2, "data.update_tokens=100")
    assert "= at most 100 tokens (data.update_tokens)\n" in caplog.text + "\n" and "rounded" not in caplog.text
    with pytest.raises(ConfigError, match=r"^data.update_tokens=1 gives each batch 1 token\(s\), fewer than the "
                                          r"shortest training pair needs \(\d+ with its end-of-sequence token\).*"
                                          r"raise it to at least \d+$"):
        build(1, "data.update_tokens=1")
    with pytest.raises(ConfigError, match=r"^data.max_tokens=2 gives each batch 2 token\(s\)"):
        build(1, "data.max_tokens=2")
    costs = build(1).pair_costs()
    middle = int(np.median(costs))
    data = build(1, f"data.max_tokens={middle}")
    over = int((costs > middle).sum())
    assert 0 < over < len(costs)
    assert (f"{over:,} of {len(costs):,} training pairs need more than {middle} tokens (up to {int(costs.max())}): "
            "each of them trains in a batch of its own, over the budget") in caplog.text
    alone = [b for b in data.epoch_plan(0) if data.plan_tokens(b) > middle]
    assert alone and all(len(b) == 1 for b in alone)  # what the line says the plan does


@pytest.mark.parametrize("named", [False, True], ids=["files", "dataset"])
def test_an_input_is_judged_big_by_the_text_read_whether_a_path_or_a_dataset_names_it(tmp_path, monkeypatch, named):
    """With ``workers`` unset, pairs of at least PARALLEL_BYTES are encoded by worker processes: a known dataset's
    inputs are named (``wmt14/<file>/en-de``), not paths, and its pairs are as big as the same pairs in files."""
    from aiayn.data import store as store_mod
    from aiayn.data.pipeline import pair_sources
    from aiayn.data.store import PairRecipe

    cfg = file_config(write_pairs(tmp_path, "train", 300, 0), write_pairs(tmp_path, "valid", 30, 100))
    sources, inputs = pair_sources(cfg)
    if named:
        inputs = {f"toy/{split}/en-de": "published" for split in ("train", "valid")}
    judged, real = [], store_mod.worker_pool
    monkeypatch.setattr(store_mod, "worker_pool",
                        lambda workers, big, *a: judged.append((workers, big)) or real(1, big, *a))
    for limit in (1 << 30, 1000):  # the pairs hold some 20 KB of text
        monkeypatch.setattr(store_mod, "PARALLEL_BYTES", limit)
        (stage := tmp_path / f"stage{limit}").mkdir()
        PairRecipe(cfg=cfg, sources=sources, inputs=inputs).build_into(stage)
    assert judged == [(None, False), (None, True)]
