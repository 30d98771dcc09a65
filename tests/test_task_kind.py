"""The cost of a new task kind, measured (docs/architecture.md, "Cost of a change"): a task registered from this
file alone, with an evaluator and a validation score of its own registered beside it on their floors, trains,
validates, evaluates, loads, translates and is served, and every export target refuses it in its own one line.
No file of the package names it: the package calls what the task names (issue 72)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import aiayn.task as task_module
from aiayn.task import TASKS, Task, register_task

REPO = Path(__file__).resolve().parent.parent
TINY = ["task=paraphrase", "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "model.dropout=0.0", "data.vocab_size=300", "data.max_tokens=512",
        "train.max_updates=8", "train.warmup=4", "train.eval_every=8", "train.save_every=8", "train.log_every=4",
        "train.threads=1", "train.eval_bleu=true", "decode.beam=1", "decode.max_len_b=5"]
# An encoder-decoder of sentence pairs with its own evaluation and one more validation score, reusing the
# corpus, the model, the loader and the routes that exist.
PARAPHRASE = Task(name="paraphrase", label="paraphrase", encoder=True, evaluator="paraphrase",
                  valid_scores=("bleu", "copy_rate"), weights_scores=("copy_rate",))


def _copy_rate(cfg, data, tokenizers, search=None):
    """A validation score of the paraphrase task's own: the share of validation sources it was asked about
    (what matters here is that the training calls it, by the name the task gives)."""
    return lambda model, dist=None: {"valid_copy_rate": float(len(data.valid_src))}


def _evaluate_paraphrase(run_dir, cfg, data, options, device, precision, overrides):
    from aiayn.decode.open_run import open_run

    model = open_run(run_dir, device)
    return {"task": cfg.task, "outputs": model.translate(["a b c"], beam=1)}


@pytest.fixture
def paraphrase(monkeypatch):
    from aiayn.eval.evaluate import EVALUATORS
    from aiayn.train.validation import VALID_SCORES, ValidScore

    register_task(PARAPHRASE)
    monkeypatch.setitem(EVALUATORS, "paraphrase", _evaluate_paraphrase)
    monkeypatch.setitem(VALID_SCORES, "copy_rate", ValidScore(_copy_rate, "its copy rate"))
    try:
        yield PARAPHRASE
    finally:
        del task_module._TASKS["paraphrase"]


def test_a_task_is_registered_once():
    with pytest.raises(ValueError, match="task 'translation' is registered twice"):
        register_task(TASKS["translation"])
    assert "paraphrase" not in TASKS


def test_no_file_of_the_package_names_the_new_task():
    named = [p.relative_to(REPO) for p in (REPO / "aiayn").rglob("*") if p.is_file() and p.suffix in (".py", ".js",
             ".yaml", ".html") and "paraphrase" in p.read_text(encoding="utf-8")]
    assert named == []


def test_a_task_kind_registered_from_a_test_alone_trains_evaluates_loads_and_is_served(paraphrase, tmp_path,
                                                                                       caplog):
    import logging

    import aiayn
    from aiayn.config import load_config
    from aiayn.eval.evaluate import EvalData, evaluate_run
    from aiayn.serve.native import TRANSLATE, route_of
    from aiayn.train.run import train

    cfg = load_config(REPO / "configs" / "tiny_reverse.yaml", [*TINY, "train.inference_weights=average",
                                                               "train.average_last=2", "train.save_every=4"])
    assert cfg.kind is PARAPHRASE
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        train(cfg, run, progress=False)
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "valid_nll" in line]
    assert {"valid_bleu", "valid_copy_rate"} <= set(evals[-1])  # the scores the task names, in its validation
    assert "by validation NLL and its copy rate" in caplog.text  # and in its inference weights' choice

    assert evaluate_run(run, EvalData(split="valid"))["task"] == "paraphrase"  # its own evaluator

    model = aiayn.load(run, device="cpu")  # the loader it names: a translator
    assert len(model.translate(["a b c", "d e"], beam=1)) == 2
    assert route_of(PARAPHRASE) == TRANSLATE

    from starlette.testclient import TestClient

    from aiayn.serve.app import create_app
    from aiayn.serve.batcher import Batching

    with TestClient(create_app(model, batching=Batching(max_wait_ms=0.0)), base_url="http://localhost") as client:
        r = client.post(TRANSLATE, json={"text": ["a b c"]})
        assert r.status_code == 200 and len(r.json()["translations"]) == 1
        r = client.post("/v1/generate", json={"prompt": "a"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task" and "paraphrase run" in r.text


def test_every_export_target_refuses_a_task_it_does_not_declare_in_one_line(paraphrase, tmp_path):
    from aiayn.config import load_config, save_config
    from aiayn.errors import ConfigError
    from aiayn.interop.registry import TARGETS, export

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(REPO / "configs" / "tiny_reverse.yaml", TINY), run / "config.yaml")
    for name, target in TARGETS.items():
        with pytest.raises(ConfigError, match=f"^{run}: a paraphrase run; {target.title} hold .* models$"):
            export(name, run, tmp_path / name)
        assert not (tmp_path / name).exists()
