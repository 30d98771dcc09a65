"""Run the three comparisons one after the other, on one machine, into one BENCHMARKS.md.

    python -m benchmarks.run_all                     # the real numbers (about 15 minutes on 2 cores)
    python -m benchmarks.run_all --gpu               # the GPU comparison: bf16, paper-base and paper-big
    python -m benchmarks.run_all --smoke --md /tmp/B.md --json-dir /tmp/results   # seconds (CI)

``--gpu`` (= ``--device cuda --precision bf16`` with the GPU preset) runs the two training benchmarks on
one CUDA GPU: aiayn eager and compiled, HF Marian and torch.nn.Transformer, paper-base and paper-big, on
synthetic pairs with WMT14-like and Multi30k lengths in 25,000-token batches (padded to multiples of 8),
with torch.profiler's top kernels; translation speed is a CPU benchmark and is left out.

``--run-dir`` names the trained translation run: benchmark 2 translates with it, and benchmarks 1
and 3 take their training batches from Multi30k train tokenized with its tokenizer (without one,
synthetic pairs with Multi30k's lengths). Each benchmark rewrites its own section of the markdown
file with the standalone command that reproduces it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import common, mfu, train_throughput, translate_speed

BENCHMARKS = {"train_throughput": train_throughput, "translate_speed": translate_speed, "mfu": mfu}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/multi30k_en_de_quick", help="a trained translation run")
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per core)")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="training benchmark: all implementations in one process (memory not comparable)")
    p.add_argument("--smoke", action="store_true", help="seconds-long versions of every benchmark (CI)")
    p.add_argument("--gpu", action="store_true", help="the GPU comparison (--device cuda --precision bf16 + preset)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (training benchmarks)")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="training benchmarks' autocast precision (default: fp32; bf16 with --gpu)")
    p.add_argument("--md", help="markdown file to update (default: BENCHMARKS.md)")
    p.add_argument("--json-dir", help="where <benchmark>.json go (default: benchmarks/results)")
    args = p.parse_args(argv)
    if args.gpu:
        args.device = "cuda" if args.device == "cpu" else args.device
        args.precision = args.precision or "bf16"
    args.precision = args.precision or "fp32"
    if args.device != "cpu" and "translate_speed" in args.only:
        args.only = [b for b in args.only if b != "translate_speed"]  # a CPU benchmark
    return args


# The GPU comparison of issue 20 (what --gpu adds to each training benchmark's command line).
GPU_PRESET = {
    "train_throughput": ["--configs", "paper-base", "paper-big", "--impls", "aiayn", "aiayn-compile", "hf-marian",
                         "torch-nn", "--lengths", "wmt", "multi30k", "--warmup", "5", "--steps", "20",
                         "--profile", "benchmarks/results/profile_train_throughput_cuda.txt"],
    "mfu": ["--configs", "paper-base", "paper-big", "--lengths", "wmt", "multi30k", "--compile", "--warmup", "5",
            "--steps", "20", "--profile", "benchmarks/results/profile_mfu_cuda.txt"],
}


def sub_argv(name: str, args: argparse.Namespace) -> list[str]:
    """The command-line arguments of one benchmark."""
    # Defaults are left out, so that the commands written into BENCHMARKS.md read as one would type them.
    out = ["--md", args.md] if args.md else []
    kind = args.device.split(":")[0] if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.json_dir:
        out += ["--out-json", str(Path(args.json_dir) / (f"{name}_{kind}.json" if kind != "cpu" else f"{name}.json"))]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.smoke:
        out.append("--smoke")
    has_run = (Path(args.run_dir) / "tokenizer").is_dir()
    if name == "translate_speed":
        if not args.smoke:
            out += ["--run-dir", args.run_dir]
    elif has_run and not args.smoke and not args.gpu:  # the GPU preset measures synthetic lengths
        out += ["--run-dir", args.run_dir]
    if name == "train_throughput" and not args.isolate:
        out.append("--no-isolate")
    if name in GPU_PRESET and (args.device != "cpu" or args.precision != "fp32"):
        out += ["--device", args.device, "--precision", args.precision]
        if args.gpu and not args.smoke:
            out += GPU_PRESET[name]
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    results = {}
    for name in args.only:
        sub = sub_argv(name, args)
        print(f"[run_all] python -m benchmarks.{name} {' '.join(sub)}", file=sys.stderr, flush=True)
        results[name] = BENCHMARKS[name].main(sub)
    print(f"[run_all] wrote {args.md or common.DEFAULT_MD} and {args.json_dir or common.RESULTS_DIR}/",
          file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
