"""The shipped recipes: every YAML in configs/ loads, and the paired Multi30k recipes stay in step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from aiayn.config import ConfigError, config_from_dict, load_config
from aiayn.model.transformer import build_model, count_parameters

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads_and_says_what_it_is(path: Path) -> None:
    load_config(path)  # raises ConfigError on an unknown key, a wrong type or an impossible shape
    assert path.read_text().startswith("# "), f"{path.name}: a recipe opens with a comment saying what it is"


@pytest.mark.parametrize("name", ["multi30k_en_de", "multi30k_en_de_quick"])
def test_multi30k_recipes_differ_from_their_reverse_only_in_direction(name: str) -> None:
    fwd = load_config(REPO / "configs" / f"{name}.yaml")
    rev = load_config(REPO / "configs" / f"{name.replace('en_de', 'de_en')}.yaml")
    assert (fwd.data.src_lang, fwd.data.tgt_lang) == ("en", "de")
    assert (rev.data.src_lang, rev.data.tgt_lang) == ("de", "en")
    swapped = dataclasses.replace(rev.data, src_lang="en", tgt_lang="de")
    # what a recipe's updates gave is measured per direction (the expect section), so it is not compared
    assert (fwd.model, fwd.data, fwd.train, fwd.decode) == (rev.model, swapped, rev.train, rev.decode)


def test_full_multi30k_recipe_has_the_size_the_readme_reports() -> None:
    """README / docs report 2.35M parameters with the shared 8,000-piece vocabulary."""
    cfg = load_config(REPO / "configs" / "multi30k_en_de.yaml")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=cfg.data.vocab_size)
    n = count_parameters(build_model(model_cfg, cfg.task))
    assert round(n / 1e6, 2) == 2.35
    assert cfg.train.max_updates == 8000 and cfg.train.average_last == 5 and cfg.model.dropout == 0.3


def test_pretokenize_is_off_by_default_and_only_for_translation() -> None:
    assert config_from_dict({}).data.pretokenize == "none"
    cfg = load_config(REPO / "configs" / "multi30k_en_de.yaml", ["data.pretokenize=moses"])
    assert cfg.data.pretokenize == "moses"
    with pytest.raises(ConfigError, match="data.pretokenize='spacy': expected one of none, moses"):
        config_from_dict({"data": {"pretokenize": "spacy"}})
    with pytest.raises(ConfigError, match="data.pretokenize='moses' is for translation, not task lm"):
        config_from_dict({"task": "lm", "data": {"pretokenize": "moses"}})


def test_lowercase_is_off_by_default_and_needs_bpe() -> None:
    assert config_from_dict({}).data.lowercase is False
    assert load_config(REPO / "configs" / "multi30k_en_de.yaml", ["data.lowercase=true"]).data.lowercase is True
    with pytest.raises(ConfigError, match="data.lowercase needs data.tokenizer: bpe"):
        config_from_dict({"data": {"tokenizer": "char", "lowercase": True}})


def test_every_config_key_is_documented():
    """docs/configuration.md names every key of every section, so the reference cannot fall behind."""
    import re

    from aiayn.config import Config

    doc = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = []
    for name in ("model", "data", "train", "decode", "expect"):
        part = doc.split(f"## {name}:", 1)
        body = part[1].split("\n## ", 1)[0] if len(part) == 2 else ""
        for f in dataclasses.fields(getattr(Config(), name)):
            if not re.search(rf"`{f.name}`", body):
                missing.append(f"{name}.{f.name}")
    assert missing == [] and "`task`" in doc


def test_a_base_extends_its_own_base_and_a_cycle_is_refused(tmp_path: Path) -> None:
    # the base's own base was dropped without a word: a recipe on a recipe on "tiny" built paper-base's width
    (tmp_path / "mid.yaml").write_text("base: tiny\ntrain:\n  max_updates: 7\n")
    (tmp_path / "top.yaml").write_text(f"base: {tmp_path / 'mid.yaml'}\ntrain:\n  warmup: 9\n")
    cfg = load_config(tmp_path / "top.yaml")
    assert (cfg.model.d_model, cfg.train.max_updates, cfg.train.warmup) == (64, 7, 9)
    (tmp_path / "a.yaml").write_text(f"base: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="a recipe cannot extend itself"):
        load_config(tmp_path / "a.yaml")


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys silently; a recipe must not train with a setting its reader missed."""
    p = tmp_path / "twice.yaml"
    p.write_text("task: translation\ntrain:\n  warmup: 10\n  max_updates: 5\n  warmup: 20\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"twice.yaml: line 5: the key 'warmup' is given twice"):
        load_config(p)


def test_a_config_is_the_same_on_every_machine_and_the_memory_check_is_before_the_model_is_built(
        tmp_path, monkeypatch, tiny_run):
    """The same YAML gives the same ModelConfig on a 2 GB and a 64 GB machine; a model too big for the machine is
    refused, in one line, by what trains or opens a run (aiayn train before anything is written, load_run), before
    the model is built; the model itself knows no host (build_model builds what it is given)."""
    import aiayn.device as device_module
    from aiayn.config import ConfigError, load_config
    from aiayn.device import check_fits_in_memory
    from aiayn.model import build_model
    from aiayn.run.directory import load_run
    from aiayn.train.run import train

    made = {}
    for gib in (2, 64):
        monkeypatch.setattr(device_module, "physical_memory", lambda gib=gib: gib * 2**30)
        made[gib] = load_config("paper-big")
    assert made[2] == made[64] and made[2].model.memory_bytes() > 2**20
    monkeypatch.setattr(device_module, "physical_memory", lambda: 2**20)  # 1 MiB
    cfg = load_config("tiny_reverse")
    with pytest.raises(ConfigError, match=r"^model: its weights .* more than this machine's 0.0 GiB$"):
        check_fits_in_memory(cfg.model)
    assert build_model(cfg.model, cfg.task) is not None
    with pytest.raises(ConfigError, match="more than this machine's"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(device_module, "physical_memory", lambda: 2**10)  # 1 KiB: less than the tiny run's model
    with pytest.raises(ConfigError, match="more than this machine's"):
        load_run(tiny_run, "cpu")


OLD_RUN = REPO / "results" / "multi30k_en_de_quick_busy_2026-11-25"  # written when expect's keys sat under train


def test_an_old_run_config_with_expect_keys_under_train_loads_with_them_in_expect(tmp_path: Path) -> None:
    """A run directory's config.yaml from before the expect section: its keys move there when it is read."""
    from aiayn.config import read_run_config

    recipe = load_config(REPO / "configs" / "multi30k_en_de_quick.yaml")
    old = load_config(OLD_RUN / "config.yaml")
    assert "useful_updates" in (OLD_RUN / "config.yaml").read_text()  # the file itself stays as it was written
    assert old.expect == recipe.expect and old.expect.useful_updates == 400 and len(old.expect.bleu) == 14
    assert not hasattr(old.train, "useful_updates") and not hasattr(old.train, "reference_bleu")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((OLD_RUN / "config.yaml").read_text())
    assert read_run_config(run, ["expect.useful_updates=500"]).expect.useful_updates == 500  # --set: the new name
    assert read_run_config(run).to_dict() == old.to_dict() and "useful_updates" not in old.to_dict()["train"]


def test_a_moved_key_is_refused_on_the_command_line_and_twice_in_a_file(tmp_path: Path) -> None:
    from aiayn.config import migrate

    with pytest.raises(ConfigError, match="config key train.useful_updates is now expect.useful_updates"):
        load_config(REPO / "configs" / "tiny.yaml", ["train.useful_updates=400"])
    both = tmp_path / "both.yaml"
    both.write_text("train:\n  useful_updates: 400\nexpect:\n  useful_updates: 500\n")
    with pytest.raises(ConfigError, match="train.useful_updates and expect.useful_updates are one setting"):
        load_config(both)
    values = {"train": {"reference_bleu": [[100, 2.0]], "warmup": 10}}
    assert migrate(values, "x") == {"train": {"warmup": 10}, "expect": {"bleu": [[100, 2.0]]}}
    assert values == {"train": {"reference_bleu": [[100, 2.0]], "warmup": 10}}  # the caller's dict is not changed
    with pytest.raises(ConfigError, match="expect.bleu: expected \\[updates, BLEU\\] pairs with increasing"):
        config_from_dict({"expect": {"bleu": [[200, 2.0], [100, 3.0]]}})
