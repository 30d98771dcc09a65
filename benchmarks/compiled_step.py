"""Batch-1 beam search on a CPU: the decoder step as it runs, at fixed shapes, and compiled by inductor (issue 69).

    python -m benchmarks.compiled_step --run-dir RUN --limit 100 --threads 1 --md BENCHMARKS.md
    python -m benchmarks.compiled_step --smoke --ways normal fixed

The issue asks what compiling the beam step does on a CPU, measured. Each way decodes the same sources one at a
time (beam 4, power length penalty alpha 0.6, at most 64 steps, ``stop=exact``) in a process of its own:

* ``normal``: the PyTorch search ``aiayn translate`` ran before the native one (``AIAYN_NATIVE=off`` in every way's
  process): the run's linear kernels for ``--precision`` (fp32: oneDNN prepacked), a KV cache that grows with the
  steps;
* ``fixed``: the fixed-shape steps (:mod:`aiayn.search.fixed`, ``decode.cuda_graphs``; on a CPU no graph): every row
  of the batch kept, a static KV cache of 64 steps read whole under a mask; the same linear kernels;
* ``fixed-plain``: the same with ``F.linear`` (inductor cannot lower oneDNN's prepacked weights);
* ``inductor``: ``fixed-plain``'s step (every step after the first, which allocates the cache) under
  ``torch.compile`` (inductor, automatic dynamic shapes: the source length varies), with an empty compile cache;
* ``inductor-cpp``: the same with inductor's C++ wrapper (``cpp_wrapper``), no Python between its kernels.

Reported per way: the first pass's seconds (compilation included), the CPU milliseconds per decoder step of a
second pass (CPU time of the process, steadier than wall time beside other work), and how many outputs equal
``normal``'s (the fixed shapes sum attention over zeros too: equal up to rounding, not bit for bit).
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
from typing import Any

from benchmarks import common

REPO = common.REPO
NAME = "compiled_step"
WAYS = ("normal", "fixed", "fixed-plain", "inductor", "inductor-cpp")
STEPS = 64  # the step limit: the static cache's length


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default=None, help="a trained translation run (Multi30k test sources)")
    p.add_argument("--limit", type=int, default=100, help="sentences, each decoded alone (default 100)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "int8"],
                   help="the run's linear kernels in normal and fixed (default fp32)")
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--smoke", action="store_true", help="a tiny untrained model on random sources, 4 sentences")
    p.add_argument("--md", default=None, help="rewrite this file's compiled_step section (BENCHMARKS.md)")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sources", default=None, help=argparse.SUPPRESS)
    return p.parse_args(list(argv))


def load(args: argparse.Namespace) -> tuple[Any, list[list[int]], Any]:
    """The model (eval mode, the way's linear kernels), the sources' ids and the search specification."""
    import torch

    from aiayn.data.tokenizer import SpecialIds
    from aiayn.linear import use_linear
    from aiayn.search import SearchSpec

    if args.smoke:
        from aiayn import build_model, model_config
        from aiayn.engine import prepare_model

        torch.manual_seed(0)
        cfg = model_config("tiny", vocab_size=300, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1,
                           n_decoder_layers=1, max_positions=128)
        model = prepare_model(build_model(cfg), "cpu", training=False, precision=args.precision)
        ids = SpecialIds()
    else:
        from aiayn.run.directory import load_run

        run = load_run(args.run_dir, "cpu", precision=args.precision)
        model, ids = run.model, run.tokenizers.specials
    model.eval()
    if args.child in ("fixed-plain", "inductor", "inductor-cpp"):
        use_linear(model, "plain")
    sources = json.loads(Path(args.sources).read_text(encoding="utf-8"))
    spec = SearchSpec.of(ids, beam=4, alpha=0.6, length_penalty="power", max_len_a=0.0, max_len_b=STEPS,
                         stop="exact", cuda_graphs=args.child != "normal")
    return model, sources, spec


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One way, in this process: first pass seconds, CPU ms per decoder step of the second pass, the outputs."""
    import torch

    import aiayn.search.beam as beam
    import aiayn.search.fixed as fixed

    torch.set_num_threads(args.threads)
    model, sources, spec = load(args)
    if args.child.startswith("inductor"):
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = args.child == "inductor-cpp"
        torch._dynamo.config.recompile_limit = 64
        plain = fixed.FixedShapeSteps._step
        compiled = torch.compile(plain)

        def step(self: fixed.FixedShapeSteps) -> torch.Tensor:  # the first step allocates the cache: as it is
            return plain(self) if self.cache._buf is None else compiled(self)

        fixed.FixedShapeSteps._step = step
    steps = [0]
    candidates = beam._candidates

    def counted(*a: Any) -> Any:  # one call per decoder step, outside the compiled region
        steps[0] += 1
        return candidates(*a)

    beam._candidates = counted

    def one_pass() -> list[list[int]]:
        out = []
        for s in sources:
            src = torch.tensor([s])
            out.append(beam.beam_search(model, src, src != spec.pad, spec)[0][0].tokens)
        return out

    t0 = time.perf_counter()
    one_pass()
    first_s = time.perf_counter() - t0
    steps[0] = 0
    c0, t0 = time.process_time(), time.perf_counter()
    outputs = one_pass()
    cpu_s, wall_s = time.process_time() - c0, time.perf_counter() - t0
    return {"way": args.child, "first_pass_s": round(first_s, 2), "steps": steps[0],
            "cpu_ms_per_step": round(1000 * cpu_s / steps[0], 3),
            "wall_ms_per_step": round(1000 * wall_s / steps[0], 3), "outputs": outputs}


def sources_of(args: argparse.Namespace) -> list[list[int]]:
    """The sources' ids, EOS last: Multi30k test_2016_flickr's first ``--limit`` (the run's tokenizer), or random."""
    from aiayn.data.tokenizer import SpecialIds

    if args.smoke:
        import random

        rng = random.Random(1)
        return [[rng.randrange(4, 300) for _ in range(rng.randrange(4, 12))] + [SpecialIds().eos]
                for _ in range(args.limit)]
    from aiayn.data.datasets import multi30k_split
    from aiayn.run.directory import load_run

    run = load_run(args.run_dir, "cpu", precision="fp32")
    d, tok = run.cfg.data, run.tokenizers
    pairs = multi30k_split("test_2016_flickr", d.src_lang, d.tgt_lang)[: args.limit]
    return [tok.src.encode(s) + [tok.specials.eos] for s, _ in pairs]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    if args.smoke:
        args.limit = min(args.limit, 4)
    elif not args.run_dir:
        raise SystemExit(f"python -m benchmarks.{NAME}: --run-dir RUN (or --smoke) is needed")
    result: dict[str, Any] = {"date": common.utc_now(), "run": args.run_dir or "smoke", "sentences": args.limit,
                              "precision": args.precision, "machine": common.machine_info(args.threads),
                              "command": common.command_line(NAME, argv), "ways": {}}
    with tempfile.TemporaryDirectory(prefix="aiayn-compiled-step-") as tmp:
        sources = Path(tmp) / "sources.json"
        sources.write_text(json.dumps(sources_of(args)), encoding="utf-8")
        for way in args.ways:  # each in a process of its own, an empty compile cache each
            # the PyTorch search every way (a sentence alone would otherwise take the native loop, which has no step
            # to compile or count: aiayn.search.native)
            env = {**os.environ, "PYTHONPATH": str(REPO), "AIAYN_NATIVE": "off",
                   "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / f"cache-{way}"),
                   "OMP_NUM_THREADS": str(args.threads)}
            out = subprocess.run([sys.executable, "-m", f"benchmarks.{NAME}", *argv, "--child", way,
                                  "--sources", str(sources)], capture_output=True, text=True, env=env, cwd=REPO)
            if out.returncode != 0:
                raise SystemExit(f"{way}: exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            result["ways"][way] = r
            print(f"{way}: first pass {r['first_pass_s']} s, {r['cpu_ms_per_step']} CPU ms/step", flush=True)
    summarize(result)
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    if args.md:
        common.update_section(args.md, NAME, markdown(result))
    return result


def summarize(result: dict[str, Any]) -> None:
    """Each way's outputs compared with the first way's (normal's where it ran), and its speed against it."""
    ways = result["ways"]
    base = ways.get("normal") or next(iter(ways.values()))
    for r in ways.values():
        r["same_outputs"] = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
        r["speed_vs_first"] = round(base["cpu_ms_per_step"] / r["cpu_ms_per_step"], 2)


def markdown(result: dict[str, Any]) -> str:
    first = next(iter(result["ways"]))
    rows = [[way, f"{r['first_pass_s']:.1f}", r["steps"], f"{r['cpu_ms_per_step']:.2f}",
             f"{r['speed_vs_first']:.2f}x", f"{r['same_outputs']} / {len(r['outputs'])}"]
            for way, r in result["ways"].items()]
    table = common.markdown_table(["way", "first pass (s)", "decoder steps", "CPU ms / step", f"speed vs {first}",
                            f"outputs = {first}"], rows)
    return (f"## Batch-1 beam search with the step compiled (issue 69)\n\n"
            f"{result['sentences']} sentences of `{result['run']}`, each alone, beam 4, at most {STEPS} steps, "
            f"precision {result['precision']} (the module docstring of `benchmarks/compiled_step.py` says what each "
            f"way is). CPU milliseconds per decoder step of a second pass (the first compiles).\n\n{table}\n\n"
            + common.provenance(result["machine"], result["command"], result["date"]))


if __name__ == "__main__":
    main()
