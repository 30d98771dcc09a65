"""The export registry (aiayn/interop/registry.py): every ``aiayn export`` target is registered once with what it
supports, the command line reads the registry, and what a target does not declare is refused by the registry in one
line before its exporter runs (issue 72, point 2). No exporter runs here: the refusals come first, and the fake
exporter is the test's own."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from aiayn import cli
from aiayn.config import Config, ModelConfig, save_config
from aiayn.interop import registry
from aiayn.interop.registry import TARGETS, ExportTarget


def a_run(where: Path, task: str = "translation", **model) -> Path:
    """A run directory as far as the registry reads one: its config.yaml (no weights: nothing gets that far)."""
    where.mkdir()
    save_config(Config(task=task, model=ModelConfig(**model)), where / "config.yaml")
    return where


def refused(capsys, argv: list[str]) -> str:
    """``aiayn export ...`` exits 2 with one line on stderr; that line."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("aiayn: error: "), err
    return err


def out_of(tmp_path: Path, name: str) -> Path:
    return tmp_path / ("out.argosmodel" if name == "argos" else f"out_{name}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithNormKind(ModelConfig):
    """A model option added after the exporters were written: no target declares it."""

    norm_kind: str = "layer"


def test_a_new_model_option_is_refused_by_every_target_with_no_exporter_edited(tmp_path, capsys, monkeypatch):
    run = a_run(tmp_path / "run")
    real = registry._config.read_run_config

    def with_option(value: str):
        def read(run_dir, overrides=None):
            cfg = real(run_dir, overrides)
            model = WithNormKind(**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(ModelConfig)},
                                 norm_kind=value)
            return dataclasses.replace(cfg, model=model)
        return read

    monkeypatch.setattr(registry._config, "read_run_config", with_option("rms"))
    assert set(TARGETS) >= {"ctranslate2", "hf", "argos"}
    for name in TARGETS:
        out = out_of(tmp_path, name)
        err = refused(capsys, ["export", name, str(run), str(out)])
        assert "model.norm_kind='rms'" in err and f"aiayn export {name} does not declare" in err, err
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # at its default the option changes nothing: every target takes the run as before
    monkeypatch.setattr(registry._config, "read_run_config", with_option("layer"))
    for target in TARGETS.values():
        registry.check_run(target, run)


def fake_exporter(run_dir, out, *, force: bool = False, quantization: str | None = None) -> Path:
    Path(out).write_text(f"{Path(run_dir).name} {quantization} {force}\n", encoding="utf-8")
    return Path(out)


def test_a_registered_exporter_is_offered_by_the_cli(tmp_path, capsys, monkeypatch):
    """A new export target is one registration: the command line offers it, with no other file changed."""
    monkeypatch.setitem(TARGETS, "fake", ExportTarget(
        name="fake", run=fake_exporter, title="fake files", help="a fake file for the test",
        options=frozenset({"quantization"})))
    with pytest.raises(SystemExit) as done:
        cli.main(["export", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "fake" in shown and "a fake file for the test" in shown
    run, out = a_run(tmp_path / "run"), tmp_path / "fake.txt"
    assert cli.main(["export", "fake", str(run), str(out), "--quantization", "int8", "--force"]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert out.read_text(encoding="utf-8") == "run int8 True\n"
    # what it does not declare is refused for it too, before it runs
    err = refused(capsys, ["export", "fake", str(run), str(tmp_path / "x"), "--sentence-model", "m.onnx"])
    assert "--sentence-model is for Argos packages (aiayn export argos)" in err
    lm = a_run(tmp_path / "lm", task="lm")
    assert "a lm run; fake files hold translation models" in refused(capsys, ["export", "fake", str(lm), str(out)])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("task, takers", [("translation", ["argos", "ctranslate2", "hf"]),
                                          ("summarization", ["ctranslate2", "hf"]), ("lm", [])])
def test_each_target_takes_the_tasks_it_declares(task, takers, tmp_path, capsys):
    run = a_run(tmp_path / "run", task=task)
    assert sorted(n for n, t in TARGETS.items() if task in t.tasks) == takers
    for name in set(TARGETS) - set(takers):
        assert f"a {task} run;" in refused(capsys, ["export", name, str(run), str(out_of(tmp_path, name))])
        assert not out_of(tmp_path, name).exists()


@pytest.mark.parametrize("model, refusals", [
    ({"norm_first": True}, {"hf": "Marian is post-LN: set model.norm_first=false"}),
    ({"positional": "learned"}, {"hf": "model.positional='learned' cannot be converted"}),
    ({"layer_norm_eps": 1e-6}, {"hf": "set model.layer_norm_eps=1e-05 (got 1e-06)"}),
    ({"d_model": 32, "n_heads": 4, "d_k": 4}, {
        "hf": "Marian's heads are d_model / heads wide: model.d_k=4, model.d_v=8 with d_model=32 and 4 heads",
        "ctranslate2": "CTranslate2's Transformer heads are d_model / heads wide: model.d_k=4",
        "argos": "CTranslate2's Transformer heads are d_model / heads wide: model.d_k=4"}),
])
def test_model_options_a_target_cannot_hold_are_refused_by_the_registry(model, refusals, tmp_path, capsys):
    run = a_run(tmp_path / "run", **model)
    for name, target in TARGETS.items():
        why = registry.refusal(target, ModelConfig(**model))
        assert (why is None) == (name not in refusals), (name, why)
        if name in refusals:
            out = out_of(tmp_path, name)
            err = refused(capsys, ["export", name, str(run), str(out)])
            assert f"cannot export {run} to {name}: " in err and refusals[name] in err, err
            assert not out.exists()


def test_an_option_is_refused_for_a_target_that_does_not_read_it(tmp_path, capsys):
    run = a_run(tmp_path / "run")
    err = refused(capsys, ["export", "hf", str(run), str(tmp_path / "h"), "--quantization", "int8"])
    assert "--quantization is for CTranslate2 models and Argos packages (aiayn export ctranslate2/argos)" in err
    assert not (tmp_path / "h").exists()


def test_every_model_option_is_declared_by_some_target_and_each_target_once():
    """Today's options all export somewhere (a field none declares would be refused by all: a new one is)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert fields == {k for t in TARGETS.values() for k in t.model}
    assert all(name == t.name for name, t in TARGETS.items())
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(TARGETS["hf"])
    table = registry.features_table()
    assert all(f"| `{name}` |" in table for name in TARGETS)


def test_each_exporters_python_function_refuses_as_the_cli_does(tmp_path):
    from aiayn.config import ConfigError
    from aiayn.interop.argos import export_argos
    from aiayn.interop.ctranslate2 import export_run
    from aiayn.interop.hf import export_hf

    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    lm = a_run(tmp_path / "lm", task="lm")
    for export, out in ((export_run, "ct2"), (export_hf, "hf"), (export_argos, "x.argosmodel")):
        with pytest.raises(ConfigError, match="a lm run"):
            export(lm, tmp_path / out)
        assert not (tmp_path / out).exists()
