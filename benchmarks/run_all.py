"""Run the three comparisons one after the other, on one machine, into one BENCHMARKS.md.

    python -m benchmarks.run_all                     # the real numbers (about 15 minutes on 2 cores)
    python -m benchmarks.run_all --smoke --md /tmp/B.md --json-dir /tmp/results   # seconds (CI)

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
    p.add_argument("--md", help="markdown file to update (default: BENCHMARKS.md)")
    p.add_argument("--json-dir", help="where <benchmark>.json go (default: benchmarks/results)")
    return p.parse_args(argv)


def sub_argv(name: str, args: argparse.Namespace) -> list[str]:
    """The command-line arguments of one benchmark."""
    # Defaults are left out, so that the commands written into BENCHMARKS.md read as one would type them.
    out = ["--md", args.md] if args.md else []
    if args.json_dir:
        out += ["--out-json", str(Path(args.json_dir) / f"{name}.json")]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.smoke:
        out.append("--smoke")
    has_run = (Path(args.run_dir) / "tokenizer").is_dir()
    if name == "translate_speed":
        if not args.smoke:
            out += ["--run-dir", args.run_dir]
    elif has_run and not args.smoke:
        out += ["--run-dir", args.run_dir]
    if name == "train_throughput" and not args.isolate:
        out.append("--no-isolate")
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
