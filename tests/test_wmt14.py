"""The paper's WMT14 En-De data (issue 31): the three training tarballs downloaded, sha256-checked and extracted
once, streamed pair by pair into a prepared store; newstest2013/2014 through sacreBLEU. Offline: small
tarballs with the real member layout stand in for the 1.6 GB of downloads, and sacreBLEU's file lookup is
replaced by local files."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from aiayn import files
from aiayn.config import load_config
from aiayn.data import datasets
from aiayn.data.corpus import DataError

REPO = Path(__file__).resolve().parents[1]


def _tarball(path: Path, members: dict[str, str]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_wmt14(tmp_path: Path, monkeypatch):
    """Three small tarballs laid out as statmt.org's (other language pairs beside the de-en files)."""
    monkeypatch.delenv(datasets.DATA_DIR_ENV, raising=False)
    monkeypatch.setenv(files.CACHE_DIR_ENV, str(tmp_path / "cache"))
    web = tmp_path / "web"
    web.mkdir()
    rows, expected = [], []
    for i, (url, _, size, member) in enumerate(datasets._WMT14_TRAIN):
        name = url.rsplit("/", 1)[1]
        en = [f"corpus {i} sentence {j} ." for j in range(5)]
        de = [f"Korpus {i} Satz {j} ." for j in range(5)]
        expected += list(zip(en, de))
        other = member.replace("de-en", "fr-en")
        sha = _tarball(web / name, {f"{member}.en": "\n".join(en) + "\n", f"{member}.de": "\n".join(de) + "\n",
                                    f"{other}.en": "x\n", f"{other}.fr": "y\n"})
        rows.append(((web / name).as_uri(), sha, size, member))
    monkeypatch.setattr(datasets, "_WMT14_TRAIN", tuple(rows))
    monkeypatch.setitem(datasets.DATASETS, "wmt14", datasets.Dataset(
        "wmt14", {u.rsplit("/", 1)[1]: datasets.RemoteFile(u, s) for u, s, _, _ in rows}))
    return tmp_path, expected


def test_training_pairs_are_downloaded_checked_extracted_once_and_streamed(fake_wmt14):
    tmp_path, expected = fake_wmt14
    pairs = datasets.wmt14_train_pairs("en", "de")
    assert not isinstance(pairs, list)  # a stream, not a list of 4.5M pairs
    assert list(pairs) == expected
    assert list(datasets.wmt14_train_pairs("de", "en")) == [(d, e) for e, d in expected]
    extracted = tmp_path / "cache" / "wmt14" / "extracted"
    stamp = {p.name: p.stat().st_mtime_ns for p in extracted.iterdir()}
    assert sorted(stamp) == sorted(f"{m.rsplit('/', 1)[-1]}.{x}" for _, _, _, m in datasets._WMT14_TRAIN
                                   for x in ("en", "de", "json"))
    datasets.wmt14_train_files()
    assert {p.name: p.stat().st_mtime_ns for p in extracted.iterdir()} == stamp  # not extracted again
    (extracted / "commoncrawl.de-en.de").write_text("cut", encoding="utf-8")  # a damaged extraction
    assert list(datasets.wmt14_train_pairs()) == expected  # is extracted again from the checked tarball


def test_a_tarball_with_another_sha256_is_refused(fake_wmt14, monkeypatch):
    tmp_path, _ = fake_wmt14
    url, _, size, member = datasets._WMT14_TRAIN[0]
    wrong = datasets.RemoteFile(url, "0" * 64)
    files = dict(datasets.DATASETS["wmt14"].files)
    files[url.rsplit("/", 1)[1]] = wrong
    monkeypatch.setitem(datasets.DATASETS, "wmt14", datasets.Dataset("wmt14", files))
    monkeypatch.setattr(datasets, "_WMT14_TRAIN", ((url, "0" * 64, size, member), *datasets._WMT14_TRAIN[1:]))
    with pytest.raises(DataError, match="sha256 mismatch"):
        list(datasets.wmt14_train_pairs())
    assert not list((tmp_path / "cache" / "wmt14").glob("*.tgz"))  # the wrong download was not kept


def test_valid_and_test_are_newstest2013_and_2014_through_sacrebleu(tmp_path, monkeypatch):
    import sacrebleu.utils

    asked = []

    def source(name, pair):
        asked.append((name, pair))
        p = tmp_path / f"{name.replace('/', '_')}.src"
        p.write_text("a b\nc d\n", encoding="utf-8")
        return str(p)

    def refs(name, pair):
        p = tmp_path / f"{name.replace('/', '_')}.ref"
        p.write_text("A B\nC D\n", encoding="utf-8")
        return [str(p)]

    monkeypatch.setattr(sacrebleu.utils, "get_source_file", source)
    monkeypatch.setattr(sacrebleu.utils, "get_reference_files", refs)
    assert datasets.wmt14_split("valid") == [("a b", "A B"), ("c d", "C D")]
    datasets.wmt14_split("test")
    datasets.wmt14_split("newstest2014", "de", "en")
    assert asked == [("wmt13", "en-de"), ("wmt14/full", "en-de"), ("wmt14/full", "de-en")]
    with pytest.raises(DataError, match="English-German"):
        datasets.wmt14_split("valid", "en", "fr")
    with pytest.raises(DataError, match="no split 'dev'"):
        datasets.wmt14_split("dev")


def test_the_recipe_is_the_papers_and_its_store_may_live_in_the_cache():
    cfg = load_config(REPO / "configs" / "wmt14_en_de.yaml")
    assert (cfg.data.dataset, cfg.data.vocab_size, cfg.data.shared_vocab, cfg.data.update_tokens) == (
        "wmt14", 37000, True, 25000)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.d_ff, cfg.model.n_encoder_layers) == (512, 8, 2048, 6)
    assert (cfg.train.warmup, cfg.train.max_updates, cfg.train.label_smoothing, cfg.decode.beam) == (
        4000, 100000, 0.1, 4)
    assert load_config(REPO / "configs" / "wmt14_en_de.yaml", ["data.prepared=null"]).data.prepared is None


def test_prepare_streams_the_training_pairs_into_a_store(fake_wmt14, tmp_path, monkeypatch):
    import sacrebleu.utils

    from aiayn.data.pipeline import prepare_corpus

    _, expected = fake_wmt14
    valid = tmp_path / "valid.txt"
    valid.write_text("corpus 0 sentence 1 .\n", encoding="utf-8")
    monkeypatch.setattr(sacrebleu.utils, "get_source_file", lambda name, pair: str(valid))
    monkeypatch.setattr(sacrebleu.utils, "get_reference_files", lambda name, pair: [str(valid)])
    cfg = load_config(REPO / "configs" / "wmt14_en_de.yaml",
                      [f"data.prepared={tmp_path / 'store'}", "data.vocab_size=40", "data.byte_fallback=false",
                       "model.d_model=32", "model.n_heads=2", "model.d_ff=64"])
    store = prepare_corpus(cfg, tmp_path / "store")
    assert store.manifest["splits"]["train"]["pairs"] == len(expected)
    assert store.manifest["splits"]["valid"]["pairs"] == 1
    assert any(k.startswith("wmt14/training-parallel-europarl-v7.tgz") for k in store.manifest["inputs"])
