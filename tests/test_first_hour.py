"""The first hour of a newcomer: what training says while it runs and when it ends, resuming a run with its own
config, the thread count, evaluation progress, and the warning an undertrained run gives."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.config import load_config
from aiayn.train.console import Console, expected_bleu, final_step

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny_reverse.yaml")
SMALL = ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "train.warmup=10", "data.max_tokens=256",
         "train.log_every=2", "train.eval_every=4", "train.save_every=4", "decode.max_len_b=5"]


def sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def test_expected_bleu_interpolates_the_recipes_measured_points():
    points = [(100, 2.0), (300, 10.0), (600, 25.0)]
    assert expected_bleu(points, 50) is None  # before the first point: unknown
    assert expected_bleu(points, 200) == pytest.approx(6.0)
    assert expected_bleu(points, 600) == 25.0 and expected_bleu(points, 5000) == 25.0
    assert expected_bleu([], 100) is None


def test_the_run_ends_at_the_limit_that_comes_first():
    tc = load_config(TINY, ["train.max_updates=3000", "train.max_minutes=30"]).train
    assert final_step(tc, step=100, elapsed_s=60.0, rate=1.0) == 100 + int(1.0 * (1800 - 60))  # the clock
    assert final_step(tc, step=100, elapsed_s=60.0, rate=20.0) == 3000  # max_updates
    assert final_step(load_config(TINY).train, 10, 5.0, 0.01) == 900  # no time cap: max_updates


@pytest.mark.parametrize("threads", [1, 2])
def test_projection_says_what_the_run_reaches_and_warns_when_that_is_not_enough(caplog, threads):
    """The warning's advice fits the run: fewer threads only for a run on several."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _projection_warns(caplog, threads)
    finally:
        torch.set_num_threads(before)


def _projection_warns(caplog, threads: int) -> None:
    cfg = load_config(TINY, ["train.max_updates=3000", "train.max_minutes=30", "expect.useful_updates=1000",
                             "expect.bleu=[[300, 10.0], [1200, 30.0]]"])
    progress = Console(cfg.train, cfg.expect, step=0, elapsed_s=0.0, show=True, bar=False)
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        out = progress.project(step=20, elapsed_s=40.0)  # 0.5 updates/s: 900 updates in 30 minutes
    assert out["final_step"] == 20 + int(0.5 * 1760) and out["expected_bleu"] == pytest.approx(
        10.0 + 20.0 * (out["final_step"] - 300) / 900)
    messages = [r.getMessage() for r in caplog.records]
    assert any("0.50 updates/s: this run will stop after about 900 updates (train.max_minutes=30)" in m
               and "validation BLEU after 900 updates was about 23" in m for m in messages), messages
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fewer than the 1,000 this recipe needs" in warnings[0]
    assert ("--threads 1" in warnings[0]) == (threads > 1) and "train.max_minutes" in warnings[0]


def test_no_progress_still_logs_the_loss_in_plain_lines(tmp_path, caplog):
    from aiayn.train.run import train

    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        train(load_config(TINY, SMALL + ["train.max_updates=4"]), tmp_path / "run", progress=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 2 and lines[0].startswith("step 2/4 loss ") and "tokens/s" in lines[0]
    assert all("\r" not in r.getMessage() for r in caplog.records)


def test_resume_run_uses_its_own_config_and_allows_only_safe_changes(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", TINY, "--run-dir", str(run), "--no-progress", *sets(SMALL + ["train.max_updates=4"])]) == 0
    assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.max_updates=8"]) == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert max(steps) == 8 and load_config(run / "config.yaml").model.d_model == 32  # the run's own model
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--set", "model.d_model=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--set model.d_model: a resumed run keeps its model, data and optimizer" in err[0]
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["train"]) == 2 and "needs a CONFIG" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_resume_may_change_the_loader_workers_and_stays_exact(tmp_path):
    # the resume a killed DataLoader worker's line names refused --set data.loader_workers=0, the way out of an OOM
    from aiayn.run.weights import read_weights

    # one thread named: by default a run takes the cores free when it starts, which differ between the two runs on a
    # busy machine (the other test process), and another thread count sums in another order
    straight, split = tmp_path / "straight", tmp_path / "split"
    for run, updates in ((straight, 6), (split, 3)):
        assert main(["train", TINY, "--run-dir", str(run), "--no-progress",
                     *sets(SMALL + [f"train.max_updates={updates}", "train.threads=1"])]) == 0
    assert main(["train", "--resume", str(split), "--no-progress", "--set", "train.max_updates=6",
                 "--set", "data.loader_workers=0"]) == 0
    a, b = read_weights(straight / "model.safetensors"), read_weights(split / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_threads_default_to_the_free_cores_and_the_option_sets_them(monkeypatch, tmp_path):
    from aiayn import engine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(engine, "usable_cores", lambda: 2)
    monkeypatch.setattr(engine, "busy_cores", lambda: 0.1)
    assert engine.cpu_threads() == 2  # a quiet machine: every core
    monkeypatch.setattr(engine, "busy_cores", lambda: 1.2)
    assert engine.cpu_threads() == 1  # one core busy with other work
    monkeypatch.setattr(engine, "busy_cores", lambda: 7.0)
    assert engine.cpu_threads() == 1 and engine.cpu_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert engine.cpu_threads() == 3
    before = torch.get_num_threads()
    from aiayn.train.run import train

    state = train(load_config(TINY, SMALL + ["train.max_updates=2", "train.threads=1"]), tmp_path / "r",
                  progress=False)
    assert state.step == 2 and torch.get_num_threads() == before  # train() restores the caller's setting


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="busy_cores samples /proc/stat (Linux)")
def test_busy_cores_sees_another_process_spinning():
    import subprocess
    import sys
    import time

    from aiayn import engine

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        # the spinning process holds a core (more on a busy machine: a lower bound only)
        assert engine.busy_cores(0.5) > 0.5
    finally:
        spin.kill()
        spin.wait()


def test_an_undertrained_run_says_so_at_the_end_and_when_used(tmp_path, caplog, capsys):
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        assert main(["train", TINY, "--run-dir", str(run), "--no-progress",
                     *sets(SMALL + ["train.max_updates=4", "expect.useful_updates=600"])]) == 0
    assert any("stopped after 4 updates, fewer than the 600" in r.getMessage() for r in caplog.records)
    caplog.clear()
    src = tmp_path / "in.txt"
    src.write_text("alpha bravo\n")
    with caplog.at_level(logging.WARNING):
        assert main(["translate", str(run), "--input", str(src), "--device", "cpu"]) == 0
    warned = [r.getMessage() for r in caplog.records if "trained for 4 updates" in r.getMessage()]
    assert len(warned) == 1 and "aiayn train --resume" in warned[0]
    from aiayn.interop.card import run_facts

    facts = "\n".join(run_facts(run, load_config(run / "config.yaml")))
    assert "**Undertrained**: its recipe needs 600 updates" in facts  # the model card says so too


def _as_before_expect(run: Path) -> None:
    """Rewrite RUN's config.yaml and marker as runs wrote them when expect's keys sat under train."""
    import yaml

    from aiayn.files import MARKER

    def old(values: dict) -> dict:
        if "expect" in values:  # the marker is written once, at the start: a resume leaves it as it was
            expect = values.pop("expect")
            values["train"].update(reference_bleu=expect["bleu"], useful_updates=expect["useful_updates"])
        return values

    values = old(yaml.safe_load((run / "config.yaml").read_text()))
    (run / "config.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    marker = json.loads((run / MARKER).read_text())
    (run / MARKER).write_text(json.dumps({**marker, "config": old(marker["config"])}))


def test_an_old_run_directory_resumes_and_restarts_with_its_expect_keys_under_train(tmp_path, caplog):
    """A run written before the expect section resumes (and, killed before its first checkpoint, restarts) with
    its own config, whose useful_updates still give the warning."""
    run = tmp_path / "run"
    limits = ["train.max_updates=4", "expect.useful_updates=600", "expect.bleu=[[2, 1.0]]"]
    assert main(["train", TINY, "--run-dir", str(run), "--no-progress", *sets(SMALL + limits)]) == 0
    _as_before_expect(run)
    assert "  useful_updates: 600\ndecode:" in (run / "config.yaml").read_text()  # under train:
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.max_updates=6"]) == 0
    assert any("stopped after 6 updates, fewer than the 600" in r.getMessage() for r in caplog.records)
    assert load_config(run / "config.yaml").expect.bleu == [(2, 1.0)]
    shutil.rmtree(run / "checkpoints")  # as if killed before its first checkpoint: --resume restarts it
    (run / "model.safetensors").unlink()
    _as_before_expect(run)
    assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.max_updates=4"]) == 0  # the marker's
    assert (run / "model.safetensors").exists()


def test_evaluate_reports_progress_in_plain_lines_off_a_terminal(tiny_run, tmp_path, caplog, monkeypatch):
    from aiayn import progress

    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)  # a line after every batch
    with caplog.at_level(logging.INFO, logger="aiayn"):
        assert main(["evaluate", str(run), "--split", "test", "--beam", "1", "--max-tokens", "64"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluate test: ")]
    assert len(lines) >= 2 and "sentences" in lines[-1] and "/s" in lines[-1]


def test_a_resumed_run_keeps_the_thread_count_it_was_trained_with(tmp_path, monkeypatch):
    from aiayn import engine
    from aiayn.train.run import _run_threads, train

    run = tmp_path / "run"
    train(load_config(TINY, SMALL + ["train.max_updates=4", "train.threads=1"]), run, progress=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(engine, "usable_cores", lambda: 2)
    monkeypatch.setattr(engine, "busy_cores", lambda *a: 0.0)  # a quiet 2-core machine: a new run takes 2
    free = load_config(TINY, SMALL + ["train.max_updates=6"])
    assert _run_threads(free, run, resume=True) == 1  # float sums depend on it: the resume stays bit-identical
    assert _run_threads(free, run, resume=False) == 2
    assert _run_threads(load_config(TINY, SMALL + ["train.threads=2"]), run, resume=True) == 2  # asked for


def test_epoch_lines_count_updates_as_the_run_does(caplog):
    """Issue 62: the second epoch's line said "updates 1-126"; it now counts on from the first epoch's, with the
    epoch's own positions beside (a resume inside an epoch starts there)."""
    from aiayn.train.trainer import EpochTimer

    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        EpochTimer(epoch=1, position=0, step=126).log(126)
        EpochTimer(epoch=2, position=50, step=302).log(126)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("epoch 1: updates 127-252 (the epoch's 1-126) in ")
    assert lines[1].startswith("epoch 2: updates 303-378 (the epoch's 51-126) in ")


def test_a_moving_forecast_says_it_is_one_and_what_it_was(caplog):
    """Issue 62: the plain lines' total moved from 230 to 442 without a word: a total the clock sets is a forecast
    at the speed so far, marked ~, and says the last one when it moved by a tenth or more."""
    cfg = load_config(TINY, ["train.max_updates=3000", "train.max_minutes=10"])
    console = Console(cfg.train, cfg.expect, step=0, elapsed_s=0.0, show=True, bar=False)
    rec = {"train_loss": 5.0, "lr": 1e-3, "tokens_per_s": 100.0}
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        console.record({**rec, "step": 50, "elapsed_s": 130.0})  # 0.38 updates/s: ~230 in 600 s
        console.record({**rec, "step": 100, "elapsed_s": 150.0})  # faster now: ~400
        console.record({**rec, "step": 105, "elapsed_s": 157.0})  # about the same: no "was"
    first, second, third = (r.getMessage() for r in caplog.records)
    assert first.startswith("step 50/~230 (the forecast of train.max_minutes=10 at 0.38 updates/s so far) "), first
    assert second.startswith("step 100/~400 (the forecast of train.max_minutes=10 at 0.67 updates/s so far; was "
                             "~230) "), second
    assert "was ~" not in third
    fixed = Console(load_config(TINY, ["train.max_updates=300"]).train, cfg.expect, 0, 0.0, show=True, bar=False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        fixed.record({**rec, "step": 50, "elapsed_s": 10.0})
    assert caplog.records[0].getMessage().startswith("step 50/300 loss")


def test_a_typo_in_a_key_flag_or_command_gets_a_did_you_mean(tmp_path, capsys):
    """First hour, point 6: a config key, a decoding option, a command or a flag mistyped names the one meant."""
    from aiayn.config import ConfigError, DecodeOptions

    assert main(["train", TINY, "--run-dir", str(tmp_path / "r"), "--set", "train.max_updatez=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key train.max_updatez (did you mean max_updates?)" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match=r"unknown decoding option beem \(did you mean beam\?\)"):
        DecodeOptions().replace(beem=3)
    for argv, hint in ((["trian"], "(did you mean train?)"), (["translate", "x", "--beem", "3"],
                                                              "(did you mean --beam?)"),
                       (["serve", "x", "--char-limt", "3"], "(did you mean --char-limit?)"),
                       (["viz", "atention"], "(did you mean attention?)")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and hint in err and err.count("\n") == 1, (argv, err)
    with pytest.raises(SystemExit):
        main(["translate", "x", "--zzzz", "3"])
    assert "did you mean" not in capsys.readouterr().err  # nothing close: no guess


def test_a_run_stopped_before_its_first_checkpoint_is_called_a_run(tmp_path, capsys):
    """First hour, point 6: a run directory with no weights yet is not asked whether it is a run directory; viz's
    --help says that attention needs --src."""
    from aiayn.errors import CheckpointError
    from aiayn.run.weights import inference_weights_path

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("task: translation\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match="no weights yet: its training stopped before the first checkpoint") as e:
        inference_weights_path(run)
    assert "is it a run directory" not in str(e.value) and f"aiayn train --resume {run}" in str(e.value)
    with pytest.raises(CheckpointError, match="is it a run directory"):
        inference_weights_path(tmp_path)
    with pytest.raises(SystemExit):
        main(["viz", "--help"])
    assert "attention RUN --src TEXT" in capsys.readouterr().out


def test_ctrl_c_under_make_demo_says_how_to_resume(tmp_path, monkeypatch, capsys):
    """First hour, point 5: an interrupted ``aiayn demo`` (what ``make demo`` runs) says where its checkpoints are
    and how to go on, as an interrupted ``aiayn train`` does."""
    import aiayn.demo

    run = tmp_path / "demo"

    def interrupted(args):
        run.mkdir()
        (run / "config.yaml").write_text("task: translation\n", encoding="utf-8")
        raise KeyboardInterrupt

    monkeypatch.setattr(aiayn.demo, "run_demo", interrupted)
    assert main(["demo", "--run-dir", str(run)]) == 130
    err = capsys.readouterr().err
    assert err.startswith("aiayn: interrupted; ") and f"aiayn train --resume {run}" in err
    assert "make demo (aiayn demo) again" in err and err.count("\n") == 1


def test_the_readme_quick_start_says_how_to_use_local_data():
    """First hour, point 1: local files instead of downloads are in the README's quick start, under the variable
    the datasets module reads, for every command (evaluate needs the test split even when train did not)."""
    from aiayn.data.datasets import DATA_DIR_ENV

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert f"export {DATA_DIR_ENV}=" in quick and "`evaluate`" in quick and "/multi30k/" in quick


def test_the_weight_choice_says_what_it_does_and_a_stopped_one_is_finished_by_resume(tmp_path, caplog, capsys):
    """First hour, point 2: after "stopped at step N" the choice of the inference weights says what it is doing
    and how to finish it if stopped; a run stopped in that window (no model.safetensors after its newest checkpoint)
    is finished by ``aiayn train --resume RUN`` without training more, even with its time budget spent; once
    chosen, a resume with the budget spent is refused as before."""
    from aiayn.run.weights import list_checkpoints

    run = tmp_path / "run"
    over = SMALL + ["train.max_updates=8", "train.inference_weights=average", "train.average_last=2",
                    "train.max_minutes=0.0001"]  # 6 ms: the clock stops it after its first update
    with caplog.at_level(logging.INFO):
        assert main(["train", TINY, "--run-dir", str(run), "--no-progress", *sets(over)]) == 0
    steps = list_checkpoints(run)
    assert (run / "model.safetensors").is_file() and steps and steps[-1] < 8
    (run / "model.safetensors").unlink()  # as a Ctrl-C during the choice leaves it
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0, capsys.readouterr().err
    said = [r.getMessage() for r in caplog.records]
    assert any("its inference weights were not chosen yet: choosing them now, without training more" in m
               for m in said), said
    assert (run / "model.safetensors").is_file() and list_checkpoints(run) == steps  # no update more
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2  # chosen: the budget is spent, as before
    assert "give it more to go on" in capsys.readouterr().err


def test_the_average_or_last_choice_logs_its_two_validations(tmp_path, caplog):
    run = tmp_path / "run"
    over = SMALL + ["train.max_updates=8", "train.inference_weights=average", "train.average_last=2"]
    with caplog.at_level(logging.INFO):
        assert main(["train", TINY, "--run-dir", str(run), "--no-progress", *sets(over)]) == 0
    said = [r.getMessage() for r in caplog.records]
    first = [m for m in said if m.startswith("choosing the inference weights: the last ones (step 8)")]
    assert len(first) == 1 and f"aiayn train --resume {run} finishes this choice" in first[0], said
    assert any(m.startswith("choosing the inference weights (2 of 2") for m in said)
