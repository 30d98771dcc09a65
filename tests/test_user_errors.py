"""Bad values on the command line and in configs: each is one line on stderr (``aiayn: error: ...``) and exit 2
before any work; a bug is ``aiayn: internal error`` and exit 1 (its traceback with -v). The error boundary, every
numeric key's range, absurd and hostile values, malformed arguments, --threads, files beside a named dataset.
(Issues 26, 32 and 44.)
"""

from __future__ import annotations

import errno
from unittest import mock

import pytest
from refusals import TINY, one_line, run_cli  # tests/ is on sys.path under pytest

from aiayn.cli import main
from aiayn.config import ConfigError, load_config

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the error boundary --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("error, code, line", [
    (OSError(errno.ENOSPC, "No space left on device"), 2, "aiayn: error: No space left on device (free space, or "
     "write elsewhere: the command's output, --out or --run-dir, or $TMPDIR for its temporary files)"),
    (PermissionError(errno.EACCES, "Permission denied", "/x/run"), 2, "aiayn: error: /x/run: Permission denied"),
    (OSError(errno.EROFS, "Read-only file system", "/x/run"), 2, "aiayn: error: /x/run: Read-only file system"),
    (UnicodeDecodeError("utf-8", b"a\xff", 1, 2, "invalid start byte"), 2,
     "aiayn: error: input is not valid UTF-8 (byte 0xff at offset 1)"),
    (ZeroDivisionError("division by zero"), 1,
     "aiayn: internal error (a bug in aiayn, please report it): ZeroDivisionError: division by zero; "
     "rerun with -v for the traceback"),
])
def test_the_error_boundary_is_one_line_user_errors_exit_2_bugs_exit_1(error, code, line, capsys):
    with mock.patch("aiayn.train.run.train_from_config", side_effect=error):
        got, err = run_cli(capsys, ["train", "any.yaml"])
    assert (got, err) == (code, [line])


def test_a_bug_shows_its_traceback_with_v(capsys):
    with mock.patch("aiayn.train.run.train_from_config", side_effect=ZeroDivisionError("division by zero")):
        code = main(["-v", "train", "any.yaml"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback (most recent call last)" in err and "ZeroDivisionError" in err
    assert err.strip().splitlines()[-1].startswith("aiayn: internal error")


# --- config ranges -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("train.warmup=0", "train.warmup=0: must be >= 1 (schedule noam divides by it)"),
    ("train.max_updates=0", "train.max_updates=0: must be >= 1"),
    ("train.keep_last=-1", "train.keep_last=-1: must be >= 0 (0: keep every checkpoint)"),
    ("train.lr=-0.1", "train.lr=-0.1: must be >= 0"),
    ("train.lr=.inf", "train.lr=inf: expected a finite number"),
    ("train.adam_betas=[0.9, 1.0]", "train.adam_betas[1]=1.0: expected a number in [0, 1)"),
    ("train.adam_eps=0", "train.adam_eps=0.0: must be > 0"),
    ("train.clip_norm=0", "train.clip_norm=0.0: must be > 0"),
    ("train.max_minutes=.nan", "train.max_minutes=nan: expected a finite number"),
    ("train.patience=0", "train.patience=0: must be >= 1"),
    ("train.average_last=0", "train.average_last=0"),
    ("train.accum_steps=0", "train.accum_steps=0"),
    ("train.seed=-1", "train.seed=-1"),
    ("train.label_smoothing=1", "train.label_smoothing=1.0: expected a number in [0, 1)"),
    ("model.layer_norm_eps=0", "model.layer_norm_eps=0.0: must be > 0"),
    ("model.max_positions=0", "model.max_positions=0"),
    ("model.n_decoder_layers=0", "model.n_decoder_layers=0"),
    ("data.valid_fraction=0", "data.valid_fraction=0.0: expected a number in (0, 1)"),
    ("data.block_size=0", "data.block_size=0"),
    ("data.max_len=1", "data.max_len=1: must be >= 2"),
    ("data.tokenizer_sample=0", "data.tokenizer_sample=0"),
])
def test_every_numeric_key_has_its_range(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["data.max_len=500"], "data.max_len=500 exceeds model.max_positions=64"),
    (["data.length_buckets=[16, 1000]"], "data.length_buckets: 1000 exceeds model.max_positions=64"),
    (["data.pad_to_multiple=128"], "data.pad_to_multiple=128 pads a pair of 64 positions to 128"),
    (["model.max_positions=60", "data.pad_to_multiple=8"], "pads a pair of 60 positions to 64, more than"),
])
def test_batch_widths_past_the_models_positions_are_one_line(overrides, message, tmp_path, capsys):
    # each trained into the first batch and died there as an internal error, leaving a run directory behind
    run = tmp_path / "r"
    sets = [a for o in overrides for a in ("--set", o)]
    line = one_line(capsys, ["train", TINY, "--run-dir", str(run), *sets])
    assert message in line and not run.exists()
    load_config(TINY, ["model.max_positions=60", "data.pad_to_multiple=8", "data.max_len=56"]).check_pair_widths()
    # a run trained with such settings on a corpus that never came near the limit still loads for decoding
    assert load_config(TINY, overrides).model.max_positions


def test_zero_warmup_is_fine_where_the_schedule_does_not_divide_by_it():
    assert load_config(TINY, ["train.schedule=inverse_sqrt", "train.warmup=0"]).train.warmup == 0
    assert load_config(TINY, ["train.schedule=constant", "train.warmup=0", "train.lr=0"]).train.lr == 0.0


# --- ceilings, integers that fit, hostile YAML ---------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("train.max_updates=" + "9" * 400, "train.max_updates=999999999999... (400 digits): must be at most"),
    ("train.seed=18446744073709551616", "train.seed=18446744073709551616: must be at most"),
    ("model.max_positions=1000000000", "model.max_positions=1000000000: must be at most 1,048,576"),
    ("data.vocab_size=100000000000", "data.vocab_size=100000000000: must be at most"),
    ("model.d_model=40000", "need about"),
    ("train.max_updates=" + "9" * 5000, "holds an integer too long to be a setting"),
])
def test_absurd_values_are_one_line_at_once(override, message, tmp_path, capsys):
    run = tmp_path / "r"
    line = one_line(capsys, ["train", TINY, "--run-dir", str(run), "--set", override])
    assert message in line and not run.exists()


@pytest.mark.parametrize("text, message", [
    ("model: " + "[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ("model: " + "{a: " * 20_000 + "1" + "}" * 20_000, "nested too deeply"),
    ("train:\n  max_updates: " + "9" * 5000, "integer too long"),
    ("base: [1, 2]\n", "base: expected the name or path"),
    ("base: 5\n", "base: expected the name or path"),
], ids=["50k nested lists", "20k nested mappings", "5000-digit integer", "base list", "base number"])
def test_hostile_yaml_is_one_line(text, message, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert message in one_line(capsys, ["train", str(cfg), "--run-dir", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()


# --- the command line's form and --threads -------------------------------------------------------------------------


@pytest.mark.parametrize("argv, word", [
    (["translate", "RUN", "--threads", "abc"], "argument --threads: invalid int value: 'abc'"),
    (["prepare", TINY, "--out", "X", "--workers", "abc"], "argument --workers: invalid int value: 'abc'"),
    (["table3", TINY, "--out", "X", "--seeds", "abc"], "argument --seeds: invalid int value: 'abc'"),
    (["translate"], "the following arguments are required: run"),
])
def test_malformed_arguments_are_one_line(argv, word, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line(capsys, argv)
    assert word in line and f"aiayn {argv[0]} --help" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["translate", "RUN"], ["generate", "RUN"], ["evaluate", "RUN"], ["serve", "RUN"],
    ["prepare", TINY, "--out", "OUT"], ["table3", TINY, "--out", "OUT"], ["train", TINY, "--run-dir", "OUT"],
])
def test_threads_are_bounded_the_same_way_in_every_command(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad in ("10000", "0"):
        assert "--threads " + bad + ": expected 1 to 4,096 CPU threads" in one_line(capsys, [*argv, "--threads", bad])
    assert list(tmp_path.iterdir()) == []  # refused before any work: nothing written


def test_omp_num_threads_is_bounded_and_named(monkeypatch):
    from aiayn.engine import cpu_threads
    from aiayn.errors import ConfigError

    monkeypatch.setenv("OMP_NUM_THREADS", "10000")
    with pytest.raises(ConfigError, match=r"\$OMP_NUM_THREADS 10000: expected 1 to 4,096"):
        cpu_threads()


# --- files beside a named dataset ----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["prepare", TINY, "--out", "OUT"], ["train", TINY, "--run-dir", "OUT"]])
def test_files_beside_a_named_dataset_are_refused_not_ignored(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("a b c\n")
    line = one_line(capsys, [*argv, "--set", "data.train_src=mine.txt"])
    assert "data.dataset=reverse and data.train_src are both set" in line and "data.dataset=null" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]  # refused before any work
