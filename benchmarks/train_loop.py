"""The training loop's speed against another checkout of aiayn: the whole ``aiayn train`` (planning, collation,
the update, logging, the clock) of one recipe, this tree and a baseline tree alternately, in fresh processes.

    git worktree add /tmp/aiayn-base <commit>
    AIAYN_DATA_DIR=../shared/data python -m benchmarks.train_loop --baseline /tmp/aiayn-base [--rounds 3]

Each measurement trains ``--updates`` updates with one thread and reads the target tokens per second between the
first and the last logged update (start-up, data preparation and the first window excluded), the seconds from
the process's start to its "model: ..." log line (reading the corpus, training the tokenizer, encoding: what a
user's first run waits before its first update; each training gets an empty ``$AIAYN_CACHE_DIR``, so nothing
prepared by an earlier one is reused), and the CPU seconds the whole process used (user + system: on a busy
machine far steadier than wall-clock speed, since time spent
waiting for a core is not counted). The two trees run in turn, ``--rounds`` times each, so a change in the
machine's load touches both; the table gives each round and the ratios of medians (this tree / baseline).
The baseline is run with its own code (``PYTHONPATH``), the same recipe, flags and interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.common import (
    command_line,
    machine_info,
    markdown_table,
    provenance,
    update_section,
    utc_now,
    write_json,
)

HERE = Path(__file__).resolve().parent.parent
RECIPES = {
    "tiny_reverse": ["tiny_reverse"],
    "multi30k_en_de_quick": ["multi30k_en_de_quick", "--set", "train.max_minutes=null"],
}


def measure(tree: Path, recipe: list[str], updates: int, work: Path, extra: list[str]) -> tuple[float, float, float]:
    """Target tokens per second of one training by the code in ``tree`` between its first and last logged update,
    the CPU seconds (user + system) of its process, and the seconds from its start to its model line."""
    run = work / f"run-{len(list(work.iterdir()))}"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "AIAYN_CACHE_DIR": str(run) + "-cache"}
    cmd = [sys.executable, "-m", "aiayn", "train", recipe[0], "--run-dir", str(run), *recipe[1:], "--no-progress",
           "--set", f"train.max_updates={updates}", "--set", f"train.log_every={max(1, updates // 10)}",
           "--set", "train.threads=1", "--set", f"train.eval_every={updates}", "--set", f"train.save_every={updates}",
           "--set", "train.device=cpu", *extra]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    proc = subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=tree, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    model = next(line for line in proc.stderr.splitlines() if "aiayn.train: model:" in line)
    setup_s = datetime.strptime(model[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - start
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    logs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in logs if "train_loss" in r]
    first, last = steps[0], steps[-1]
    tokens = sum(r["tokens_per_update"] * (r["step"] - p["step"]) for p, r in zip(steps, steps[1:]))
    return tokens / (last["elapsed_s"] - first["elapsed_s"]), cpu_s, setup_s


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a checkout of the aiayn to compare with (git worktree add)")
    p.add_argument("--recipe", default="tiny_reverse", choices=sorted(RECIPES))
    p.add_argument("--updates", type=int, default=200, help="updates per training (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="trainings per tree, alternating (default 3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides, both")
    p.add_argument("--md", default=None, help="rewrite this file's train_loop section (BENCHMARKS.md)")
    p.add_argument("--out-json", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    baseline = Path(args.baseline).resolve()
    if not (baseline / "aiayn" / "__init__.py").is_file():
        p.error(f"--baseline {baseline}: not a checkout of aiayn (no aiayn/__init__.py)")
    extra = [x for kv in args.set for x in ("--set", kv)]
    rows: dict[str, list[float]] = {"this tree": [], "baseline": []}
    cpu: dict[str, list[float]] = {"this tree": [], "baseline": []}
    setup: dict[str, list[float]] = {"this tree": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="aiayn-loop-") as tmp:
        work = Path(tmp)
        for _ in range(args.rounds):
            for name, tree in (("baseline", baseline), ("this tree", HERE)):
                speed, cpu_s, setup_s = measure(tree, RECIPES[args.recipe], args.updates, work, extra)
                rows[name].append(speed)
                cpu[name].append(cpu_s)
                setup[name].append(setup_s)
                print(f"{name}: {speed:,.0f} target tokens/s, {cpu_s:.1f} CPU s, {setup_s:.1f} s to the model line",
                      flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    med_setup = {k: statistics.median(v) for k, v in setup.items()}
    ratio = med["this tree"] / med["baseline"]
    cpu_ratio = med_cpu["this tree"] / med_cpu["baseline"]
    result: dict[str, Any] = {"date": utc_now(), "recipe": args.recipe, "updates": args.updates,
                              "baseline": _describe(baseline), "this_tree": _describe(HERE), "tokens_per_s": rows,
                              "cpu_s": cpu, "setup_s": setup, "ratio": ratio, "cpu_ratio": cpu_ratio,
                              "machine": machine_info(1),
                              "command": command_line("train_loop", argv or sys.argv[1:])}
    print(f"ratio of medians (this tree / baseline): tokens/s {ratio:.3f}, CPU seconds {cpu_ratio:.3f}; start to "
          f"model line: {med_setup['this tree']:.1f} s against {med_setup['baseline']:.1f} s")
    if args.out_json:
        write_json(args.out_json, result)
    if args.md:
        table = markdown_table(
            ["tree", "measure", *[f"round {i + 1}" for i in range(args.rounds)], "median"],
            [[f"{k} ({result['this_tree' if k == 'this tree' else 'baseline']})", what,
              *[fmt.format(v) for v in vals[k]], fmt.format(mid[k])]
             for what, vals, mid, fmt in (("target tokens/s", rows, med, "{:,.0f}"), ("CPU s", cpu, med_cpu, "{:.1f}"),
                                          ("start to model line (s)", setup, med_setup, "{:.1f}"))
             for k in vals])
        body = (f"`aiayn train {args.recipe}` ({args.updates} updates, 1 thread, fresh processes, the two trees in "
                f"turn): this tree / baseline = **{ratio:.3f}** in target tokens/s, **{cpu_ratio:.3f}** in CPU "
                f"seconds per training.\n\n{table}\n\n"
                + provenance(result["machine"], result["command"], result["date"]))
        update_section(args.md, "train_loop", body)


def _describe(tree: Path) -> str:
    """The commit a tree is at (and whether it has changes), for the record."""
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(tree)
    return head + (" with changes" if dirty else "")


if __name__ == "__main__":
    main()
