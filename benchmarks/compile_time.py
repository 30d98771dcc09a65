"""torch.compile's cold-start cost for training: the whole model against aiayn's compilation by regions.

    python -m benchmarks.compile_time                                  # 6 + 6 layers, d_model 64, on the CPU
    python -m benchmarks.compile_time --device cuda --preset paper-base --precision bf16

Each way runs in its own process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``): four training steps
(forward, compiled loss, backward) on batches of three shapes, the first shape again last. Prints, per way, the
seconds to the end of each step (the first includes the compilation), the graphs dynamo captured and its graph
breaks. Nothing is written.
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

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(8, 21, 23), (6, 31, 29), (10, 13, 15), (8, 21, 23)]  # (batch, source, target): lengths unlike widths


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="a model preset (default: 6 + 6 layers, d_model 64, vocab 300)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--ways", nargs="+", default=["regions", "whole"], choices=["regions", "whole"])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(list(argv))


def child(args: argparse.Namespace) -> dict:
    """One way, in this process: the steps' cumulative seconds, graphs and breaks."""
    import torch
    from torch._dynamo.utils import counters

    from aiayn import build_model, model_config
    from aiayn.config import Config, TrainConfig
    from aiayn.data.batching import collate
    from aiayn.device import autocast_context
    from aiayn.train.update import batch_logits, batch_to_device, compile_for_training

    torch.manual_seed(0)
    cfg = (model_config(args.preset) if args.preset else
           model_config("tiny", vocab_size=300, d_model=64, n_heads=4, d_ff=128, n_encoder_layers=6,
                        n_decoder_layers=6, dropout=0.1, max_positions=128))
    device = torch.device(args.device)
    model = build_model(cfg).to(device).train()
    config = Config(model=cfg, train=TrainConfig(compile=True))
    if args.child == "whole":
        from aiayn.train.loss import compiled_loss

        module, loss_fn = torch.compile(model, dynamic=True), compiled_loss(dynamic=True)
    else:
        module, loss_fn = compile_for_training(model, config)
    g = torch.Generator().manual_seed(1)
    times = []
    t0 = time.perf_counter()
    for n, s, t in SHAPES:
        ids = lambda k, n=n: [torch.randint(4, cfg.vocab_size, (k,), generator=g).tolist() for _ in range(n)]  # noqa: E731
        batch = batch_to_device(collate(ids(s), ids(t), list(range(n))), device)
        with autocast_context(args.precision, device):
            logits = batch_logits(module, batch)
        loss_fn(logits, batch.tgt_out, 0.1, 0)[0].backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t0, 1))
    return {"way": args.child, "step_end_s": times, "graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return []
    results = []
    for way in args.ways:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(REPO)}
            out = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", *argv, "--child", way],
                                 capture_output=True, text=True, env=env, cwd=REPO, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    main()
