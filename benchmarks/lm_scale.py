"""A language model's corpus at scale: tinyshakespeare repeated to a given size, prepared into a token stream store
(char tokenizer), then trained from.

    python -m benchmarks.lm_scale [--sizes-mb 10 1000] [--updates 20] [--out-json F] [--smoke]

For each size S (MB): writes the text (tinyshakespeare, from ``$AIAYN_DATA_DIR`` or the download, repeated up to
S MB), then measures

- ``aiayn prepare`` (the ``lm_tinyshakespeare_char_quick`` recipe on that file): wall time, MB/s, its peak RSS,
  the store's size;
- ``aiayn train`` from the store (``data.prepared``; nanoGPT's GPU shape for the batches, block 256 x 64 blocks,
  on a 2-layer width-64 model, a few updates): the training process's peak RSS (``wait4``), and seconds from
  the process's start to its first logged update (and from the "model: ..." line to it).

The held-out part is kept near 100k characters at every size (``data.valid_fraction`` set from S), so the
evaluation at the end costs the same at every size. Each size runs in a fresh temporary directory (under
``--work``, default the system's); nothing is kept. ``--smoke``: 1 MB, 2 updates.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.data_scale import _stamp, run_measured

REPO = Path(__file__).resolve().parent.parent
RECIPE = "lm_tinyshakespeare_char_quick"
MODEL = ["model.d_model=64", "model.n_heads=4", "model.d_ff=256", "model.n_decoder_layers=2",
         "model.max_positions=256", "data.block_size=256", "data.batch_size=64", "train.eval_every=1000000",
         "train.save_every=1000000", "train.log_every=1", "train.warmup=10"]
VALID_CHARS = 100_000


def write_text(path: Path, size_mb: float) -> int:
    """tinyshakespeare repeated (its last copy cut at a line end) up to ``size_mb`` MB; the bytes written."""
    from aiayn.data.datasets import tinyshakespeare_text

    base = tinyshakespeare_text().encode("utf-8")
    target, written = int(size_mb * 1_000_000), 0
    with open(path, "wb") as f:
        while written < target:
            part = base[: target - written]
            if len(part) < len(base):
                part = part[: part.rfind(b"\n") + 1] or part
            f.write(part)
            written += len(part)
    return written


def measure(size_mb: float, updates: int, work: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    text = work / "corpus.txt"
    n_bytes = write_text(text, size_mb)
    write_s = time.perf_counter() - t0
    store = work / "store"
    sets = ["data.dataset=null", f"data.train_src={text}", f"data.valid_fraction={VALID_CHARS / n_bytes:.8f}",
            *MODEL]
    data = [x for s in sets for x in ("--set", s)]
    rc, prep_s, prep_rss, err = run_measured([sys.executable, "-m", "aiayn", "prepare", RECIPE, "--out", str(store),
                                              *data], env)
    if rc != 0:
        raise SystemExit(f"prepare failed:\n{err[-3000:]}")
    store_mb = sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) / 1e6
    started = time.time()
    rc, train_s, train_rss, err = run_measured(
        [sys.executable, "-m", "aiayn", "train", RECIPE, "--run-dir", str(work / "run"), "--no-progress", *data,
         "--set", f"data.prepared={store}", "--set", f"train.max_updates={updates}"], env)
    if rc != 0:
        raise SystemExit(f"train failed:\n{err[-3000:]}")
    lines = err.splitlines()
    built = next(_stamp(x) for x in lines if "aiayn.train: model:" in x)
    first = next(_stamp(x) for x in lines if re.search(r"aiayn.train: step 1/", x))
    manifest = json.loads((store / "manifest.json").read_text())
    return {"size_mb": round(n_bytes / 1e6, 1), "write_s": round(write_s, 1), "prepare_s": round(prep_s, 1),
            "prepare_mb_per_s": round(n_bytes / 1e6 / prep_s, 1), "prepare_peak_rss_mb": prep_rss,
            "store_mb": round(store_mb, 1), "train_tokens": manifest["splits"]["train"]["tokens"],
            "train_peak_rss_mb": train_rss, "start_to_first_update_s": round(first - started, 2),
            "model_to_first_update_s": round(first - built, 2), "train_s": round(train_s, 1)}


def markdown(result: dict[str, Any]) -> str:
    rows = ["| text (MB) | prepare (s) | MB/s | prepare peak RSS (MiB) | store (MB) | training peak RSS (MiB) | "
            "start -> first update (s) | model built -> first update (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        rows.append(f"| {r['size_mb']:,} | {r['prepare_s']:,} | {r['prepare_mb_per_s']} | {r['prepare_peak_rss_mb']:,} "
                    f"| {r['store_mb']:,} | {r['train_peak_rss_mb']:,} | {r['start_to_first_update_s']} | "
                    f"{r['model_to_first_update_s']} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lm_scale", description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 1000])
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--work", help="where the temporary directories go (a disk with room for 3x the largest size)")
    p.add_argument("--out-json")
    p.add_argument("--smoke", action="store_true", help="1 MB and 2 updates: does it run?")
    args = p.parse_args(argv)
    sizes, updates = ([1.0], 2) if args.smoke else (args.sizes_mb, args.updates)
    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory(dir=args.work) as tmp:
            rows.append(measure(size, updates, Path(tmp)))
        print(json.dumps(rows[-1]), flush=True)
    result = {"command": "python -m benchmarks.lm_scale " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cpus": os.cpu_count(), "rows": rows}
    print(markdown(result))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
