"""Every test file passes alone: each in a pytest process of its own (its tests shuffled by pytest-randomly), so a
test that leans on what another file left behind (a global generator's state, a cache, an environment variable, a
fixture another module built) fails here, where the full run's order hid it.

    python tests/alone.py                  # this run's share of the files (CI: ``make test-alone``)
    python tests/alone.py --share all      # every file (about as long as the suite itself)
    python tests/alone.py --share 2/6      # share 2 of 6
    python tests/alone.py tests/test_x.py  # these files

All files alone take about as long as the whole suite (1,675 s of processes, 2 at a time on 2 busy cores, on
2026-11-28), so CI runs one share of them a run: the files sorted by name and dealt into SHARES shares, and the
share picked by the day (days since 1970 modulo SHARES), printed with the command that runs it again. Over SHARES
days every file has run alone; a change to a file that is not in the day's share is checked by ``make test-alone
ALONE=all`` or by naming it. Each run prints the seed of every file's order, and a failed file's command line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SHARES = 6
# The tests that run on their own targets (make test-browser, a GPU), deselected as in the suite, and the files that
# hold nothing else (alone they would only start a process).
MARKERS = "not browser and not cuda"
OWN_TARGETS = ("test_browser.py", "test_cuda.py")


def test_files() -> list[Path]:
    return sorted(p for p in TESTS.glob("test_*.py") if p.name not in OWN_TARGETS)


def share_of(files: list[Path], share: str) -> tuple[list[Path], str]:
    """The files of ``share`` ("K/N", "all" or "today") and its name."""
    if share == "all":
        return files, "all"
    if share == "today":
        k, n = int(time.time() // 86400) % SHARES + 1, SHARES
    else:
        try:
            k, n = (int(x) for x in share.split("/"))
        except ValueError:
            raise SystemExit(f"alone.py: --share {share!r}: expected K/N, all or today") from None
        if not 1 <= k <= n:
            raise SystemExit(f"alone.py: --share {share}: K must be 1..{n}")
    return files[k - 1 :: n], f"{k}/{n}"


def command(path: Path) -> list[str]:
    """The pytest command line that runs ``path`` alone (in the repository's root)."""
    return [sys.executable, "-m", "pytest", str(path.relative_to(REPO)), "-m", MARKERS, "-p", "randomly", "-q",
            "-p", "no:cacheprovider"]


def run_alone(path: Path, workers: int) -> tuple[Path, int, float, str]:
    """``pytest PATH`` in a process of its own; (path, exit status, seconds, the last lines of its output)."""
    env = dict(os.environ, AIAYN_TEST_PROCESSES=str(workers))  # conftest: intra-op threads per process
    cmd = command(path)
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
    return path, done.returncode, time.monotonic() - start, tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="test files (default: a share of tests/test_*.py)")
    p.add_argument("--share", default=os.environ.get("ALONE") or "today", help="K/N, all or today (default)")
    p.add_argument("--workers", type=int, default=int(os.environ.get("TEST_WORKERS") or 2),
                   help="files run side by side (default $TEST_WORKERS or 2)")
    args = p.parse_args(argv)
    if args.files:
        files, name = [f.resolve() for f in args.files], "named"
    else:
        files, name = share_of(test_files(), args.share)
    print(f"alone.py: share {name}: {len(files)} file(s), each in a process of its own, {args.workers} at a time "
          f"(again: python tests/alone.py {'--share ' + name if name != 'named' else 'FILES'})", flush=True)
    failed = []
    with ThreadPoolExecutor(max(1, args.workers)) as pool:
        for path, rc, seconds, tail in pool.map(lambda f: run_alone(f, args.workers), files):
            # rc 5: every test of the file was deselected by MARKERS (a GPU- or browser-only file)
            ok = rc in (0, 5)
            order = next((ln for ln in tail.splitlines() if ln.startswith("test order:")), "")
            print(f"{'ok  ' if ok else 'FAIL'} {path.relative_to(REPO)} ({seconds:.0f} s) {order}", flush=True)
            if not ok:
                failed.append(path)
                print(f"{tail}\n(alone: {' '.join(command(path))}, with the seed above)", flush=True)
    if failed:
        print(f"alone.py: {len(failed)} file(s) failed alone: {' '.join(str(f.relative_to(REPO)) for f in failed)}")
        return 1
    print(f"alone.py: all {len(files)} file(s) passed alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
