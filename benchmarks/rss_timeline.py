"""Where a command's memory goes: its resident memory (RSS) and its children's, sampled while it runs, against
its own log lines.

    python -m benchmarks.rss_timeline [--every-s 0.02] [--out-json F] -- COMMAND [ARGS...]

Runs COMMAND (its stdout discarded, its stderr read line by line), samples ``VmRSS`` of the process and of every
descendant (``/proc``, Linux) every ``--every-s`` seconds, and prints: the process's peak and the log line it came
after, the largest child's peak, and for every log line the RSS then. A sampled peak can miss a spike shorter than
the interval; ``ru_maxrss`` (``benchmarks.data_scale``) cannot, but says nothing of when.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def rss_mib(pid: int) -> int:
    """VmRSS of ``pid`` in MiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in map(int, f.read().split()):
                    out += [child, *descendants(child)]
    except OSError:
        pass
    return out


def record(cmd: Sequence[str], every_s: float = 0.02) -> dict[str, Any]:
    """Run ``cmd``; its samples (seconds, own RSS, largest child's RSS) and stderr lines (seconds, text)."""
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples: list[tuple[float, int, int]] = []
    while proc.poll() is None:
        children = [rss_mib(c) for c in descendants(proc.pid)]
        samples.append((time.perf_counter() - t0, rss_mib(proc.pid), max(children, default=0)))
        time.sleep(every_s)
    reader.join(timeout=5)
    return {"command": list(cmd), "returncode": proc.returncode, "samples": samples, "lines": lines}


def _line_before(lines: list[tuple[float, str]], t: float) -> str:
    before = [text for at, text in lines if at <= t]
    return before[-1] if before else "(before its first line)"


def summary(rec: dict[str, Any]) -> str:
    """The peaks, and RSS at each log line."""
    samples, lines = rec["samples"] or [(0.0, 0, 0)], rec["lines"]
    own = max(samples, key=lambda s: s[1])
    child = max(samples, key=lambda s: s[2])
    out = [f"exit {rec['returncode']}; peak {own[1]:,} MiB at {own[0]:.1f} s, after: {_line_before(lines, own[0])}",
           f"largest child: {child[2]:,} MiB at {child[0]:.1f} s, after: {_line_before(lines, child[0])}"]
    for at, text in lines:
        s = min(samples, key=lambda x: abs(x[0] - at))
        out.append(f"{at:8.1f} s {s[1]:6,} MiB (child {s[2]:,}) | {text[:160]}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rss_timeline", description=__doc__.split("\n")[0])
    p.add_argument("--every-s", type=float, default=0.02)
    p.add_argument("--out-json")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the command to run after --")
    rec = record(cmd, args.every_s)
    print(summary(rec))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(rec) + "\n")
    return rec


if __name__ == "__main__":
    sys.exit(main()["returncode"])
