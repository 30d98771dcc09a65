"""One PyTorch install story (issue 62): `make` keeps a PyTorch the user already installed in .venv (the README's
`pip install torch`) and says so, where it used to replace it silently with its pinned one; it installs its pin
into a .venv without one, or when TORCH is given on the command line. Run against a stand-in .venv whose python
logs what it is asked to do (no package is installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

if shutil.which("make") is None:  # pragma: no cover - every supported machine has it
    pytest.skip("make is not installed", allow_module_level=True)


def setup_with(tmp_path: Path, torch_version: str | None, *make_args: str) -> tuple[str, str]:
    """``make setup`` in a copy of what its stamp depends on, with a stand-in .venv/bin/python: (make's output,
    the python's log of its command lines)."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "constraints").mkdir()
    shutil.copy(REPO / "constraints" / "test.txt", tmp_path / "constraints" / "test.txt")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "python.log"
    have = f'echo {torch_version}; exit 0' if torch_version else "exit 1"
    (bin_dir / "python").write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in *"import torch"*) {have};; esac
exit 0
""", encoding="utf-8")
    (bin_dir / "python").chmod(0o755)
    done = subprocess.run(["make", "-f", str(REPO / "Makefile"), "-C", str(tmp_path), "setup", *make_args],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, log.read_text(encoding="utf-8")


def pinned() -> str:
    line = next(x for x in (REPO / "Makefile").read_text().splitlines() if x.startswith("TORCH ?="))
    return line.split("=", 1)[1].strip()


def test_make_keeps_the_pytorch_already_installed_and_says_so(tmp_path):
    out, calls = setup_with(tmp_path, "2.14.1")
    assert "keeping the PyTorch already in .venv: torch 2.14.1" in out
    assert f"pip install -q {pinned()}" not in calls  # never swapped in under the user's feet
    assert "-c constraints/test.txt -e .[dev,serve,clients]" in calls


def test_make_installs_its_pin_where_there_is_none_or_when_asked(tmp_path):
    none = tmp_path / "none"
    none.mkdir()
    out, calls = setup_with(none, None)
    assert f"installing {pinned()} into .venv" in out and f"pip install -q {pinned()}" in calls
    asked = tmp_path / "asked"
    asked.mkdir()
    out, calls = setup_with(asked, "2.14.1", "TORCH=torch==2.11.0")
    assert "installing torch==2.11.0" in out and "pip install -q torch==2.11.0" in calls
