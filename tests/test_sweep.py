"""``aiayn sweep`` on the CPU: two tiny seeds trained side by side, scored on validation under two decodings, the
choice made on validation and only it scored on the test split; mean and deviation, the figure, atomic results,
a rerun that trains nothing, and a run killed at any point that goes on where it stopped. Nothing here asserts what
the tiny models learn (their scores are whatever 8 updates give)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_recipe import TINY_RUN_OVERRIDES

from aiayn.cli import main
from aiayn.config import ConfigError
from aiayn.files import is_temporary

# The tests' tiny run (tests/tiny_recipe.py), cut to 8 updates and greedy decoding: seconds per run.
SMOKE = [*TINY_RUN_OVERRIDES, "train.max_updates=8", "train.warmup=4", "train.eval_every=4", "train.save_every=4",
         "train.log_every=4", "decode.beam=1", "decode.max_len_a=0"]


def sweep_args(out: Path, work: Path, *extra: str, seeds: tuple[str, ...] = ("1", "2"),
               decodes: tuple[str, ...] = ("--decode", "run", "--decode", "avg2", "average_last=2")) -> list[str]:
    sets = [a for s in SMOKE for a in ("--set", s)]
    return ["sweep", "tiny_reverse", "--out", str(out), "--work", str(work), "--seeds", *seeds, *sets, *decodes,
            "--no-progress", *extra]


def files_under(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()}


def test_two_seeds_in_parallel_give_mean_deviation_figure_and_a_rerun_trains_nothing(tmp_path: Path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(sweep_args(out, work, "--parallel", "2")) == 0
    assert "2 runs, chosen on validation: recipe / " in capsys.readouterr().out

    chosen = json.loads((out / "choice.json").read_text())
    assert chosen["select"] == "bleu_lc_tok" and {c[1] for c in chosen["candidates"]} == {"run", "avg2"}
    for seed in (1, 2):
        rec = json.loads((out / "results" / f"recipe-seed{seed}.json").read_text())
        assert (rec["variant"], rec["seed"], rec["updates"], rec["stopped_by"]) == ("recipe", seed, 8, "max_updates")
        assert set(rec["valid"]) == {"run", "avg2"} and rec["valid"]["run"]["n"] == 300
        assert "average of steps [4, 8]" in rec["valid"]["avg2"]["weights"]
        assert list(rec["test"]) == ["test"] and rec["test_decoding"] == chosen["decoding"]  # the chosen only
        assert (out / "runs" / f"recipe-seed{seed}" / "metrics.jsonl").is_file()
    table = json.loads((out / "table.json").read_text())
    row = next(r for r in table["rows"] if r.get("chosen"))
    lc = row["test"]["test"]["bleu_lc_tok"]
    assert lc["n"] == 2 and lc["std"] is not None and lc["mean"] == pytest.approx(sum(lc["values"]) / 2)
    assert all(not r["test"] for r in table["rows"] if not r.get("chosen"))  # test read for the chosen alone
    md = (out / "table.md").read_text()
    assert " ± " in md and "## Test: recipe, decoding " in md and "| recipe-seed2 | 8 | max_updates |" in md
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in out.rglob("*") if is_temporary(p.name)]

    # The same command again: nothing trained or scored again, the results as they were.
    before, ckpts = files_under(out / "results"), files_under(work / "runs")
    assert main(sweep_args(out, work, "--parallel", "2")) == 0
    assert files_under(out / "results") == before and files_under(work / "runs") == ckpts

    # Another sweep on the same OUT: one line, before any work, nothing changed.
    capsys.readouterr()
    assert main(sweep_args(out, work, "--set", "train.max_updates=9")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds another sweep" in err[0] and "train.max_updates" in err[0], err
    assert files_under(out / "results") == before


def test_a_run_killed_at_any_point_goes_on_and_nothing_half_written_is_left(tmp_path: Path, monkeypatch):
    import aiayn.sweep as sweep
    from aiayn.run.weights import list_checkpoints

    out, work = tmp_path / "out", tmp_path / "work"
    # One seed, the run's own decoding, validation only, no BLEU while training: the resume is what is tested.
    args = sweep_args(out, work, "--parallel", "1", "--no-test", "--set", "train.eval_bleu=false", seeds=("1",),
                      decodes=())
    real_score = sweep.score

    def killed(*a, **k):
        raise KeyboardInterrupt  # as a kill while the run is being scored: after training, before its result

    monkeypatch.setattr(sweep, "score", killed)
    assert main(args) == 130
    run = work / "runs" / "recipe-seed1"
    assert list_checkpoints(run) == [4, 8] and not (out / "results").exists()
    assert not [p for p in out.rglob("*") if is_temporary(p.name)]

    # Killed at the very end of training (checkpoints written, inference weights not yet): the rerun only writes
    # them (no update more), then scores the run.
    (run / "model.safetensors").unlink()
    ckpts = files_under(run / "checkpoints")
    monkeypatch.setattr(sweep, "score", real_score)
    assert main(args) == 0
    assert files_under(run / "checkpoints") == ckpts and (run / "model.safetensors").is_file()
    assert json.loads((out / "results" / "recipe-seed1.json").read_text())["updates"] == 8


def test_refusals_come_before_any_work(tmp_path: Path, capsys):
    out, work = tmp_path / "never", tmp_path / "work"
    grid = tmp_path / "grid.yaml"
    grid.write_text("variants:\n  a: {model.dropout: 0.2}\nextra: 1\n", encoding="utf-8")
    cases = [
        (["--seeds", "-1"], "--seeds"),
        (["--variant", "a b", "model.dropout=0.2"], "variant 'a b'"),
        (["--variant", "a", "model.dropout"], "expected KEY=VALUE"),
        (["--variant", "a", "model.positional=nope"], "positional"),
        (["--decode", "x", "beam=0"], "beam"),
        (["--decode", "x", "average_last=0"], "average_last"),
        (["--splits", "nope"], "nope"),
        (["--parallel", "0"], "--parallel"),
        (["--variants", str(grid)], "unknown key 'extra'"),
    ]
    for extra, message in cases:
        assert main(sweep_args(out, work, *extra)) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (extra, err)
    assert not out.exists() and not work.exists()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("x", encoding="utf-8")
    assert main(sweep_args(tmp_path / "notes", work)) == 2
    assert "not a sweep's output" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="scores translations"):
        from aiayn.sweep import Sweep, run_sweep

        run_sweep(Sweep(config="lm_tinyshakespeare_char_quick", out=out))


def test_a_run_killed_before_its_first_checkpoint_starts_again(tmp_path: Path):
    """The runner's third case (aiayn.runner.train_job): a run directory with its marker, config and tokenizer but
    no checkpoint yet is started again (not refused as a run to resume, not written over as a foreign folder)."""
    import shutil

    from aiayn.config import load_config
    from aiayn.runner import Job, train_job

    cfg = load_config("tiny_reverse", [*TINY_RUN_OVERRIDES, "train.max_updates=4", "train.save_every=4",
                                       "train.eval_every=4"])
    job = Job("x", cfg, tmp_path / "run", tmp_path / "done.json")
    assert train_job(job).step == 4
    shutil.rmtree(job.run_dir / "checkpoints")
    (job.run_dir / "model.safetensors").unlink()
    assert train_job(job).step == 4 and (job.run_dir / "model.safetensors").is_file()


def test_the_shipped_multi30k_grid_is_a_valid_search_in_both_directions():
    """configs/sweeps/multi30k_search.yaml: every variant a valid config of either recipe, every decoding valid
    options, the literature's row as docs/multi30k_experiments.md reads the 41.02 run's command."""
    from aiayn.sweep import Sweep, decoding_from, job_config, read_grid

    common, variants, decodings = read_grid("multi30k_search")
    names = [v.name for v in variants]
    assert {"recipe", "literature", "lc_b8k", "lc_moses_b8k"} <= set(names) and len(set(names)) == len(names)
    for config in ("multi30k_en_de", "multi30k_de_en"):
        sweep = Sweep(config=config, out=Path("unused"), common=tuple(common))
        for v in variants:
            cfg = job_config(sweep, v, 1)
            for d in decodings:
                cfg.decode.replace(**dict(d.options))
    lit = job_config(Sweep(config="multi30k_en_de", out=Path("unused")), variants[names.index("literature")], 1)
    assert (lit.data.lowercase, lit.data.pretokenize, lit.data.update_tokens, lit.train.accum_steps) == (
        True, "moses", 8192, 2)
    assert (lit.train.schedule, lit.train.lr, lit.train.warmup, lit.train.label_smoothing, lit.model.dropout,
            lit.train.max_updates) == ("inverse_sqrt", 0.005, 2000, 0.0, 0.3, 8000)
    assert lit.train.eval_bleu  # the sweep's default: the figure's lines
    avg = {d.name: d.average_last for d in decodings}
    assert avg["avg10_b5_len"] == 10 and dict(decoding_from("x", {"beam": "5"}).options) == {"beam": 5}
