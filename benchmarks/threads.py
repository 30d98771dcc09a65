"""Training speed at 1 and 2 CPU threads, on a quiet machine and beside other work: what aiayn's default thread
count (aiayn.engine.cpu_threads) is chosen from.

    AIAYN_DATA_DIR=../shared/data python -m benchmarks.threads [--updates 40] [--out-json F]

Each cell trains a recipe for ``--updates`` updates in a fresh process (``aiayn train ... --set
train.threads=T``) and reports its updates per second between the 5th and the last update (start-up and the
first updates excluded). Loads: ``quiet`` (nothing else running), ``busy-loop`` (one Python process spinning on
one core), ``training`` (a second aiayn training with PyTorch's default threads, the "other work" of a shared
machine). Recipes: the character LM of nanoGPT's CPU shape (0.8M parameters) and the Multi30k quick recipe
(7.6M). Speeds are compared within a row (same recipe and load), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RECIPES = {
    "lm-char (0.8M)": ["lm_tinyshakespeare_char_quick"],
    "multi30k-quick (7.6M)": ["multi30k_en_de_quick", "--set", "train.max_minutes=null"],
}
LOADS = ("quiet", "busy-loop", "training")


def start_load(kind: str, work: Path) -> subprocess.Popen | None:
    """The background work of a load (None for quiet)."""
    if kind == "quiet":
        return None
    if kind == "busy-loop":
        cmd = [sys.executable, "-c", "while True: pass"]
    else:
        cmd = [sys.executable, "-m", "aiayn", "train", "lm_tinyshakespeare_char_quick", "--run-dir",
               str(work / "load"), "--set", "train.max_updates=1000000", "--set", "train.eval_every=1000000",
               "--set", "train.save_every=1000000", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(15)  # the load is running (a training has built its data) before the measurement starts
    return proc


def measure(recipe: list[str], threads: int, updates: int, work: Path) -> float:
    """Updates per second of one training process between its 5th and its last update."""
    run = work / f"run-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "aiayn", "train", recipe[0], "--run-dir", str(run), *recipe[1:], "--no-progress",
           "--set", f"train.max_updates={updates}", "--set", "train.log_every=5", "--set", f"train.threads={threads}",
           "--set", f"train.eval_every={updates}", "--set", f"train.save_every={updates}"]
    subprocess.run(cmd, check=True, capture_output=True)
    logs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in logs if "train_loss" in r]
    first, last = steps[0], steps[-1]
    return (last["step"] - first["step"]) / (last["elapsed_s"] - first["elapsed_s"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    p.add_argument("--out-json", help="write the result here too")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for load in args.loads:
            proc = start_load(load, work)
            try:
                for name in args.recipes:
                    speed = {t: measure(RECIPES[name], t, args.updates, work) for t in (1, 2)}
                    row = {"load": load, "recipe": name, "updates_per_s_1": round(speed[1], 3),
                           "updates_per_s_2": round(speed[2], 3), "two_over_one": round(speed[2] / speed[1], 2),
                           "loadavg_1min": round(os.getloadavg()[0], 2)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    result = {"command": "python -m benchmarks.threads " + " ".join(argv or sys.argv[1:]), "cpus": os.cpu_count(),
              "rows": rows}
    print("| load | recipe | 1 thread (updates/s) | 2 threads (updates/s) | 2 / 1 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['load']} | {r['recipe']} | {r['updates_per_s_1']} | {r['updates_per_s_2']} | "
              f"{r['two_over_one']}x |")
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
