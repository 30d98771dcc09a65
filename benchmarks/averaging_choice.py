"""The averaging guard on cut quick starts: for each seed, train ``multi30k_en_de_quick`` for a few hundred updates
(a run cut early, as a busy machine's 30 minutes cut it), then score on a test set, with the recipe's decoding,
the last weights and the average the recipe asks for; the weights the training chose (model.safetensors) must
score at least ``max(last, average) - 0.2`` BLEU.

    python -m benchmarks.averaging_choice --out DIR [--seeds 1 2 3] [--updates 450] [--split test_2016_flickr]

Each seed's run is DIR/seed_N (kept: an existing one is not retrained; ``--rechoose`` makes its choice again with
this checkout's code, exactly as the training's end makes it: ``Trainer.write_inference_weights`` on its last
weights and checkpoints). Writes DIR/results.json and prints one JSON line per seed and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARGIN = 0.2  # BLEU: what the chosen weights may lose against the better of the two


def aiayn(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"aiayn {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stderr


def test_bleu(run: Path, split: str, weights: str) -> float:
    """The recipe's decoding of ``split`` by those weights of the run (its record, once written, is read again:
    the last weights and the average do not depend on the choice)."""
    record = run / "eval" / f"{split}.{weights}.json"
    if not record.is_file():
        aiayn("evaluate", str(run), "--split", split, "--weights", weights)
    return json.loads(record.read_text(encoding="utf-8"))["scores"]["bleu"]


def rechoose(run: Path) -> None:
    """The training's last step again on a finished run: the average or the last weights into model.safetensors."""
    import logging

    from aiayn.config import read_run_config
    from aiayn.data.pipeline import build_data
    from aiayn.model import build_model
    from aiayn.run.weights import checkpoint_paths, list_checkpoints, load_weights
    from aiayn.train.trainer import Trainer

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    cfg = read_run_config(run)
    data, _ = build_data(cfg, run)
    model = build_model(cfg.model, cfg.task)
    last = list_checkpoints(run)[-1]
    load_weights(model, checkpoint_paths(run, last)[0])  # the training's last weights are its last checkpoint's
    trainer = Trainer(cfg, model, data, run, progress=False)
    trainer.state.step = last
    trainer.write_inference_weights()


def one_seed(out: Path, seed: int, updates: int, split: str, again: bool) -> dict[str, Any]:
    from safetensors import safe_open

    run = out / f"seed_{seed}"
    log = ""
    if (run / "model.safetensors").is_file() and again:
        rechoose(run)
    if not (run / "model.safetensors").is_file():
        # max_minutes raised: the updates decide where the run is cut, whatever the machine's load
        log = aiayn("train", "multi30k_en_de_quick", "--run-dir", str(run), "--no-progress", "--set",
                    f"train.seed={seed}", "--set", f"train.max_updates={updates}", "--set", "train.max_minutes=600")
    with safe_open(str(run / "model.safetensors"), framework="pt") as f:
        source = (f.metadata() or {}).get("source", "")
    row = {"seed": seed, "updates": updates, "chosen": "average" if source.startswith("average") else "last",
           "why": source, "log": [line for line in log.splitlines() if "inference weights" in line][-1:]}
    row["last_bleu"] = test_bleu(run, split, "last")
    row["average_bleu"] = test_bleu(run, split, "average")
    row["chosen_bleu"] = row[f"{row['chosen']}_bleu"]
    row["ok"] = row["chosen_bleu"] >= max(row["last_bleu"], row["average_bleu"]) - MARGIN
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.averaging_choice", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--updates", type=int, default=450)
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--rechoose", action="store_true", help="an existing run: make its averaging choice again")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        rows.append(one_seed(args.out, seed, args.updates, args.split, args.rechoose))
        print(json.dumps(rows[-1]), flush=True)
    result = {"command": "python -m benchmarks.averaging_choice " + " ".join(argv or sys.argv[1:]),
              "split": args.split, "margin": MARGIN, "rows": rows, "ok": all(r["ok"] for r in rows)}
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"| seed | updates | chosen | last BLEU | average BLEU | chosen >= max - {MARGIN} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['updates']} | {r['chosen']} | {r['last_bleu']:.2f} | {r['average_bleu']:.2f} | "
              f"{'yes' if r['ok'] else 'no'} |")
    return result


if __name__ == "__main__":
    main()
