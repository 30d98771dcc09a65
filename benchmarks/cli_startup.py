"""How long `aiayn --help` takes, against the bare interpreter and `import torch` measured in the same run.

    python -m benchmarks.cli_startup [--repeat 5] [--out-json benchmarks/results/cli_startup.json]

The test suite only checks that the parser never imports PyTorch (tests/test_structure.py); the time is a
benchmark, since a busy machine makes any wall-clock bound fail without anything being wrong. Each command
runs ``--repeat`` times in a fresh interpreter; the best time of each is reported, and the help's time over
the bare interpreter's (what aiayn itself adds) and over `import torch` (what it avoids).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COMMANDS = {
    "python": [sys.executable, "-c", "pass"],
    "aiayn --help": [sys.executable, "-m", "aiayn", "--help"],
    "import torch": [sys.executable, "-c", "import torch"],
}


def best_wall(cmd: list[str], repeat: int) -> float:
    """The shortest wall time of ``repeat`` runs of ``cmd`` (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cli_startup", description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out-json", help="write the result here too")
    args = p.parse_args(argv)
    # Interleaved rounds, so that a machine whose speed drifts affects every command alike.
    times = {name: float("inf") for name in COMMANDS}
    for _ in range(args.repeat):
        for name, cmd in COMMANDS.items():
            times[name] = min(times[name], best_wall(cmd, 1))
    result = {"best_s": {k: round(v, 4) for k, v in times.items()},
              "help_over_python": round(times["aiayn --help"] / times["python"], 2),
              "help_over_import_torch": round(times["aiayn --help"] / times["import torch"], 2),
              "command": "python -m benchmarks.cli_startup " + " ".join(argv or [])}
    print(json.dumps(result, indent=2))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
