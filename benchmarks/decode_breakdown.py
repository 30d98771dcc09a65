"""Where a CPU beam search's time goes, and how many rows each stopping rule decodes (issue 60).

    python -m benchmarks.decode_breakdown --run-dir runs/m30k_long --limit 300 --threads 1
    python -m benchmarks.decode_breakdown --smoke --md /tmp/B.md --out-json /tmp/d.json

The Python beam search (a batch of a few sentences would otherwise take the native loop of :mod:`aiayn.search.native`,
which has none of the timed functions); the same run, sources, length-sorted batches of 64 and search as
``benchmarks.translate_speed`` (beam 4, power
length penalty alpha 0.6), in one process, one engine at a time:

* rows: the decoder rows (sentences x beams, summed over steps) each stopping rule decodes, under the fixed
  100-step limit of translate_speed's section 2 and under ``aiayn translate``'s source + 50, and whether the exact
  rule's outputs are the same under both (they are whenever no sentence reaches its limit);
* time: the seconds of one pass of the exact search (fp32, and int8), batched and batch-1 (the first
  ``--batch1-limit`` sentences), split by what runs them: the linear layers (encoder's included), attention (eq. 1),
  the cache's beam reorder, the log-softmax, the candidates' top-k, and the rest (the search's bookkeeping, layer
  norms, embeddings, Python); and the milliseconds per output token. Timing a function costs a few microseconds a
  call, so the parts sum to a little more than a pass without them; compare parts, not totals, with translate_speed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import aiayn.model.attention as attention
import aiayn.search.beam as beam
import aiayn.search.native as native
from aiayn.engine import keep_freed_memory
from aiayn.linear import Bf16Linear, Int8Bf16Linear, Int8Linear, PackedLinear
from aiayn.model.cache import KVCache
from aiayn.model.transformer import Transformer
from benchmarks import common
from benchmarks import translate_speed as ts

NAME = "decode_breakdown"
LIMITS = {"fixed 100": ts.Limit(0.0, 100), "source + 50": ts.Limit(1.0, 50)}
# What is timed: a label and (owner, attribute) of each function wrapped while a pass runs.
PARTS: dict[str, list[tuple[Any, str]]] = {
    "linear": [(PackedLinear, "__call__"), (Bf16Linear, "__call__"), (Int8Linear, "__call__"),
               (Int8Bf16Linear, "__call__")],
    "attention": [(attention, "scaled_dot_product_attention")],
    "reorder": [(KVCache, "reorder")],
    "log_softmax": [(beam.F, "log_softmax")],
    "candidates": [(beam, "_candidates")],
}


@contextlib.contextmanager
def _python_search() -> Iterator[None]:
    """The Python beam search for every batch (what the parts time: a batch-1 pass would otherwise take the native
    loop, aiayn.search.native, which has none of these functions)."""
    with wrapped(native, "chosen", lambda _: lambda *a: False):
        yield


@contextlib.contextmanager
def wrapped(owner: Any, attr: str, wrapper: Callable[[Callable], Callable]) -> Iterator[None]:
    """``owner.attr`` replaced by ``wrapper(owner.attr)`` inside the block, put back after."""
    original = getattr(owner, attr)
    setattr(owner, attr, wrapper(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


def timer(acc: dict[str, float], name: str) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        return timed
    return wrap


def counted_rows(task: ts.Task, batches: list[list[int]], stop: str, limit: ts.Limit) -> tuple[int, list[list[int]]]:
    """The decoder rows one pass of ``stop`` decodes on ``batches``, and its outputs."""
    rows = [0]

    def count(fn: Callable) -> Callable:
        def decode(self: Transformer, tgt: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            rows[0] += tgt.size(0)
            return fn(self, tgt, *args, **kwargs)
        return decode

    fn = ts.aiayn_engine(task.model, 0.6, limit, stop, torch.device("cpu"))
    with wrapped(Transformer, "decode", count):
        outputs, _ = ts.run_mode(fn, task.sources, batches, 0)
    return rows[0], outputs


def time_split(fn: Callable, task: ts.Task, batches: list[list[int]], warm: int) -> dict[str, float]:
    """Seconds of one pass of ``fn`` on ``batches`` after ``warm`` warm-up batches, by part (:data:`PARTS`)."""
    ts.run_mode(fn, task.sources, batches[:warm], 0)
    acc: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        for name, places in PARTS.items():
            for owner, attr in places:
                stack.enter_context(wrapped(owner, attr, timer(acc, name)))
        outputs, seconds = ts.run_mode(fn, task.sources, batches, 0)
    out = {k: round(acc.get(k, 0.0), 4) for k in PARTS}
    out["rest"] = round(seconds - sum(out.values()), 4)
    out["total"] = round(seconds, 4)
    out["ms_per_output_token"] = round(1e3 * seconds / sum(len(outputs[i]) + 1 for b in batches for i in b), 3)
    return out


def unavailable(precision: str) -> str:
    """Why ``precision`` cannot run on this CPU ("" if it can): bf16 needs the probe's pass (aiayn.cpu_probe)."""
    if precision != "bf16":
        return ""
    from aiayn.cpu_probe import cpu_bf16

    found = cpu_bf16()
    return "" if found.native else found.why


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/multi30k_en_de_quick", help="a trained translation run")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--limit", type=int, default=300, help="translate the first N sentences only")
    p.add_argument("--batch1-limit", type=int, default=100, help="batch-1 translates the first N sentences")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="passes of the exact search (aiayn translate's kernels for each); bf16 where this CPU's "
                        "probe passes (aiayn.cpu_probe), else left out with the reason (int8 runs in the fp32 pass)")
    p.add_argument("--smoke", action="store_true", help="seconds-long run on a random tiny model (CI)")
    p.add_argument("--md", default=str(common.DEFAULT_MD), help="markdown file whose section is rewritten")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    args = p.parse_args(argv)
    args.run_dir_given = ts.run_dir_given(argv)
    if args.smoke:
        args.limit, args.batch1_limit = 8, 3
    return args


def markdown(result: dict[str, Any]) -> str:
    lines = ["## Where a CPU beam search's time goes (issue 60)\n",
             common.provenance(result["machine"], result["command"], result["date"]),
             f"- Task: {result['task']}; beam 4, power length penalty 0.6, batches of 64 sorted by length.\n",
             "Decoder rows (sentences x beams, over all steps) each stopping rule decodes:\n"]
    rows = result["rows"]
    lines.append(common.markdown_table(["stop", *LIMITS], [[stop, *[f"{rows[lim][stop]:,}" for lim in LIMITS]]
                                                           for stop in ("first", "hf", "exact")]))
    lines.append(f"\nThe exact rule's outputs are the same under both limits: {result['exact_same_under_both']}.\n")
    lines.append("Seconds of one pass of the exact search, by part (limit: fixed 100 steps):\n")
    parts = [*PARTS, "rest", "total", "ms_per_output_token"]
    lines.append(common.markdown_table(["pass", *parts], [[key, *[r[p] for p in parts]]
                                                         for key, r in result["time"].items()]))
    if "int8_kind" in result:
        lines.append(f"\naiayn-int8 ran `{result['int8_kind']}`.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    keep_freed_memory()  # as the aiayn command and translate_speed do
    threads = common.set_threads(args.threads)
    result: dict[str, Any] = {"benchmark": NAME, "date": common.utc_now(),
                              "command": command or common.command_line(NAME, argv),
                              "machine": common.machine_info(threads), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp, _python_search():
        task = ts.load_task(args, Path(tmp), [])
        result["task"] = task.description
        order = ts.by_length(task)
        batched = [order[k: k + 64] for k in range(0, len(order), 64)]
        one = [[i] for i in range(min(args.batch1_limit, len(task.sources)))]
        result["rows"], exact_outputs = {}, {}
        for name, limit in LIMITS.items():
            result["rows"][name] = {}
            for stop in ("first", "hf", "exact"):
                result["rows"][name][stop], outputs = counted_rows(task, batched, stop, limit)
                if stop == "exact":
                    exact_outputs[name] = outputs
        result["exact_same_under_both"] = len({repr(o) for o in exact_outputs.values()}) == 1
        result["time"] = {}
        for precision in args.precision:
            why_not = unavailable(precision)
            if why_not:
                result[f"{precision}_not_run"] = why_not
                print(f"[{NAME}] {precision}: not run ({why_not})", file=sys.stderr)
                continue
            engines = ["aiayn-exact", "aiayn-int8"] if precision == "fp32" else ["aiayn-exact"]
            fns, checks = ts.build_engines(task, engines, 0.6, LIMITS["fixed 100"], threads, order[-8:],
                                           precision=precision)
            if "aiayn-int8_kind" in checks:
                result["int8_kind"] = checks["aiayn-int8_kind"]
            for e in fns:
                label = "aiayn-int8" if e == "aiayn-int8" else f"{e} {precision}"
                for mode, batches, warm in (("batched", batched, 2), ("batch-1", one, 16)):
                    result["time"][f"{label} {mode}"] = time_split(fns[e], task, batches, warm)
    for key, r in result["time"].items():
        print(f"[{NAME}] {key}: {r}", file=sys.stderr)
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    common.update_section(args.md, NAME, markdown(result))
    return result


if __name__ == "__main__":
    main()
