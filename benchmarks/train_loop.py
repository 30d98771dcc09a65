"""The training loop's speed against another checkout of aiayn: the whole ``aiayn train`` (planning, collation,
the update, logging, the clock) of one recipe, this tree and a baseline tree alternately, in fresh processes.

    git worktree add /tmp/aiayn-base <commit>
    AIAYN_DATA_DIR=../shared/data python -m benchmarks.train_loop --baseline /tmp/aiayn-base [--rounds 3]
    AIAYN_DATA_DIR=../shared/data python -m benchmarks.train_loop --precisions fp32 auto \
        --recipe multi30k_en_de_quick --updates 60 --rounds 2

``--precisions A B`` compares this tree with itself in two ``train.precision`` settings instead (issue 69: the
updates per minute ``--precision auto`` makes against fp32 on a CPU with native bf16); the precision each
training reports it ran in (its "precision: ..." log line) is recorded, and the trainings share one prepared
token store (prepared by a first training that is not counted), since only the updates are compared.

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
from typing import Any, NamedTuple

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


class Measured(NamedTuple):
    """One training: target tokens/s between its first and last logged update, the CPU seconds (user + system)
    of its process, the seconds from its start to its model line, its "precision: ..." log line's words, and the
    minor page faults of its process (pages the kernel mapped and zeroed for it: fresh memory, start-up included)."""

    speed: float
    cpu_s: float
    setup_s: float
    precision: str
    faults: int


def measure(tree: Path, recipe: list[str], updates: int, work: Path, extra: list[str],
            cache: Path | None = None, threads: int = 1) -> Measured:
    """One training of ``updates`` updates by the code in ``tree`` (:class:`Measured`), in a fresh process with an
    empty cache of its own, or ``cache`` (shared)."""
    run = work / f"run-{len(list(work.iterdir()))}"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads),
           "AIAYN_CACHE_DIR": str(cache) if cache is not None else str(run) + "-cache"}
    cmd = [sys.executable, "-m", "aiayn", "train", recipe[0], "--run-dir", str(run), *recipe[1:], "--no-progress",
           "--set", f"train.max_updates={updates}", "--set", f"train.log_every={max(1, updates // 10)}",
           "--set", f"train.eval_every={updates}", "--set", f"train.save_every={updates}",
           "--set", "train.device=cpu", *extra]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    proc = subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=tree, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    model = next(line for line in proc.stderr.splitlines() if "aiayn.train: model:" in line)
    precision = next((line.split("aiayn.train: precision: ", 1)[1] for line in proc.stderr.splitlines()
                      if "aiayn.train: precision: " in line), "not logged")
    setup_s = datetime.strptime(model[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - start
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    logs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in logs if "train_loss" in r]
    first, last = steps[0], steps[-1]
    tokens = sum(r["tokens_per_update"] * (r["step"] - p["step"]) for p, r in zip(steps, steps[1:]))
    faults = after.ru_minflt - before.ru_minflt
    return Measured(tokens / (last["elapsed_s"] - first["elapsed_s"]), cpu_s, setup_s, precision, faults)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--baseline", help="a checkout of the aiayn to compare with (git worktree add)")
    which.add_argument("--precisions", nargs=2, metavar=("A", "B"),
                       help="compare this tree with itself at train.precision A and B (e.g. fp32 auto)")
    p.add_argument("--recipe", default="tiny_reverse", choices=sorted(RECIPES))
    p.add_argument("--updates", type=int, default=200, help="updates per training (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="trainings per side, alternating (default 3)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every training (default 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides, both")
    p.add_argument("--md", default=None, help="rewrite this file's train_loop section (BENCHMARKS.md)")
    p.add_argument("--out-json", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    extra = [x for kv in args.set for x in ("--set", kv)] + ["--set", f"train.threads={args.threads}"]
    if args.precisions:
        sides = [(f"precision {x}", HERE, ["--set", f"train.precision={x}"]) for x in args.precisions]
    else:
        baseline = Path(args.baseline).resolve()
        if not (baseline / "aiayn" / "__init__.py").is_file():
            p.error(f"--baseline {baseline}: not a checkout of aiayn (no aiayn/__init__.py)")
        sides = [("baseline", baseline, []), ("this tree", HERE, [])]
    results: dict[str, list[Measured]] = {name: [] for name, _, _ in sides}
    with tempfile.TemporaryDirectory(prefix="aiayn-loop-") as tmp:
        work = Path(tmp) / "runs"
        work.mkdir()
        cache = Path(tmp) / "cache" if args.precisions else None  # one store, prepared by an uncounted training
        if cache is not None:
            measure(HERE, RECIPES[args.recipe], 2, work, extra + sides[0][2], cache, args.threads)
        for _ in range(args.rounds):
            for name, tree, own in sides:
                m = measure(tree, RECIPES[args.recipe], args.updates, work, extra + own, cache, args.threads)
                results[name].append(m)
                print(f"{name}: {m.speed:,.0f} target tokens/s, {m.cpu_s:.1f} CPU s, {m.setup_s:.1f} s to the model "
                      f"line, {m.faults:,} minor page faults; precision: {m.precision}", flush=True)
    report(args, argv, sides, results)


def report(args: argparse.Namespace, argv: list[str] | None, sides: list[tuple[str, Path, list[str]]],
           results: dict[str, list[Measured]]) -> None:
    """Print the ratio of medians (second side / first), write the JSON and the BENCHMARKS section."""
    first, second = (name for name, _, _ in sides)
    rows = {k: [m.speed for m in v] for k, v in results.items()}
    cpu = {k: [m.cpu_s for m in v] for k, v in results.items()}
    setup = {k: [m.setup_s for m in v] for k, v in results.items()}
    faults = {k: [m.faults for m in v] for k, v in results.items()}
    med, med_cpu, med_setup, med_faults = ({k: statistics.median(v) for k, v in d.items()}
                                           for d in (rows, cpu, setup, faults))
    ratio, cpu_ratio = med[second] / med[first], med_cpu[second] / med_cpu[first]
    described = {name: _describe(tree) for name, tree, _ in sides}
    result: dict[str, Any] = {"date": utc_now(), "recipe": args.recipe, "updates": args.updates,
                              "threads": args.threads, "sides": described, "tokens_per_s": rows, "cpu_s": cpu,
                              "setup_s": setup, "minor_faults": faults,
                              "precision": {k: [m.precision for m in v] for k, v in results.items()},
                              "ratio": ratio, "cpu_ratio": cpu_ratio, "machine": machine_info(args.threads),
                              "command": command_line("train_loop", argv or sys.argv[1:])}
    if not args.precisions:  # the keys earlier results have
        result.update(baseline=described["baseline"], this_tree=described["this tree"])
    print(f"ratio of medians ({second} / {first}): tokens/s {ratio:.3f}, CPU seconds {cpu_ratio:.3f}; start to "
          f"model line: {med_setup[second]:.1f} s against {med_setup[first]:.1f} s")
    if args.out_json:
        write_json(args.out_json, result)
    if not args.md:
        return
    table = markdown_table(
        ["side", "measure", *[f"round {i + 1}" for i in range(args.rounds)], "median"],
        [[f"{k} ({described[k]})", what, *[fmt.format(v) for v in vals[k]], fmt.format(mid[k])]
         for what, vals, mid, fmt in (("target tokens/s", rows, med, "{:,.0f}"), ("CPU s", cpu, med_cpu, "{:.1f}"),
                                      ("start to model line (s)", setup, med_setup, "{:.1f}"),
                                      ("minor page faults", faults, med_faults, "{:,.0f}"))
         for k in vals])
    if args.precisions:
        ran = "; ".join(f"{k}: {v[0].precision}" for k, v in results.items())
        body = (f"## Training in bf16 against fp32 through `aiayn train` ({args.threads} thread(s), issue 69)\n\n"
                f"`aiayn train {args.recipe}` ({args.updates} updates, {args.threads} thread(s), fresh processes "
                f"sharing one prepared store, the two precisions in turn): {second} / {first} = **{ratio:.2f}x** "
                f"in target tokens/s (updates per minute); {cpu_ratio:.2f}x the CPU seconds of a whole training "
                f"(start-up included). What each ran in, from its log: {ran}.\n\n{table}\n\n")
        section = f"train_loop_precision_{args.threads}t"
    else:
        body = (f"`aiayn train {args.recipe}` ({args.updates} updates, 1 thread, fresh processes, the two trees in "
                f"turn): this tree / baseline = **{ratio:.3f}** in target tokens/s, **{cpu_ratio:.3f}** in CPU "
                f"seconds per training.\n\n{table}\n\n")
        section = "train_loop"
    update_section(args.md, section, body + provenance(result["machine"], result["command"], result["date"]))


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
