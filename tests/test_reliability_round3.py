"""Reliability, round three (issue 44): sampling values that crashed, streams that outlived their clients, Table 3
runners that trusted their files, the edges of serve's security, Argos' sentence model and staging, the form of
the command line's errors and the messages that pointed at the wrong thing. Each case is refused in one line
(exit 2, a 4xx in the protocol's shape) with the file system checked before and after, or served as it should be.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from aiayn.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny_reverse.yaml")


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def one_line(capsys, argv: list[str]) -> str:
    """Run the CLI; assert it refused in one line with exit 2; return that line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("aiayn: error: "), (code, err)
    return err[0]


# --- the command line's form and --threads ---------------------------------------------------------------------


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
