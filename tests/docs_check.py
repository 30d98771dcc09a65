"""Every shell block of README.md and docs/*.md runs as written: ``make docs-check`` (all of them, a few minutes)
and tests/test_docs_check.py (``make test``: the static rules and the serving page's blocks).

A shell block is a fenced block tagged ``bash``; every fenced block of these pages carries a language tag (``text``
for listings), so none is left out by mistake. Each shell block runs with ``bash -e -o pipefail`` (a failing
command fails the block) in a fresh scratch directory that holds what the docs' commands expect to find (SANDBOX
below: small stand-ins for trained runs and input files), offline (HF_HUB_OFFLINE=1, HOME and XDG directories
inside the scratch directory), with ``aiayn`` on PATH as this checkout's ``python -m aiayn`` and ``python`` as the
interpreter running the check. The commands are not rewritten, except for what SUBSTITUTE lists.

A line right before a block marks it:
  <!-- docs-check: skip (why) -->   not run: it needs the network, a GPU, a long training, or it starts a server in
                                    the foreground; ``python tests/docs_check.py --list`` prints these with why.
  <!-- docs-check: server RUN -->   run while ``aiayn serve RUN`` (RUN a SANDBOX path) listens in the background.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tiny_recipe import TINY_RUN_OVERRIDES  # tests/: the script's own folder, first on sys.path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks/ (not an installed package), when run as a script
from benchmarks import serve_load  # noqa: E402

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = "bash"

# What the scratch directory holds, by the path the docs use -> what stands in for it. "translation": a
# translation run trained seconds on the reverse-words task (English -> German by its config, as Multi30k's);
# "lm": a character language model trained seconds on word lists; "hf": the translation run exported as a
# Hugging Face Marian directory; "text": a few lines of words; "dir": an empty directory; "repo": the checkout's own
# copy (committed results).
SANDBOX = {
    "runs/m30k": "translation", "runs/multi30k_en_de_quick": "translation", "runs/vizrun": "translation",
    "runs/demo": "translation", "runs/lm_char": "lm", "runs/lm_quick": "lm",
    "opus-mt-en-de": "hf", "news.en": "text", "docs/images": "dir",
    "results/table3_multi30k_2026-11-26": "repo",
}
# The only rewriting of a block: the documented server address -> the port the check's server listens on
# (chosen free), and curl -> curl --fail-with-body (an HTTP error status then fails the block, as a person
# reading the answer would see it fail).
SUBSTITUTE = {"localhost:8000": "localhost:{port}"}
CURL_FLAGS = ["--fail-with-body"]
INSTALLS = re.compile(r"(?:^|&&|;)\s*(?:sudo\s+)?(?:\S*python3?\s+-m\s+)?(?:pip3?|uv pip|apt-get|apt)\s+install\b",
                      re.M)
MARK = re.compile(r"<!--\s*docs-check:\s*(skip|server)\s*(.*?)\s*-->")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    code: str
    mark: str | None  # skip | server | None
    arg: str  # skip: the reason (without its parentheses); server: the run

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(pages: list[Path] = PAGES) -> Iterator[Block]:
    """Every fenced block of ``pages``, with the docs-check mark on the last non-blank line before it."""
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip().splitlines()
            mark = MARK.search(before[-1]) if before else None
            kind, arg = (mark.group(1), mark.group(2)) if mark else (None, "")
            if kind == "skip" and arg.startswith("(") and arg.endswith(")"):
                arg = arg[1:-1]
            yield Block(page, text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2), kind, arg)


def problems(pages: list[Path] = PAGES) -> list[str]:
    """What breaks the rules above: an untagged fence, a mark on a non-shell block, a skip without a reason, a
    server mark naming no SANDBOX run, a block that installs packages without a skip mark."""
    out = []
    for b in blocks(pages):
        if not b.lang:
            out.append(f"{b.name}: a fenced block without a language tag (bash for commands, text for listings)")
        elif b.mark and b.lang != SHELL:
            out.append(f"{b.name}: a docs-check mark on a {b.lang} block")
        elif b.mark == "skip" and not b.arg:
            out.append(f"{b.name}: docs-check: skip needs a reason: <!-- docs-check: skip (why) -->")
        elif b.mark == "server" and SANDBOX.get(b.arg) not in ("translation", "lm"):
            out.append(f"{b.name}: docs-check: server {b.arg!r} is not a run of the scratch directory")
        elif b.lang == SHELL and b.mark != "skip" and INSTALLS.search(b.code):
            # the check runs blocks with this checkout's interpreter: an install would change its environment
            out.append(f"{b.name}: installs packages; mark it <!-- docs-check: skip (installs ...) -->")
    return out


def shell_blocks(pages: list[Path] = PAGES) -> list[Block]:
    return [b for b in blocks(pages) if b.lang == SHELL]


# The stand-ins ------------------------------------------------------------------------------------------------

def build_runs(work: Path, translation: Path | None = None) -> dict[str, Path]:
    """The stand-ins of SANDBOX under ``work`` (``translation``: an existing tiny translation run to use)."""
    from aiayn.config import config_from_dict, load_config
    from aiayn.train.run import train

    work.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    if translation is None:
        translation = work / "translation"
        if not (translation / "model.safetensors").exists():
            cfg = load_config(REPO / "configs" / "tiny_reverse.yaml", TINY_RUN_OVERRIDES)
            train(cfg, translation, progress=False)
    made["translation"] = translation
    lm = work / "lm"
    if not (lm / "model.safetensors").exists():
        (work / "words.txt").write_text("".join(f"{w} the cat and the dog {w}\n" for w in TEXT * 40), encoding="utf-8")
        train(config_from_dict({
            "task": "lm",
            "model": {"d_model": 32, "n_heads": 2, "d_ff": 64, "dropout": 0.0, "n_decoder_layers": 2,
                      "max_positions": 64},
            "data": {"train_src": str(work / "words.txt"), "tokenizer": "char", "block_size": 32, "batch_size": 8},
            "train": {"max_updates": 10, "schedule": "constant", "lr": 3e-3, "eval_every": 10, "save_every": 10,
                      "log_every": 10, "threads": 1}}), lm, progress=False)
    made["lm"] = lm
    return made


TEXT = ["alpha bravo charlie", "delta echo", "foxtrot golf hotel india", "juliet kilo"]


def _hf_export(translation: Path, work: Path) -> Path:
    from aiayn.interop.hf import export_hf

    out = work / "hf"
    if not (out / "config.json").exists():
        export_hf(translation, out, force=True)
    return out


def make_sandbox(dest: Path, runs: dict[str, Path], needs: str) -> None:
    """A scratch directory with the SANDBOX paths that ``needs`` (a block's code) mentions, and the shims."""
    for path, kind in SANDBOX.items():
        if path not in needs and not (kind == "dir" and path.split("/")[0] in needs):
            continue
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == "text":
            target.write_text("".join(line + "\n" for line in TEXT), encoding="utf-8")
        elif kind == "dir":
            target.mkdir(parents=True, exist_ok=True)
        elif kind == "repo":
            shutil.copytree(REPO / path, target)
        elif kind == "hf":
            shutil.copytree(_hf_export(runs["translation"], runs["translation"].parent), target)
        else:  # a copy: a block may change it (average, evaluate)
            shutil.copytree(runs[kind], target)
    bin_dir = dest / ".bin"
    bin_dir.mkdir()
    (bin_dir / "aiayn").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m aiayn "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    curl = shutil.which("curl")
    if curl:
        (bin_dir / "curl").write_text(f'#!/bin/sh\nexec "{curl}" {" ".join(CURL_FLAGS)} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (dest / ".home").mkdir()


def sandbox_env(dest: Path) -> dict[str, str]:
    home = dest / ".home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARGOS_", "XDG_"))}
    env.update(PATH=os.pathsep.join([str(dest / ".bin"), str(Path(sys.executable).parent), env.get("PATH", "")]),
               PYTHONPATH=str(REPO), HOME=str(home), XDG_DATA_HOME=str(home / "data"),
               XDG_CACHE_HOME=str(home / "cache"), XDG_CONFIG_HOME=str(home / "config"), HF_HUB_OFFLINE="1",
               ARGOS_DEVICE_TYPE="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


# Running ------------------------------------------------------------------------------------------------------

class Servers:
    """``aiayn serve RUN`` for the blocks marked ``server RUN``: started at the first such block, each in a
    scratch directory of its own, shared by the later blocks, stopped on exit."""

    def __init__(self, runs: dict[str, Path], scratch: Path):
        self.runs, self.scratch, self.procs = runs, scratch, {}

    def port(self, run: str) -> int:
        if run not in self.procs:
            dest = Path(tempfile.mkdtemp(prefix="server-", dir=self.scratch))
            make_sandbox(dest, self.runs, run)
            proc, url, _ = serve_load.start_server(run, "--threads", "1", cwd=dest, env=sandbox_env(dest))
            self.procs[run] = proc, int(url.rsplit(":", 1)[1])
        return self.procs[run][1]

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        for proc, _ in self.procs.values():
            serve_load.stop_server(proc, timeout=20)


def run_block(b: Block, runs: dict[str, Path], scratch: Path, servers: Servers, timeout: float = 600
              ) -> tuple[int, str]:
    """(exit status, the block's output) of one shell block run as the module docstring says."""
    dest = Path(tempfile.mkdtemp(prefix="block-", dir=scratch))
    make_sandbox(dest, runs, b.code)
    code = b.code
    if b.mark == "server":
        for old, new in SUBSTITUTE.items():
            code = code.replace(old, new.format(port=servers.port(b.arg)))
    try:
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=dest, env=sandbox_env(dest),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/docs_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("pages", nargs="*", help="pages to check (default README.md and docs/*.md)")
    p.add_argument("--list", action="store_true", help="list every shell block: run, or skipped and why")
    p.add_argument("--work", default=None, help="where the stand-in runs are built and kept (default: a temporary "
                                                "directory)")
    args = p.parse_args(argv)
    pages = [Path(x).resolve() for x in args.pages] or PAGES
    bad = problems(pages)
    for line in bad:
        print(f"docs-check: {line}", file=sys.stderr)
    todo = shell_blocks(pages)
    if args.list:
        for b in todo:
            how = {"skip": f"skip: {b.arg}", "server": f"runs beside aiayn serve {b.arg}"}.get(b.mark, "runs")
            print(f"{b.name}: {how}")
        return 1 if bad else 0
    with tempfile.TemporaryDirectory(prefix="aiayn-docs-check-") as tmp:
        work = Path(args.work) if args.work else Path(tmp) / "runs"
        runs = build_runs(work)
        failed = len(bad)
        with Servers(runs, Path(tmp)) as servers:
            for b in todo:
                if b.mark == "skip":
                    print(f"skip  {b.name}: {b.arg}")
                    continue
                start = time.monotonic()
                rc, out = run_block(b, runs, Path(tmp), servers)
                print(f"{'ok   ' if rc == 0 else 'FAIL '} {b.name} ({time.monotonic() - start:.0f} s)")
                if rc != 0:
                    failed += 1
                    print("    " + "\n    ".join(out.strip().splitlines()[-30:]))
    print(f"docs-check: {failed} failed" if failed else "docs-check: every block that runs ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
