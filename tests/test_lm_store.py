"""Language models read their corpora from stores (issue 41): a text becomes one flat token stream (the ids and the
split of encoding it in memory, as the training did before), trained on by windows (the batches of cutting the
stream in memory); summarization as language modelling reads (document, summary) pairs and builds its rows when
collated (the rows and batches it built in memory)."""

from __future__ import annotations

import gzip
import json
import pickle
import random

import numpy as np
import pytest
import torch

from aiayn.config import config_from_dict
from aiayn.data import stream_store
from aiayn.data.synthetic import WORDS
from aiayn.data.tokenizer import PAD_ID, TokenizerPair, TokenizerSpec, train_tokenizer_pair
from aiayn.errors import DataError

TINY = {"d_model": 32, "n_heads": 2, "d_ff": 64, "dropout": 0.0, "n_decoder_layers": 1}


# What the training did with the corpus in memory, before the stores: frozen here as the oracle ------------------


def _old_lm_blocks(ids, block_size, seed=1, epoch=0, shuffle=True):
    from aiayn.data.batching import _rng

    n = ids.numel()
    rng = _rng(seed, epoch)
    offset = min(rng.randrange(block_size), n - block_size - 1) if shuffle else 0
    blocks = ids[offset:].unfold(0, block_size + 1, block_size)
    if shuffle:
        perm = torch.randperm(blocks.size(0), generator=torch.Generator().manual_seed(rng.getrandbits(63)))
        return blocks[perm].long()
    return blocks.clone().long()


def _old_lm_batches(blocks, batch_size, pad_id=PAD_ID):
    out = []
    for start in range(0, blocks.size(0), batch_size):
        b = blocks[start : start + batch_size]
        tgt_out = b[:, 1:]
        out.append((b[:, :-1], tgt_out, int((tgt_out != pad_id).sum()), list(range(start, start + b.size(0)))))
    return out


def _old_valid_batches(valid_ids, block_size, batch_size):
    n = (valid_ids.numel() - 1) // block_size
    blocks = torch.stack([valid_ids[i * block_size : (i + 1) * block_size + 1] for i in range(n)])
    return _old_lm_batches(blocks, batch_size)


def _old_lm(text, cfg, tdir):
    """The in-memory path: nanoGPT's split in characters, the tokenizer trained on the training part's lines (on
    its whole text for characters), each part encoded in one call."""
    split = int(len(text) * (1 - cfg.data.valid_fraction))
    train_text, valid_text = text[:split], text[split:]
    lines = [ln for ln in train_text.splitlines() if ln.strip()]
    if cfg.data.tokenizer == "char":
        lines = [train_text]
    tok = train_tokenizer_pair(lines, [], tdir, TokenizerSpec.from_config(cfg))
    return tok, tok.src.encode(train_text), tok.src.encode(valid_text)


def _same(batch, old) -> None:
    tgt_in, tgt_out, ntokens, indices = old
    assert batch.src is None and torch.equal(batch.tgt_in, tgt_in) and torch.equal(batch.tgt_out, tgt_out)
    assert batch.ntokens == ntokens and batch.indices == indices


# Texts ------------------------------------------------------------------------------------------------------------


def _text(seed: int, lines: int = 900, extra: str = "") -> str:
    """Play-like text: speakers, verse lines of code words, blank lines, CRLF endings, a line far longer than a
    read (cut before a space), and ``extra`` words (non-ASCII ones move bytes away from characters)."""
    rng = random.Random(seed)
    words = WORDS + extra.split()
    out = ["\ufeff"]
    for i in range(lines):
        if i % 9 == 0:
            out.append(f"\n{rng.choice(words).upper()}:\n")
        out.append(" ".join(rng.choice(words) for _ in range(rng.randint(2, 9))) + rng.choice([".", ",", "!", ""]))
        out.append("\r\n" if i % 17 == 5 else "\n")
        if i == 300:
            out.append(" ".join(rng.choice(words) for _ in range(900)) + "\n")
    return "".join(out)


def _lm_config(path, tokenizer: str, **data):
    return config_from_dict({"task": "lm", "model": {**TINY, "max_positions": 32},
                             "data": {"train_src": str(path), "tokenizer": tokenizer, "vocab_size": 400,
                                      "block_size": 16, "batch_size": 8, **data}})


@pytest.mark.parametrize("tokenizer, extra, gz, workers", [
    ("char", "", False, 1), ("char", "grüße naïve 東京 ça", True, 1), ("bpe", "", False, 1),
    ("bpe", "grüße naïve ça", False, 2)])  # 2: pieces encoded by worker processes, in order
def test_the_stream_store_holds_the_split_and_ids_of_encoding_each_part_in_one_call(tmp_path, monkeypatch,
                                                                                    tokenizer, extra, gz, workers):
    text = _text(1, extra=extra)
    path = tmp_path / ("corpus.txt.gz" if gz else "corpus.txt")
    raw = text.encode("utf-8")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    monkeypatch.setattr(stream_store, "READ_BYTES", 2000)  # many pieces: lines cut, one line cut before spaces
    cfg = _lm_config(path, tokenizer)
    from aiayn.data.store import prepare_store

    built = prepare_store(tmp_path / "store", stream_store.stream_recipe(cfg, workers=workers))
    old_tok, old_train, old_valid = _old_lm(text[1:], cfg, tmp_path / "old_tok")  # read_text drops the BOM
    tok = TokenizerPair.load(built.tokenizer_dir)
    assert [tok.src.id_to_piece(i) for i in range(tok.src.vocab_size)] == \
           [old_tok.src.id_to_piece(i) for i in range(old_tok.src.vocab_size)]
    assert built.splits["train"].read().tolist() == old_train
    assert built.splits["valid"].read().tolist() == old_valid
    chars = len(text) - 1
    assert built.manifest["chars"] == {"train": int(chars * 0.9), "valid": chars - int(chars * 0.9)}


def test_lm_data_gives_the_batches_of_cutting_the_stream_in_memory_and_pickles_small(tmp_path):
    from aiayn.data.pipeline import build_lm_data

    path = tmp_path / "corpus.txt"
    path.write_text(_text(2, lines=400), encoding="utf-8")
    cfg = _lm_config(path, "char")
    data, tok = build_lm_data(cfg, tmp_path / "run")
    train = torch.tensor(data.train.read().tolist())
    valid = torch.tensor(data.valid.read().tolist())
    for epoch in (0, 1, 2):
        plan = data.epoch_plan(epoch)
        old = _old_lm_batches(_old_lm_blocks(train, 16, cfg.train.seed, epoch), 8)
        assert len(plan) == len(old)
        for item, o in zip(plan, old):
            batch = data.collate_plan(item)
            _same(batch, o)
            assert data.plan_tokens(item) == batch.ntokens
        # what a process takes of the plan: a slice (of a slice), each batch planned as the whole plan plans it
        mine = plan[1::2][:3]
        assert [m.tolist() for m in mine] == [plan[i].tolist() for i in (1, 3, 5)]
        assert [m.tolist() for m in pickle.loads(pickle.dumps(mine))] == [m.tolist() for m in mine]
    old_valid = _old_valid_batches(valid, 16, 8)
    assert len(data.valid_batches) == len(old_valid)
    for batch, o in zip(data.valid_batches, old_valid):
        _same(batch, o)
    assert [b.indices for b in data.valid_batches[1::2]] == [o[3] for o in old_valid[1::2]]
    # a DataLoader worker gets the data by pickle: file names, no ids; it collates the same batches
    blob = pickle.dumps(data)
    assert len(blob) < 1000
    again = pickle.loads(blob)
    item = data.epoch_plan(1)[2]
    assert torch.equal(again.collate_plan(item).tgt_out, data.collate_plan(item).tgt_out)


def test_a_training_prepares_its_store_in_the_cache_once_and_a_resume_uses_it(tmp_path, monkeypatch):
    """build_lm_data without data.prepared: the store goes to $AIAYN_CACHE_DIR/stores/<key> and its tokenizer into
    the run; a second run (or a resume, whose run has the tokenizer) uses the same store, building nothing."""
    from aiayn.data import pipeline

    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "corpus.txt"
    path.write_text(_text(3, lines=200), encoding="utf-8")
    cfg = _lm_config(path, "char")
    data, _ = pipeline.build_lm_data(cfg, tmp_path / "run")
    store = data.train.path.parent
    assert store.parent == tmp_path / "cache" / "stores"
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()
    built = []
    real = stream_store.StreamRecipe.build_into
    monkeypatch.setattr(stream_store.StreamRecipe, "build_into",
                        lambda self, stage: built.append(1) or real(self, stage))
    for run in ("run", "run2"):  # the resume keeps its tokenizer, which is the store's: the same store
        again, _ = pipeline.build_lm_data(cfg, tmp_path / run)
        assert again.train.path == data.train.path and not built
    # a run whose tokenizer is another (init_from) gets a store of its own, with that tokenizer's ids
    (tmp_path / "other").mkdir()
    train_tokenizer_pair([path.read_text() + "§"], [], tmp_path / "other" / "tokenizer", kind="char")
    other, tok = pipeline.build_lm_data(cfg, tmp_path / "other")
    assert built and other.train.path.parent != store
    assert tok.src.decode(other.train.read(0, 50).tolist()) == path.read_text(encoding="utf-8-sig")[:50]


def test_aiayn_prepare_and_data_prepared_for_a_language_model(tmp_path, capsys):
    from aiayn.cli import main

    path = tmp_path / "corpus.txt"
    path.write_text(_text(4, lines=200), encoding="utf-8")
    out = tmp_path / "prepared"
    sets = ["--set", "task=lm", "--set", "data.dataset=null", "--set", f"data.train_src={path}", "--set",
            "data.tokenizer=char", "--set", "data.block_size=16", "--set", "model.max_positions=32"]
    assert main(["prepare", "lm_tinyshakespeare_char_quick", "--out", str(out), *sets]) == 0
    printed = capsys.readouterr().out
    assert "train: " in printed and " tokens (uint16)" in printed and f"data.prepared={out}" in printed
    (out / "train.bin").write_bytes((out / "train.bin").read_bytes()[:-2])  # damaged: refused, one line, exit 2
    run = tmp_path / "run"
    code = main(["train", "lm_tinyshakespeare_char_quick", "--run-dir", str(run), *sets,
                 "--set", f"data.prepared={out}", "--set", "train.max_updates=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "train.bin" in err[0] and f"aiayn prepare CONFIG --out {out}" in err[0]
    assert main(["prepare", "lm_tinyshakespeare_char_quick", "--out", str(out), *sets]) == 0  # rebuilt
    from aiayn.data.store import STREAM_KIND, open_kind

    assert open_kind(out, STREAM_KIND).splits["train"].tokens > 0


def test_bad_lm_corpora_are_one_line(tmp_path):
    for name, content, message in (("blank.txt", b"  \n\n", "empty"),
                                   ("latin1.txt", b"ok\nfine\ncaf\xe9\n", r"line 3: not valid UTF-8 \(byte 0xe9")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=message):
            stream_store.stream_recipe(_lm_config(tmp_path / name, "char"), workers=1).build_into(tmp_path)


# Summarization as language modelling ------------------------------------------------------------------------------


def _articles(path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6))) + "." for _ in range(rng.randint(2, 4))]
        summary = " ".join(reversed(sents[0][:-1].split())) if i % 23 else ""  # a few empty: dropped
        rows.append({"document": "\n".join(sents), "summary": summary})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _old_summary_rows(cfg, tok, split):
    """The rows the in-memory path built: each article encoded, cut to the block, dropped when empty or when
    its summary leaves no room."""
    from aiayn.data.registry import pairs as summary_pairs
    from aiayn.data.summarization import lm_sequence_ids, separator_ids

    sep_ids = separator_ids(tok.src, cfg.data.separator)
    rows = []
    for doc, summ in summary_pairs(cfg, split):
        if doc and summ:
            row = lm_sequence_ids(tok.src.encode(doc), tok.src.encode(summ), sep_ids, cfg.data.block_size)
            if row is not None:
                rows.append(row)
    return rows


def _old_summary_batches(rows, cfg, epoch, shuffle):
    from aiayn.data.batching import pad_batch, token_batches

    budget = cfg.data.batch_size * (cfg.data.block_size + 1)
    out = []
    for idx in token_batches([len(r) - 1 for r in rows], None, budget, cfg.train.seed, epoch, shuffle=shuffle):
        padded = pad_batch([rows[i] for i in idx], PAD_ID)
        out.append((padded[:, :-1], padded[:, 1:], int((padded[:, 1:] != PAD_ID).sum()), list(idx)))
    return out


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_summary_lm_rows_and_batches_are_those_built_in_memory(tmp_path, tokenizer):
    from aiayn.data.pipeline import build_lm_data
    from aiayn.data.registry import pairs as summary_pairs

    for name, n, seed in (("train", 150, 1), ("valid", 30, 2)):
        _articles(tmp_path / f"{name}.jsonl", n, seed)
    cfg = config_from_dict({"task": "lm", "model": {**TINY, "max_positions": 48},
                            "data": {"train_src": str(tmp_path / "train.jsonl"),
                                     "valid_src": str(tmp_path / "valid.jsonl"), "format": "jsonl",
                                     "src_field": "document", "tgt_field": "summary", "tokenizer": tokenizer,
                                     "vocab_size": 400, "block_size": 48, "batch_size": 4}})
    data, tok = build_lm_data(cfg, tmp_path / "run")
    # the tokenizer trained as the in-memory path trained it: documents and summaries in corpus order, the separator
    texts = [t for pair in summary_pairs(cfg, "train") for t in pair] + [cfg.data.separator]
    symbols = [cfg.data.separator.strip()] if tokenizer == "bpe" else []
    old_tok = train_tokenizer_pair(texts, [], None, TokenizerSpec.from_config(cfg, symbols))
    assert [tok.src.id_to_piece(i) for i in range(tok.src.vocab_size)] == \
           [old_tok.src.id_to_piece(i) for i in range(old_tok.src.vocab_size)]
    rows = _old_summary_rows(cfg, tok, "train")
    assert 100 < len(rows) == len(data.rows["train"]) < 150  # some dropped: empty summaries, long ones
    assert data.rows["train"].rows(np.arange(len(rows))) == rows
    for epoch in (0, 1):
        plan = data.epoch_plan(epoch)
        old = _old_summary_batches(rows, cfg, epoch, shuffle=True)
        assert len(plan) == len(old)
        for item, o in zip(plan, old):
            batch = data.collate_plan(item)
            _same(batch, o)
            assert data.plan_tokens(item) == batch.ntokens
    old_valid = _old_summary_batches(_old_summary_rows(cfg, tok, "valid"), cfg, 0, shuffle=False)
    for batch, o in zip(data.valid_batches, old_valid, strict=True):
        _same(batch, o)
    again = pickle.loads(pickle.dumps(data))
    assert len(pickle.dumps(data)) < 2000
    assert torch.equal(again.collate_plan(plan[0]).tgt_in, data.collate_plan(plan[0]).tgt_in)


def test_a_named_lm_store_is_only_read_its_checksums_catch_an_id_in_range_and_other_settings_are_refused(
        tmp_path, capsys):
    """A language model's stream store has a checksum per file too: one id overwritten by another of the vocabulary
    is refused (training and `aiayn prepare --verify`), as is a named store of another tokenizer; the store is left
    byte for byte as it was."""
    import numpy as np

    from aiayn.cli import main

    path = tmp_path / "corpus.txt"
    path.write_text(_text(4, lines=200), encoding="utf-8")
    out = tmp_path / "prepared"
    sets = ["--set", "task=lm", "--set", "data.dataset=null", "--set", f"data.train_src={path}", "--set",
            "data.tokenizer=char", "--set", "data.block_size=16", "--set", "model.max_positions=32"]
    assert main(["prepare", "lm_tinyshakespeare_char_quick", "--out", str(out), *sets]) == 0

    def snapshot():
        return {p.name: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    train = ["train", "lm_tinyshakespeare_char_quick", "--run-dir", str(tmp_path / "run"), "--set",
             f"data.prepared={out}", "--set", "train.max_updates=1"]
    capsys.readouterr()
    assert main([*train, *sets[:-4], "--set", "data.tokenizer=bpe", *sets[-2:]]) == 2  # another tokenizer
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.tokenizer: 'char' in the store, 'bpe' in this config" in err[0], err
    ids = np.fromfile(out / "train.bin", dtype="<u2")
    ids[3] = 1 if ids[3] != 1 else 2
    ids.tofile(out / "train.bin")
    before = snapshot()
    assert main([*train, *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.bin: does not match its checksum" in err[0], err
    assert f"aiayn prepare CONFIG --out {out}" in err[0] and not (tmp_path / "run").exists()
    assert main(["prepare", "--verify", str(out)]) == 2
    assert "train.bin: does not match its checksum" in capsys.readouterr().err
    assert snapshot() == before


def test_a_stream_reads_ids_by_position_and_refuses_a_range_outside_it_or_backwards(tmp_path):
    """``read(start, stop)`` is ids[start:stop]; a stop before its start is refused as any range outside the
    stream is (an IndexError naming it), not numpy's 'negative dimensions are not allowed'."""
    from aiayn.data.store import Stream

    np.arange(10, dtype="<u2").tofile(tmp_path / "train.bin")
    stream = Stream(tmp_path / "train.bin", "uint16", 10)
    assert stream.read().tolist() == list(range(10)) and stream.read(2, 5).tolist() == [2, 3, 4]
    assert stream.read(5, 5).tolist() == [] and stream.read(7).tolist() == [7, 8, 9]
    for start, stop in ((5, 2), (-1, 3), (0, 11), (11, None)):
        with pytest.raises(IndexError, match=rf"ids {start}\.\.{10 if stop is None else stop} of 10$"):
            stream.read(start, stop)
