"""``aiayn report``: the numbers README and docs quote about a run, read back from its files."""

from __future__ import annotations

import json

import pytest

from aiayn.cli import main
from aiayn.train.report import format_report, run_report


def _write_run(tmp_path, resumed: bool = False):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    recs = []
    for i, tps in enumerate([1000.0, 5000.0, 4000.0, 4500.0, 100.0], start=1):  # one window slowed down
        recs.append({"step": 50 * i, "epoch": i // 3, "lr": 1e-3, "train_loss": 3.0, "train_nll": 2.0,
                     "tokens_per_s": tps, "elapsed_s": 10.0 * i})
        if i % 2 == 0:
            recs.append({"step": 50 * i, "epoch": i // 3, "valid_loss": 3.0, "valid_nll": 2.0 - 0.1 * i})
    recs.append({"step": 260, "epoch": 1, "valid_loss": 3.0, "valid_nll": 1.9})  # the final evaluation
    if resumed:  # a resume repeats step 250 after its last checkpoint: the later line wins
        recs.append({"step": 250, "epoch": 1, "lr": 1e-3, "train_loss": 3.0, "train_nll": 2.0,
                     "tokens_per_s": 4200.0, "elapsed_s": 51.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "eval" / "test.json").write_text(json.dumps({"name": "test", "scores": {"bleu": 30.5, "chrf": 55.25}}))
    (run / "eval" / "notes.json").write_text(json.dumps({"not": "an evaluation"}))
    return run


def test_report_numbers(tmp_path):
    rep = run_report(_write_run(tmp_path))
    assert rep["step"] == 260 and rep["epoch"] == 1
    assert (rep["elapsed_s"], rep["elapsed_step"]) == (50.0, 250)
    # median of [1000, 5000, 4000, 4500, 100] is 4000; numpy's linear percentiles for the quartiles
    assert rep["tokens_per_s"] == {"median": 4000.0, "p25": 1000.0, "p75": 4500.0, "windows": 5}
    assert rep["valid_nll"] == {"last": 1.9, "last_step": 260, "best": pytest.approx(1.6), "best_step": 200}
    assert rep["evals"] == {"test": {"bleu": 30.5, "chrf": 55.25}}
    text = format_report(rep)
    assert "4,000 target tokens/s median (middle half 1,000-4,500) over 5 logged windows" in text
    assert "best 1.600 (step 200)" in text and "bleu 30.50  chrf 55.25" in text


def test_report_resumed_run_keeps_the_later_line(tmp_path):
    rep = run_report(_write_run(tmp_path, resumed=True))
    assert rep["tokens_per_s"]["windows"] == 5  # step 250 counted once, with its new value
    assert rep["tokens_per_s"]["median"] == 4200.0
    assert rep["elapsed_s"] == 51.0


def test_report_cli(tmp_path, capsys):
    run = _write_run(tmp_path)
    assert main(["report", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 260
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aiayn: error:")


def test_report_takes_a_stopped_runs_last_update_and_time_from_its_newest_checkpoint(tmp_path):
    """First hour, point 4: a run that stopped at update 291 after 84 s (its last save) logged its time last at
    step 250: the report says 291 and 84 s, at its last checkpoint, not the log's step 250."""
    run = _write_run(tmp_path)
    (run / "checkpoints").mkdir()
    for step, elapsed in ((200, 40.0), (291, 84.0)):
        (run / "checkpoints" / f"step_{step:06d}.safetensors").write_bytes(b"")
        (run / "checkpoints" / f"step_{step:06d}.json").write_text(json.dumps({"step": step, "elapsed_s": elapsed}))
    rep = run_report(run)
    assert (rep["step"], rep["elapsed_s"], rep["elapsed_step"], rep["elapsed_at"]) == (291, 84.0, 291, "checkpoint")
    assert "84 s (1.4 min) of training at its last checkpoint (step 291)" in format_report(rep)


def test_evaluate_summary_says_which_weights_it_scored():
    from aiayn.eval.evaluate import scored_line, summary

    run = {"path": "runs/m30k", "weights": "model.safetensors", "weights_source": "average of the last 5 checkpoints"}
    assert scored_line(run) == "scored: model.safetensors of runs/m30k (average of the last 5 checkpoints)"
    lm = {"name": "valid", "task": "lm", "run": run, "scores": {"nll_per_token": 1.0, "ppl": 2.72},
          "data": {"n_tokens": 10}, "json_path": "x.json"}
    assert summary(lm).splitlines()[0] == scored_line(run)
