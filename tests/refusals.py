"""What the tests of refusals share: the commands run in-process, their one line on stderr, and a fingerprint of
the files a refusal must leave as they were."""

from __future__ import annotations

import hashlib
from pathlib import Path

from aiayn.cli import main

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny_reverse.yaml")


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root``: the md5 of a file, "dir" for a directory."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def run_cli(capsys, argv: list[str]) -> tuple[int, list[str]]:
    """Run the CLI in-process: its exit status and the lines it wrote on stderr."""
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


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
