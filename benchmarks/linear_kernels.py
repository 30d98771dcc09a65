"""The linear layers' kernels (aiayn.linear) on this CPU: PyTorch's F.linear, oneDNN prepacked fp32, int8.

    python -m benchmarks.linear_kernels [--threads 1] [--md BENCHMARKS.md] [--out-json PATH]

The shapes of the Multi30k quick recipe's decoder step (d_model 256, d_ff 1024, vocabulary 8,000) at a few row
counts (beam rows: 4 = one sentence at beam 4, 64, 256). Each kernel is timed on the same inputs, taking turns,
best of 5 rounds; the ratio is F.linear's time over the kernel's. ``aiayn.engine.prepare_model`` chooses oneDNN
for fp32 inference on a CPU because of this table (MKL, which F.linear calls, may run narrower vector code than
the CPU has, e.g. AVX2 on an AMD CPU with AVX-512). Each kernel's rate is given in GMAC/s (multiply-adds per
second) beside the rate of a large square product (1024 rows x 1024 x 1024) on the same kernels: how close to what
this CPU can do at all a layer's product runs.

A second table times a whole decoder step's products in turn, each with its own weight (19 MB in fp32: more than a
core's L2 cache, so read from L3 or memory, as in a real step), at 1 to 256 rows, and gives the rate at which each
kernel reads the weights beside the rate at which the core reads the same number of bytes (``torch.sum`` over them):
with few rows a product does little arithmetic per weight, and how fast its kernel streams the weights sets its time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from aiayn.engine import keep_freed_memory
from aiayn.linear import Int8Linear, PackedLinear, packed_available
from benchmarks import common

NAME = "linear_kernels"
SHAPES = [(768, 256, "self-attention Q|K|V"), (256, 256, "attention output"), (1024, 256, "FFN W1"),
          (256, 1024, "FFN W2"), (8000, 256, "output projection")]  # (N, K): weight (N, K)
ROWS = (4, 64, 256)
REFERENCE = (1024, 1024, 1024)  # (rows, N, K): a product large enough to run at the kernels' best rate
# One decoder step of the quick recipe (3 layers; the cross-attention keys/values are projected once per source):
# per layer Q|K|V, self-attention output, cross-attention query and output, FFN W1 and W2; then the output projection.
STEP = [(768, 256), (256, 256), (256, 256), (256, 256), (1024, 256), (256, 1024)] * 3 + [(8000, 256)]
STEP_ROWS = (1, 4, 16, 64, 256)
WEIGHT_BYTES = {"F.linear": 4, "oneDNN": 4, "int8": 1}  # bytes a kernel reads per weight element


def gmacs(rows: int, weight: Sequence[int], us: float) -> float:
    """Multiply-adds per second, in billions, of a (rows, K) x (K, N) product taking ``us`` microseconds."""
    return rows * weight[0] * weight[1] / us / 1e3


def best_us(fn: Callable[[], Any], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def read_gbs(n_floats: int, rounds: int) -> float:
    """GB/s at which one core reads ``n_floats`` fp32 values (``torch.sum``: memory-bound), best of ``rounds``."""
    x = torch.ones(n_floats)
    calls = max(3, int(2e9 // (4 * n_floats)))
    return 4 * n_floats / min(best_us(x.sum, calls) for _ in range(rounds)) / 1e3


def step_rows(kernels: dict[str, Callable], rounds: int) -> dict[str, Any]:
    """Each kernel's time for every product of one decoder step (:data:`STEP`), in turn, at :data:`STEP_ROWS` rows;
    the weights' read rates; the core's read rate of as many fp32 bytes."""
    weights = [(torch.randn(N, K) / K**0.5, torch.randn(N)) for N, K in STEP]
    elements = sum(N * K for N, K in STEP)
    out = []
    for M in STEP_ROWS:
        xs = {K: torch.randn(M, 1, K) for K in {K for _, K in STEP}}

        def step(kernel: Callable, xs: dict[int, torch.Tensor] = xs) -> None:
            for w, b in weights:
                kernel(xs[w.size(1)], w, b)

        calls = max(3, int(2e8 // (M * elements)))
        times = {name: float("inf") for name in kernels}
        for kernel in kernels.values():
            step(kernel)  # prepare the weights, build the kernels
        for _ in range(rounds):
            for name, kernel in kernels.items():
                times[name] = min(times[name], best_us(lambda k=kernel: step(k), calls))
        out.append({"rows": M, "us": times})
    return {"weights": STEP, "elements": elements, "read_gbs": read_gbs(elements, rounds), "rows": out}


def step_markdown(step: dict[str, Any], names: Sequence[str]) -> str:
    """The whole-step table: per kernel ms per step and GB/s of weights read."""
    n = step["elements"]
    table = [[r["rows"]] + [f"{r['us'][k] / 1e3:.2f}" for k in names]
             + [f"{WEIGHT_BYTES[k] * n / r['us'][k] / 1e3:.0f}" for k in names] for r in step["rows"]]
    return "\n".join([
        f"One decoder step's {len(step['weights'])} products in turn, each with its own weight "
        f"({4 * n / 2**20:.0f} MiB in fp32, {n / 2**20:.0f} MiB in int8): milliseconds per step, and the rate at "
        f"which each kernel reads the weights. This core reads as many fp32 bytes at {step['read_gbs']:.0f} GB/s "
        "(`torch.sum`): a kernel that read its weights at that rate would be bound by memory alone.\n",
        common.markdown_table(["rows"] + [f"{k} (ms)" for k in names] + [f"{k} weights GB/s" for k in names], table),
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per core)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--md", default=str(common.DEFAULT_MD), help="markdown file whose section is rewritten")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    args = p.parse_args(argv)
    threads = common.set_threads(args.threads)
    keep_freed_memory()  # as aiayn's commands do: a large output is not fresh pages from the OS on every call
    kernels = {"F.linear": F.linear, "int8": Int8Linear()}
    if packed_available():
        kernels["oneDNN"] = PackedLinear()
    rows_out = []
    torch.manual_seed(0)
    cases = [(N, K, what, M) for N, K, what in SHAPES for M in ROWS]
    cases.append((REFERENCE[1], REFERENCE[2], "reference: a large square product", REFERENCE[0]))
    with torch.inference_mode():
        for N, K, what, M in cases:
            w, b = torch.randn(N, K) / K**0.5, torch.randn(N)
            x = torch.randn(M, 1, K)
            calls = max(3, int(2e8 // (M * N * K)))
            times = {name: float("inf") for name in kernels}
            for kernel in kernels.values():
                kernel(x, w, b)  # prepare the weight, build the kernel
            for _ in range(args.rounds):  # taking turns
                for name, kernel in kernels.items():
                    times[name] = min(times[name], best_us(lambda k=kernel, x=x, w=w, b=b: k(x, w, b), calls))
            rows_out.append({"weight": [N, K], "what": what, "rows": M, "us": times})
        step = step_rows(kernels, args.rounds)
    result = {"benchmark": NAME, "date": common.utc_now(), "command": common.command_line(NAME, argv),
              "machine": {**common.machine_info(threads), "cpu_capability": torch.backends.cpu.get_cpu_capability()},
              "results": rows_out, "step": step}
    names = [n for n in ("oneDNN", "int8") if n in kernels]
    table = [[r["what"], f"{r['weight'][0]}x{r['weight'][1]}", r["rows"], f"{r['us']['F.linear']:.0f}"]
             + [f"{r['us'][n]:.0f} ({r['us']['F.linear'] / r['us'][n]:.1f}x)" for n in names]
             + [f"{gmacs(r['rows'], r['weight'], r['us'][n]):.0f}" for n in ("F.linear", *names)] for r in rows_out]
    md = "\n".join([
        "## Linear layers on the CPU: F.linear, oneDNN prepacked, int8\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- PyTorch CPU capability: {result['machine']['cpu_capability']}. Microseconds per call, best of "
        f"{args.rounds} rounds taking turns; in brackets F.linear's time over the kernel's. int8 includes "
        "quantizing the input rows and scaling the int32 sums back (aiayn/linear.py). GMAC/s: billions of "
        "multiply-adds per second; the last row, a large square product, is about the best rate each kernel "
        "reaches on this CPU.\n",
        common.markdown_table(["layer", "weight", "rows", "F.linear (us)"] + [f"{n} (us)" for n in names]
                              + [f"{n} GMAC/s" for n in ("F.linear", *names)], table),
        "",
        step_markdown(step, ("F.linear", *names)),
    ]) + "\n"
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    common.update_section(args.md, NAME, md)
    print(md)
    return result


if __name__ == "__main__":
    main()
