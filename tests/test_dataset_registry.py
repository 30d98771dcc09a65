"""The dataset registry (aiayn/data/registry.py): one lookup per config, each entry's pairs, streams, identity and
test splits. The identities are the token stores' keys: they must stay byte for byte what they were, or every
prepared store would be refused (a named store is never rebuilt for another key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.config import Config, ConfigError, DataConfig
from aiayn.data import registry
from aiayn.data.corpus import DataError
from aiayn.data.datasets import DATASETS, MULTI30K_SPLITS
from aiayn.data.registry import FILES, REGISTRY, config_pairs, dataset_of, lookup, pairs
from aiayn.task import TASKS

T, S, LM = TASKS["translation"], TASKS["summarization"], TASKS["lm"]


def cfg(task: str = "translation", **data) -> Config:
    return Config(task=task, data=DataConfig(**data))


def test_the_named_identities_are_the_store_keys_of_before(monkeypatch):
    d = DataConfig(dataset="multi30k", src_lang="de", tgt_lang="en")
    assert REGISTRY["multi30k"].sources(d, T)[1] == {"multi30k/train/de-en": "published",
                                                     "multi30k/valid/de-en": "published"}
    assert REGISTRY["reverse"].sources(d, T)[1] == {"reverse/train": "synthetic:20000:1",
                                                    "reverse/valid": "synthetic:300:2"}
    sha = DATASETS["xsum"].files["xsum-1000.jsonl"].sha256
    assert REGISTRY["xsum"].sources(d, S)[1] == {"xsum/train": sha, "xsum/valid": sha}
    assert REGISTRY["xsum"].sources(d, LM)[1] == {"xsum/xsum-1000.jsonl/train(0, 800)": sha,
                                                  "xsum/xsum-1000.jsonl/valid(800, 900)": sha}
    wmt = REGISTRY["wmt14"].sources(DataConfig(dataset="wmt14"), T)[1]
    assert list(wmt) == [*(f"wmt14/{n}/en-de" for n in DATASETS["wmt14"].files), "sacrebleu/wmt13/en-de"]
    monkeypatch.setattr(registry, "dataset_path", lambda name, file: Path("/data") / name / file)  # no download
    assert REGISTRY["tinyshakespeare"].text(DataConfig()) == (
        Path("/data/tinyshakespeare/input.txt"),
        {"tinyshakespeare/input.txt": DATASETS["tinyshakespeare"].files["input.txt"].sha256})


def test_the_config_files_are_read_as_the_task_says(tmp_path):
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("a  b\nc\n", encoding="utf-8")
    tgt.write_text("x\ny   z\n", encoding="utf-8")
    files = {"train_src": str(src), "train_tgt": str(tgt), "valid_src": str(src), "valid_tgt": str(tgt)}
    assert dataset_of(cfg(**files)) is FILES
    assert pairs(cfg(**files), "train") == [("a  b", "x"), ("c", "y   z")]  # a translation's lines as they are
    assert pairs(cfg("summarization", **files), "valid") == [("a b", "x"), ("c", "y z")]  # one line, one space
    streams, ident = FILES.sources(cfg(**files).data, T)
    assert list(streams["train"]()) == [("a  b", "x"), ("c", "y   z")] and set(ident) == {str(src), str(tgt)}
    with pytest.raises(DataError, match=r"split 'test': expected train or valid$"):
        pairs(cfg(**files), "test")
    with pytest.raises(DataError, match="data.train_src is not set"):
        pairs(cfg(), "train")
    assert config_pairs(cfg(**files).data, "train") == pairs(cfg(**files), "train")


def test_one_lookup_refuses_what_the_task_cannot_read_in_one_line():
    assert lookup("xsum", T) is lookup("xsum", S) is lookup("xsum", LM) is REGISTRY["xsum"]
    assert lookup("reverse", S) is REGISTRY["reverse"]
    with pytest.raises(DataError, match=r"^dataset 'tinyshakespeare' is not a translation corpus \(known: multi30k, "
                                        r"reverse, wmt14\)$"):
        lookup("tinyshakespeare", T)
    with pytest.raises(DataError, match=r"^dataset 'multi30k' is not a summarization corpus \(known: xsum\)$"):
        lookup("multi30k", S)
    with pytest.raises(ConfigError, match=r"data.dataset='multi30k' is not a language-modelling corpus \(task lm: "
                                          r"tinyshakespeare, xsum, or data.train_src: a text file\)"):
        lookup("multi30k", LM)
    with pytest.raises(DataError, match="dataset 'nope' is not a translation corpus"):
        dataset_of(cfg(dataset="nope"))


def test_what_each_entry_says_of_itself():
    assert REGISTRY["multi30k"].test_splits == tuple(s for s in MULTI30K_SPLITS if s.startswith("test"))
    assert REGISTRY["multi30k"].test_splits[0] == "test_2016_flickr"  # the demo's
    assert REGISTRY["reverse"].test_splits == REGISTRY["wmt14"].test_splits == ("test",)
    assert FILES.test_splits == REGISTRY["xsum"].test_splits == ()
    assert [n for n, d in REGISTRY.items() if d.shared_store] == ["multi30k"] and FILES.shared_store
    assert [n for n, d in REGISTRY.items() if d.lead_1] == ["xsum"]
    # (document, summary) data: a language model of it trains on rows (tests/test_task.py)
    assert REGISTRY["xsum"].summaries(DataConfig()) and FILES.summaries(DataConfig(format="jsonl"))
    assert not REGISTRY["tinyshakespeare"].summaries(DataConfig()) and not FILES.summaries(DataConfig())
    assert pairs(cfg(dataset="reverse"), "test")[:1] == REGISTRY["reverse"].pairs(DataConfig(), S, "test")[:1]
    with pytest.raises(DataError, match="wmt14's 4.5M training pairs are streamed"):
        pairs(cfg(dataset="wmt14"), "train")


def test_a_new_dataset_is_one_entry_of_the_registry(monkeypatch, tmp_path):
    """The cost of a new dataset, measured (docs/architecture.md, "Cost of a change"): a reader and one entry of
    the registry, added from this file alone, are what a config names: its pairs train a run (its identity keys
    the store) and its test split is evaluated."""
    from aiayn.config import load_config
    from aiayn.data.synthetic import reverse_pairs
    from aiayn.eval.evaluate import EvalData, evaluate_run
    from aiayn.train.run import train

    class Toy(registry.Named):  # a known dataset of its own: three fixed splits
        name, kind, test_splits = "toy", T, ("test",)

        def split_pairs(self, data: DataConfig, split: str) -> list[tuple[str, str]]:
            sizes = {"train": (400, 1), "valid": (20, 2), "test": (10, 3)}
            if split not in sizes:
                raise DataError(f"toy has no split {split!r}")
            return reverse_pairs(*sizes[split])

    monkeypatch.setattr(registry, "REGISTRY", {**registry.REGISTRY, "toy": Toy()})
    cfg = load_config("tiny_reverse", [
        "data.dataset=toy", "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=512", "train.max_updates=4",
        "train.warmup=2", "train.eval_every=4", "train.save_every=4", "train.threads=1", "decode.beam=1"])
    assert dataset_of(cfg) is registry.REGISTRY["toy"]
    train(cfg, tmp_path / "run", progress=False)
    result = evaluate_run(tmp_path / "run", EvalData(split="test"))
    assert result["data"] == {"split": "test", "dataset": "toy"} and result["n_sentences"] == 10
    assert "bleu" in result["scores"]
