"""A normal (non-editable) install works: build the wheel, install it into a fresh virtual environment, and
run what a newcomer runs first — the README's Python example and ``aiayn train`` on a preset — from a
directory outside the repository, so nothing can come from the checkout.

The fresh environment gets aiayn from the wheel only; its dependencies (torch & co., several GB to
download) come from the test's own environment through a ``.pth`` path entry instead of a second install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # Build from a copy of the tracked files: an in-tree build would reuse (and ship) a stale build/ folder.
    src = tmp / "src"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name, follow_symlinks=False)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
          str(src)], tmp, env)
    (wheel,) = (tmp / "dist").glob("aiayn-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env)
                .stdout.strip())
    (site / "aiayn_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)], tmp, env)
    work = tmp / "work"
    work.mkdir()
    return venv, env, work


def test_the_wheel_holds_the_presets_and_the_package_comes_from_it(installed):
    venv, env, work = installed
    code = ("import aiayn, aiayn.config as c; print(aiayn.__file__); "
            "print(sorted(p.stem for p in c.CONFIG_DIR.glob('*.yaml'))); "
            "print(sorted(p.stem for p in c.CONFIG_DIR.glob('sweeps/*.yaml')))")
    out = _run([str(venv / "bin" / "python"), "-c", code], work, env).stdout.splitlines()
    # the grids of aiayn sweep --variants NAME ship too
    assert eval(out[2]) == sorted(p.stem for p in (REPO / "aiayn" / "configs" / "sweeps").glob("*.yaml"))  # noqa: S307
    # whole path components: a temporary directory named like the checkout plus a suffix (/tmp/x-tmp beside /tmp/x)
    # is not inside it
    assert Path(out[0]).is_relative_to(venv) and not Path(out[0]).is_relative_to(REPO)
    presets = eval(out[1])  # noqa: S307 - our own print of a list of names
    assert {"paper-base", "paper-big", "multi30k_en_de_quick", "tiny_reverse"} <= set(presets)
    assert presets == sorted(p.stem for p in (REPO / "aiayn" / "configs").glob("*.yaml"))
    version = _run([str(venv / "bin" / "aiayn"), "--version"], work, env).stdout.strip()
    assert re.fullmatch(r"aiayn \d+\.\d+\.\d+", version)


def test_the_readme_python_example_runs_from_the_wheel(installed):
    venv, env, work = installed
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)
    assert blocks, "the README has a Python example"
    example = blocks[0]
    if "runs/" in example:  # an example that loads a trained run gets one first
        pytest.fail("the README's first Python example must run on a fresh install (no trained run needed)")
    (work / "example.py").write_text(example, encoding="utf-8")
    _run([str(venv / "bin" / "python"), "example.py"], work, env)


def test_aiayn_train_a_preset_for_a_few_updates_then_translate(installed):
    venv, env, work = installed
    aiayn = str(venv / "bin" / "aiayn")
    _run([aiayn, "train", "tiny_reverse", "--run-dir", "runs/tiny", "--no-progress", "--set", "train.max_updates=3",
          "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "train.save_every=3",
          "--set", "train.eval_every=3", "--set", "data.vocab_size=300"], work, env)
    assert (work / "runs" / "tiny" / "model.safetensors").is_file()
    r = subprocess.run([aiayn, "translate", "runs/tiny", "--beam", "1", "--max-len-b", "3"], cwd=work, env=env,
                       input="alpha bravo\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and len(r.stdout.split("\n")) == 2, r.stderr
