"""The data path at the paper's scale: synthetic corpora of WMT-like lengths, prepared once, then trained from.

    python -m benchmarks.data_scale [--sizes 100000 1000000 4500000] [--auto] [--out-json F] [--smoke]

For each size N: writes N sentence pairs (source lengths drawn like WMT14 En-De's, mean ~23 words, targets of a
similar length; words from a synthetic 60k-word vocabulary), then measures

- ``aiayn prepare``: wall time, pairs/s, the store's size on disk (and the text's);
- ``aiayn train`` from the store (``--set data.prepared=DIR``, a 0.6M-parameter model, 20 updates of 4,096
  tokens): peak RSS of the training process and its children (``wait4``: the largest of them), seconds from the
  "model: ..." log line to the first logged update, the step's tokens/s, and the share of the epoch the step
  waited for its batches (the trainer's "epoch N: ... waiting for batches" line);
- the data loader alone (the training data of the store and its epoch plan): seconds to plan an epoch, target
  tokens/s collated in one process, and target tokens/s delivered by the trainer's ``UpdateLoader`` (DataLoader
  worker processes, ``data.loader_workers``' default here, and each count of ``--loader-workers``), each against
  the step's.

``--auto``: what a user writes first: ``aiayn train`` on a config naming the text files, nobody running
``aiayn prepare`` (the training prepares its store in ``$AIAYN_CACHE_DIR/stores``, here a temporary directory);
the preparation's time is then read from the training's own log, and the peak RSS covers it.

Each size runs in a fresh temporary directory; nothing is kept. ``--smoke``: 2,000 pairs, 3 updates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.d_model=64", "model.n_heads=4", "model.d_ff=256", "model.n_encoder_layers=2",
         "model.n_decoder_layers=2", "model.max_positions=256", "data.vocab_size=8000", "data.max_tokens=4096",
         "train.eval_every=1000000", "train.save_every=1000000", "train.log_every=1", "train.warmup=100",
         "data.tokenizer_sample=300000"]  # SentencePiece trains on a sample (the default 2M suits a GPU machine)


def write_corpus(directory: Path, n: int, seed: int = 0) -> tuple[Path, Path, Path, Path]:
    """N training pairs and 1,000 validation pairs as text files (source, target), WMT-like lengths."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(60000)]
    weights = [1.0 / (i + 10) for i in range(len(vocab))]  # Zipf-like word frequencies
    cum = []
    total = 0.0
    for w in weights:
        total += w
        cum.append(total)

    def sentence() -> str:
        k = max(1, min(120, int(rng.lognormvariate(3.0, 0.55))))  # mean ~23 words, a long tail
        return " ".join(rng.choices(vocab, cum_weights=cum, k=k))

    paths = []
    for split, count in (("train", n), ("valid", 1000)):
        src, tgt = directory / f"{split}.src", directory / f"{split}.tgt"
        with open(src, "w", encoding="utf-8") as fs, open(tgt, "w", encoding="utf-8") as ft:
            for _ in range(count):
                fs.write(sentence() + "\n")
                ft.write(sentence() + "\n")
        paths += [src, tgt]
    return paths[0], paths[1], paths[2], paths[3]


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[int, float, int, str]:
    """(exit status, wall seconds, peak RSS in MiB of that process, its stderr)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss // 1024, err.read()


def _stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _dataloader_rate(data: Any, workers: int, updates: int) -> int:
    """Target tokens/s the trainer's DataLoader delivers with ``workers`` processes, one batch an update, after
    the first (the workers' start: once a run, not per batch)."""
    from aiayn.data.loader import UpdateLoader

    plan = data.epoch_plan(0)
    with UpdateLoader(data, workers) as loader:
        batches = loader.epoch([[p] for p in plan], 0)
        next(batches)
        t0 = time.perf_counter()
        delivered = sum(next(batches)[0].ntokens for _ in range(min(updates, len(plan) - 1)))
        return round(delivered / (time.perf_counter() - t0))


def loader_speed(cfg_args: list[str], updates: int, more_workers: Sequence[int] = ()) -> dict[str, Any]:
    """Plan an epoch and collate ``updates`` batches from the store, in this process, then through the trainer's
    DataLoader (default number of workers, and each of ``more_workers``; one batch per update): seconds and target
    tokens/s."""
    import torch

    from aiayn.config import load_config
    from aiayn.data.loader import loader_workers
    from aiayn.data.pipeline import build_translation_data

    with tempfile.TemporaryDirectory() as run:
        cfg = load_config(cfg_args[0], [a for a in cfg_args[1:] if a != "--set"])
        data, _ = build_translation_data(cfg, Path(run))
        t0 = time.perf_counter()
        plan = data.epoch_plan(0)
        plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tokens = sum(data.collate_plan(p).ntokens for p in plan[:updates])
        collate_s = time.perf_counter() - t0
        workers = loader_workers(None, torch.device("cpu"), torch.get_num_threads(), 1)
        rates = {}
        # the benchmark's batches, and the paper's (25,000 tokens an update on one process): the DataLoader's cost
        # per batch is fixed, so bigger batches deliver more tokens a second
        for name, budget in (("", None), ("_25k", 25_000)):
            if budget is not None:
                data, _ = build_translation_data(dataclasses.replace(
                    cfg, data=dataclasses.replace(cfg.data, max_tokens=budget)), Path(run) / "25k")
            rates[f"dataloader{name}_tokens_per_s"] = _dataloader_rate(data, workers, updates)
            for n in more_workers:
                rates.setdefault(f"dataloader{name}_tokens_per_s_by_workers", {})[n] = _dataloader_rate(
                    data, n, updates)
        return {"plan_s": round(plan_s, 2), "batches": len(plan),
                "collate_tokens_per_s": round(tokens / collate_s), "workers": workers, **rates}


def _epoch_wait(lines: list[str]) -> float | None:
    """The share (%) of the first epoch the step waited for batches, from the trainer's log."""
    for line in lines:
        m = re.search(r"aiayn.train: epoch \d+: .*\(([\d.]+)%\) waiting for batches", line)
        if m:
            return float(m.group(1))
    return None


def _prepare_s(lines: list[str]) -> float | None:
    """Seconds the training spent preparing its own store: its first line to the store's "kept" lines."""
    kept = [_stamp(x) for x in lines if "from the store" in x and x[:4].isdigit()]
    return round(kept[0] - _stamp(lines[0]), 1) if kept and lines[0][:4].isdigit() else None


def measure(n: int, updates: int, work: Path, auto: bool = False, more_workers: Sequence[int] = ()
            ) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "AIAYN_CACHE_DIR": str(work / "cache")}
    t0 = time.perf_counter()
    train_src, train_tgt, valid_src, valid_tgt = write_corpus(work, n)
    write_s = time.perf_counter() - t0
    store = work / "store"
    data = ["--set", "data.dataset=null", "--set", f"data.train_src={train_src}", "--set",
            f"data.train_tgt={train_tgt}", "--set", f"data.valid_src={valid_src}", "--set",
            f"data.valid_tgt={valid_tgt}"] + [x for m in MODEL for x in ("--set", m)]
    recipe = str(REPO / "configs" / "tiny_reverse.yaml")
    prep_s, prep_rss = None, None
    if not auto:
        rc, prep_s, prep_rss, err = run_measured([sys.executable, "-m", "aiayn", "prepare", recipe, "--out",
                                                  str(store), *data], env)
        if rc != 0:
            raise SystemExit(f"prepare failed:\n{err[-3000:]}")
    text_mb = sum(p.stat().st_size for p in (train_src, train_tgt, valid_src, valid_tgt)) / 2**20
    args = [*data, *([] if auto else ["--set", f"data.prepared={store}"]), "--set", f"train.max_updates={updates}"]
    rc, train_s, train_rss, err = run_measured([sys.executable, "-m", "aiayn", "train", recipe, "--run-dir",
                                                str(work / "run"), "--no-progress", *args], env)
    if rc != 0:
        raise SystemExit(f"train failed:\n{err[-3000:]}")
    lines = err.splitlines()
    if auto:
        (store,) = (work / "cache" / "stores").iterdir()
        prep_s = _prepare_s(lines)
    store_mb = sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) / 2**20
    built = next(_stamp(x) for x in lines if "aiayn.train: model:" in x)
    first = next(_stamp(x) for x in lines if re.search(r"aiayn.train: step 1/", x))
    logs = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in logs if "tokens_per_s" in r][2:] or [r for r in logs if "tokens_per_s" in r]
    step_tps = sorted(r["tokens_per_s"] for r in steps)[len(steps) // 2]
    loader = loader_speed([recipe, *args, "--set", f"data.prepared={store}"], min(200, updates * 10), more_workers)
    return {"pairs": n, "auto": auto, "write_s": round(write_s, 1), "text_mb": round(text_mb, 1),
            "prepare_s": prep_s and round(prep_s, 1), "prepare_pairs_per_s": prep_s and round(n / prep_s),
            "prepare_peak_rss_mb": prep_rss, "store_mb": round(store_mb, 1),
            "train_peak_rss_mb": train_rss, "train_wall_s": round(train_s, 1),
            "first_update_s": round(first - built, 2),
            "epoch_wait_pct": _epoch_wait(lines), "step_tokens_per_s": step_tps,
            **{f"loader_{k}": v for k, v in loader.items()},
            "loader_over_step": round(loader["dataloader_tokens_per_s"] / max(step_tps, 1e-9), 1)}


def _more(row: dict[str, Any], name: str) -> str:
    """The DataLoader's rates with other worker counts (``--loader-workers``), as "; rate (workers)"."""
    by = row.get(f"loader_dataloader{name}_tokens_per_s_by_workers") or {}
    return "".join(f"; {rate:,} ({n})" for n, rate in by.items())


def markdown(result: dict[str, Any]) -> str:
    rows = ["| pairs | how | text (MB) | prepare (s) | store (MB) | training peak RSS (MiB) | model built -> "
            "first update (s) | step waited (% of epoch) | epoch plan (s) | collate tokens/s | DataLoader tokens/s "
            "(workers) | DataLoader, 25k-token batches | step tokens/s | DataLoader / step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        how = "config names the files" if r["auto"] else "aiayn prepare + data.prepared"
        rows.append(f"| {r['pairs']:,} | {how} | {r['text_mb']:,} | {r['prepare_s']} | {r['store_mb']:,} | "
                    f"{r['train_peak_rss_mb']:,} | {r['first_update_s']} | {r['epoch_wait_pct']} | "
                    f"{r['loader_plan_s']} | {r['loader_collate_tokens_per_s']:,} | "
                    f"{r['loader_dataloader_tokens_per_s']:,} ({r['loader_workers']}){_more(r, '')} | "
                    f"{r.get('loader_dataloader_25k_tokens_per_s', 0):,}{_more(r, '_25k')} | "
                    f"{r['step_tokens_per_s']:,} | "
                    f"{r['loader_over_step']}x |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data_scale", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 4_500_000])
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--out-json")
    p.add_argument("--auto", action="store_true",
                   help="train on a config naming the text files (the training prepares its own store)")
    p.add_argument("--loader-workers", type=int, nargs="*", default=[], metavar="N",
                   help="also measure the DataLoader with N worker processes (besides the trainer's default)")
    p.add_argument("--smoke", action="store_true", help="2,000 pairs and 3 updates: does it run?")
    args = p.parse_args(argv)
    sizes, updates = ([2000], 3) if args.smoke else (args.sizes, args.updates)
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(n, updates, Path(tmp), args.auto, args.loader_workers))
        print(json.dumps(rows[-1]), flush=True)
    result = {"command": "python -m benchmarks.data_scale " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cpus": os.cpu_count(), "rows": rows}
    print(markdown(result))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
