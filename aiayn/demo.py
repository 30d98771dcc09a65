"""``make demo`` / ``aiayn demo``: the main job, end to end.

Data (local or downloaded) -> shared BPE -> training with a progress bar -> checkpoint averaging ->
evaluation on test_2016_flickr -> example translations beside their references -> where the run is
and how to translate your own sentences with it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from aiayn.config import CONFIG_DIR, load_config
from aiayn.files import MARKER, guard_output_dir
from aiayn.run.weights import list_checkpoints

log = logging.getLogger("aiayn.demo")

DEFAULT_CONFIG = CONFIG_DIR / "multi30k_en_de_quick.yaml"
DEFAULT_RUN_DIR = Path("runs") / "demo"


def run_demo(args: argparse.Namespace) -> int:
    from aiayn.data.registry import dataset_of
    from aiayn.eval.evaluate import EvalData, evaluate_run, summary
    from aiayn.train.run import train

    config = Path(args.config) if args.config else DEFAULT_CONFIG
    run_dir = guard_output_dir(Path(args.run_dir or DEFAULT_RUN_DIR), [config] if config.exists() else [],
                               "--run-dir")
    cfg = load_config(config, args.set)
    if (run_dir / "model.safetensors").exists():
        print(f"{run_dir} already holds a trained model: evaluating it (delete the folder to train again)")
    else:
        # an unfinished run: resumed from its last checkpoint, or restarted if it had none yet (same config)
        resume = bool(list_checkpoints(run_dir)) or (run_dir / MARKER).exists()
        if resume:
            print(f"{run_dir} holds an unfinished run: resuming it")
        print(f"training {config.name} into {run_dir} (budget: {cfg.train.max_minutes or '-'} minutes, "
              f"{cfg.train.max_updates} updates at most)")
        train(cfg, run_dir, resume=resume, progress=True)
    split = (dataset_of(cfg).test_splits or ("test",))[0]  # Multi30k's first: test_2016_flickr
    result = evaluate_run(run_dir, EvalData(split=split))
    print()
    print(summary(result))
    _show_examples(run_dir, result, n=5)
    print()
    print(f"The run directory is {run_dir}. Translate your own sentences with:")
    print(f"  echo 'A man is riding a bicycle down the street.' | .venv/bin/aiayn translate {run_dir}")
    return 0


def _show_examples(run_dir: Path, result: dict, n: int) -> None:
    from aiayn.eval.evaluate import split_pairs

    cfg = load_config(run_dir / "config.yaml")
    pairs = split_pairs(cfg, result["name"])
    hyps = Path(result["json_path"]).with_suffix(".hyp").read_text(encoding="utf-8").splitlines()
    print()
    step = max(1, len(pairs) // n)
    for i in range(0, step * n, step):
        src, ref = pairs[i]
        print(f"[{i + 1}] source     {src}")
        print(f"    reference  {ref}")
        print(f"    aiayn      {hyps[i]}")
