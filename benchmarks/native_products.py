"""The native search's products against the CPU's peak, per kind, on one thread (issue 69).

    python -m benchmarks.native_products
    python -m benchmarks.native_products --rows 4 32 --d-model 512 --d-ff 2048 --vocab 37000   # paper-base's shapes
    python -m benchmarks.native_products --smoke --md /tmp/B.md --out-json /tmp/p.json

How far can a faster kernel take the native beam search? Its time goes to the decoder's products (the layers' linear
maps and the output projection over the vocabulary); each kind runs on one unit of the CPU: fp32 on its FMA, bf16 on
its AVX512-BF16 dot product (else widened to fp32), int8 on its AVX512-VNNI dot product (else fp32). For each kind:
the unit's peak, one thread's multiply-adds per second of 16 independent instructions in a loop (12 fp32 on AVX2)
(``native.module().peak_macs``), and the products of a decoder step at each shape (``rows`` = sentences x beam,
the quick recipe's widths by default), each the fastest of ``--repeats`` timings of ``--calls`` calls in the module:
microseconds, multiply-adds per second, and their share of the peak. A share near 100% leaves only fewer
multiply-adds or a unit that does more of them per instruction (int8's does twice bf16's, bf16's twice fp32's).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch

from aiayn.search import native
from benchmarks import common

NAME = "native_products"
KINDS = {"fp32": 0, "bf16": 1, "int8": 2}  # native.cpp's Kind


def unit(kind: str, module: Any) -> str:
    """The CPU unit a kind's products run on in this build."""
    if kind == "bf16" and module.dpbf16:
        return "AVX512-BF16 dot product"
    if kind == "int8" and module.vnni:
        return "AVX512-VNNI dot product"
    return "fp32 FMA" + (" (weights widened)" if kind != "fp32" else "")


def step_shapes(d_model: int, d_ff: int, vocab: int) -> dict[str, tuple[int, int]]:
    """A decoder layer's products and the output projection: name -> (in features K, out features N)."""
    return {"self-attention in (q, k, v)": (d_model, 3 * d_model), "attention output": (d_model, d_model),
            "FFN in": (d_model, d_ff), "FFN out": (d_ff, d_model), "output projection": (d_model, vocab)}


def time_linear(lin: Any, x: torch.Tensor, calls: int, repeats: int) -> float:
    """Seconds per call, the fastest of ``repeats`` timings of ``calls`` calls (timed in the module, no Python between
    calls)."""
    lin.seconds(x, 1)  # warm
    return min(lin.seconds(x, calls) for _ in range(repeats))


def measure(args: argparse.Namespace, module: Any) -> dict[str, Any]:
    """Per kind: the unit, its peak and each (rows, product)'s speed."""
    out: dict[str, Any] = {}
    shapes = step_shapes(args.d_model, args.d_ff, args.vocab)
    for kind in args.kinds:
        peak = max(module.peak_macs(KINDS[kind], args.peak_iters) for _ in range(args.repeats))
        rows_out: list[dict[str, Any]] = []
        for rows in args.rows:
            total_macs = total_s = 0.0
            for name, (k, n) in shapes.items():
                g = torch.Generator().manual_seed(k * 7 + n)
                w, b = torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
                x = torch.randn(rows, k, generator=g)
                seconds = time_linear(module.Linear(w, b, KINDS[kind]), x, args.calls, args.repeats)
                macs = rows * k * n
                total_macs, total_s = total_macs + macs, total_s + seconds
                rows_out.append({"rows": rows, "product": name, "k": k, "n": n, "us": round(seconds * 1e6, 1),
                                 "gmacs": round(macs / seconds / 1e9, 1), "of_peak": round(macs / seconds / peak, 3)})
            rows_out.append({"rows": rows, "product": "a step's products", "k": None, "n": None,
                             "us": round(total_s * 1e6, 1), "gmacs": round(total_macs / total_s / 1e9, 1),
                             "of_peak": round(total_macs / total_s / peak, 3)})
        out[kind] = {"unit": unit(kind, module), "peak_gmacs": round(peak / 1e9, 1), "products": rows_out}
        print(f"[{NAME}] {kind}: peak {peak / 1e9:.1f} GMAC/s; a step's products at {args.rows} rows: "
              f"{[r['of_peak'] for r in rows_out if r['k'] is None]} of it", file=sys.stderr)
    return out


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = ["## The native search's products against the CPU's peak, one thread (issue 69)\n",
             common.provenance(result["machine"], result["command"], result["date"]),
             f"- Shapes: a decoder layer's products and the output projection at d_model {a['d_model']}, d_ff "
             f"{a['d_ff']}, vocabulary {a['vocab']}; rows = sentences x beam; each the fastest of {a['repeats']} "
             f"timings of {a['calls']} calls. Peak: one thread's multiply-adds per second of 16 independent "
             "instructions of the kind's unit in a loop (12 fp32 on AVX2).\n"]
    rows = []
    for kind, r in result["kinds"].items():
        for p in r["products"]:
            shape = f"{p['k']} -> {p['n']}" if p["k"] is not None else "all"
            rows.append([kind, r["unit"], f"{r['peak_gmacs']:.1f}", p["rows"], p["product"], shape, f"{p['us']:.1f}",
                         f"{p['gmacs']:.1f}", f"{100 * p['of_peak']:.0f}%"])
    lines.append(common.markdown_table(["kind", "unit", "peak GMAC/s", "rows", "product", "in -> out", "us",
                                        "GMAC/s", "of peak"], rows))
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--rows", type=int, nargs="+", default=[4, 32], help="rows of a step: sentences x beam")
    p.add_argument("--d-model", type=int, default=256, help="default: the quick recipe's")
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-iters", type=int, default=20_000_000, help="rounds of the peak's loop (~0.1-0.3 s)")
    p.add_argument("--smoke", action="store_true", help="a second or so (CI)")
    p.add_argument("--md", default=str(common.DEFAULT_MD), help="markdown file whose section is rewritten")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    args = p.parse_args(argv)
    sizes = {"--rows": min(args.rows), "--d-model": args.d_model, "--d-ff": args.d_ff, "--vocab": args.vocab,
             "--calls": args.calls, "--repeats": args.repeats, "--peak-iters": args.peak_iters}
    bad = next((f"{flag} {value}" for flag, value in sizes.items() if value < 1), None)
    if bad:
        p.error(f"{bad}: expected a whole number >= 1")
    common.check_outputs(p, args.md, args.out_json)
    if args.smoke:
        args.rows, args.d_model, args.d_ff, args.vocab = [4], 64, 128, 500
        args.calls, args.repeats, args.peak_iters = 5, 1, 100_000
    return args


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    module = native.module()
    if module is None:
        raise SystemExit(f"{NAME}: no native search here ({native.why_not()})")
    threads = common.set_threads(1)
    result: dict[str, Any] = {"benchmark": NAME, "date": common.utc_now(),
                              "command": command or common.command_line(NAME, argv),
                              "machine": common.machine_info(threads),
                              "args": {k: v for k, v in vars(args).items() if k not in ("md", "out_json")},
                              "kinds": measure(args, module)}
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    common.update_section(args.md, NAME, markdown(result))
    return result


if __name__ == "__main__":
    main()
