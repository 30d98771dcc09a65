"""The native beam search against the PyTorch one, by batch size and precision, in one process (issue 69).

    python -m benchmarks.native_search --run-dir runs/quick_700_amd --limit 128 --sizes 1 2 4 8 16 32 64
    python -m benchmarks.native_search --smoke --md /tmp/B.md --out-json /tmp/n.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m benchmarks.native_search --arch x86-64-v3 \
        --precisions fp32 int8   # as on a CPU with AVX2 and no AVX-512: both searches held to it

The same run, sources and search as ``benchmarks.translate_speed`` (beam 4, power length penalty 0.6, stop=exact, at
most 100 steps); the sources sorted by length and cut into batches of each size; for each precision (the linear
kernel ``aiayn translate --precision P`` runs on this CPU) and size, one pass of each search on the same batches,
taking turns, each its fastest of ``--repeats``: sentences per second, native / PyTorch, and how many outputs are the
same token for token. What the choice between the two searches is made from.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from aiayn.data.tokenizer import SpecialIds
from aiayn.engine import inference_linear_kind, keep_freed_memory
from aiayn.linear import use_linear
from aiayn.search import beam, native
from aiayn.search.spec import SearchSpec
from benchmarks import common
from benchmarks import translate_speed as ts
from benchmarks.decode_breakdown import unavailable

NAME = "native_search"


def searches(spec: SearchSpec) -> dict[str, Callable[[torch.nn.Module, torch.Tensor], list[list[int]]]]:
    """Each search: model, padded sources (B, S) -> each sentence's best tokens."""
    def pytorch(model: torch.nn.Module, src: torch.Tensor) -> list[list[int]]:
        return [h[0].tokens for h in beam._search(model, src, src != ts.PAD, spec)]

    def native_(model: torch.nn.Module, src: torch.Tensor) -> list[list[int]]:
        return [h[0].tokens for h in native.beam_search(model, src, src != ts.PAD, spec)]

    def one_group(model: torch.nn.Module, src: torch.Tensor) -> list[list[int]]:  # every step on all the threads
        return [h[0].tokens for h in native.beam_search(model, src, src != ts.PAD, spec, groups=1)]

    return {"pytorch": pytorch, "native": native_, "native_one_group": one_group}


def one_pass(fn: Callable, model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = [toks for src in batches for toks in fn(model, src)]
    return time.perf_counter() - t0, out


def measure(task: ts.Task, sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    """Per batch size: each search's fastest pass (sentences/s), native / PyTorch, outputs the same."""
    spec = SearchSpec.of(SpecialIds(pad=ts.PAD, bos=ts.BOS, eos=ts.EOS, decoder_start=ts.BOS), beam=4, alpha=0.6,
                         length_penalty="power", max_len_a=0.0, max_len_b=100, stop="exact")
    order = ts.by_length(task)
    fns, out = searches(spec), {}
    for size in sizes:
        batches = [ts.pad_batch([task.sources[i] + [ts.EOS] for i in order[k: k + size]], ts.PAD)
                   for k in range(0, len(order), size)]
        for fn in fns.values():
            one_pass(fn, task.model, batches[:1])  # warm-up (the native module built, weights prepared)
        best = {name: float("inf") for name in fns}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(repeats):
            for name, fn in fns.items():
                seconds, outputs[name] = one_pass(fn, task.model, batches)
                best[name] = min(best[name], seconds)
        n = len(order)
        out[str(size)] = {"pytorch_sentences_per_s": round(n / best["pytorch"], 2),
                          "native_sentences_per_s": round(n / best["native"], 2),
                          "ratio": round(best["pytorch"] / best["native"], 3),
                          "native_one_group_sentences_per_s": round(n / best["native_one_group"], 2),
                          "groups": native.module().group_count(size, spec.options.beam, torch.get_num_threads()),
                          "same": sum(a == b for a, b in zip(outputs["pytorch"], outputs["native"])), "of": n,
                          "groups_same": outputs["native"] == outputs["native_one_group"]}
        print(f"[{NAME}] {size} sentences a batch: {out[str(size)]}", file=sys.stderr)
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = ["## The native beam search against the PyTorch search, by batch size (issue 69)\n",
             common.provenance(result["machine"], result["command"], result["date"]),
             f"- Task: {result['task']}; beam 4, power length penalty 0.6, stop=exact, at most 100 steps; the "
             f"sources sorted by length, in batches of each size; each search's fastest of {result['repeats']} "
             "passes, taking turns, in one process"
             + (f"; {result['args']['busy']} other process(es) spinning on a core each meanwhile" if
                result["args"].get("busy") else "") + ".\n"]
    rows = [[precision, size, f"{r['pytorch_sentences_per_s']:.1f}", f"{r['native_sentences_per_s']:.1f}",
             f"{r['ratio']:.2f}x", f"{r['same']} / {r['of']}", r["groups"],
             f"{r['native_one_group_sentences_per_s']:.1f}",
             f"{r['native_sentences_per_s'] / r['native_one_group_sentences_per_s']:.2f}x"]
            for precision, by_size in result["precisions"].items() for size, r in by_size.items()]
    lines.append(common.markdown_table(["precision", "sentences a batch", "PyTorch sentences/s", "native sentences/s",
                                        "native / PyTorch", "same outputs", "native: groups (a thread each)",
                                        "native, one group on every thread: sentences/s", "groups / one group"],
                                       rows))
    lines.append("\n- Groups: with T threads and at least 2T sentences the native search splits them into T groups, "
                 "each searched by one thread (no step waits for another thread); \"one group\": every step's "
                 "loops split over the threads instead. Both give the same outputs"
                 + ("" if all(r["groups_same"] for by_size in result["precisions"].values()
                              for r in by_size.values()) else " (NOT in this run)") + ".")
    for precision, why in result.get("not_run", {}).items():
        lines.append(f"\n- {precision}: not run ({why}).")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/multi30k_en_de_quick", help="a trained translation run")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--limit", type=int, default=128, help="the first N sentences")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "int8"], choices=["fp32", "bf16", "int8"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--busy", type=int, default=0, help="processes that keep a core busy while the searches run (a "
                   "server's other work, another program): how a search's threads fare beside a neighbour")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arch", default=None, help="the native module built for -march=ARCH instead of this CPU "
                   "(x86-64-v3: AVX2, no AVX-512; with ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA for PyTorch's)")
    p.add_argument("--smoke", action="store_true", help="seconds-long run on a random tiny model (CI)")
    p.add_argument("--md", default=str(common.DEFAULT_MD), help="markdown file whose section is rewritten")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    args = p.parse_args(argv)
    common.check_outputs(p, args.md, args.out_json)
    args.run_dir_given = ts.run_dir_given(argv)
    args.batch_size = 64  # translate_speed's task loader reads it
    if args.smoke:
        args.limit, args.sizes, args.repeats = 6, [1, 4], 1
    return args


@contextlib.contextmanager
def busy_neighbours(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` processes that spin on a core each until the block ends (yields them)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    keep_freed_memory()
    threads = common.set_threads(args.threads)
    if args.arch:  # the search takes this build instead of the one for this CPU
        built = native.build(args.arch)
        native.module = lambda: built
    if native.module() is None:
        raise SystemExit(f"{NAME}: no native search here ({native.why_not()})")
    result: dict[str, Any] = {"benchmark": NAME, "date": common.utc_now(), "repeats": args.repeats,
                              "command": command or common.command_line(NAME, argv),
                              "machine": common.machine_info(threads), "args": vars(args), "precisions": {}}
    with tempfile.TemporaryDirectory() as tmp:
        task = ts.load_task(args, Path(tmp), [])
        result["task"] = task.description
        for precision in args.precisions:
            why = unavailable(precision)
            if why:
                result.setdefault("not_run", {})[precision] = why
                continue
            use_linear(task.model, inference_linear_kind(torch.device("cpu"), precision))
            with busy_neighbours(args.busy):
                result["precisions"][precision] = measure(task, args.sizes, args.repeats)
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    common.update_section(args.md, NAME, markdown(result))
    return result


if __name__ == "__main__":
    main()
