"""int8 on a CPU (``--precision int8``) against fp32 on one run: BLEU, same outputs, memory and start-up.

    python -m benchmarks.int8 --run-dir runs/multi30k_en_de_quick --split test_2016_flickr

Each precision runs in a fresh interpreter (so its memory and start-up are its own), as ``aiayn evaluate RUN
--split SPLIT --precision P`` does: the run's decoding options (beam search, its length penalty, stop=exact),
sacreBLEU of the whole split. Measured in each: the seconds to load the run (``load_run``: config, tokenizer,
weights), to translate the first sentence (it prepares the linear layers' weights: oneDNN's layout in fp32, the
int8 weights and scales in int8), the resident memory after loading and after the first sentence, and the peak
over the evaluation. Start-up times are the best of ``--repeats`` fresh interpreters, the precisions taking turns.
The goal (issue 60): int8's BLEU within 0.3 of fp32's.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "int8"
PRECISIONS = ("fp32", "int8")


def _rss_mib() -> float:
    """This process's resident memory now (MiB), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(run_dir: str, split: str, precision: str, threads: int | None, evaluate: bool) -> dict[str, Any]:
    """One precision in this process: load, first sentence, then (``evaluate``) the whole split."""
    import torch

    from aiayn import load

    common.set_threads(threads)
    t1 = time.perf_counter()
    translator = load(run_dir, "cpu", precision)
    t2 = time.perf_counter()
    rss_loaded = _rss_mib()
    translator.translate(["A man is riding a bicycle down the street."])
    t3 = time.perf_counter()
    out: dict[str, Any] = {
        "precision": precision, "load_s": t2 - t1, "first_sentence_s": t3 - t2,
        "rss_loaded_mib": rss_loaded, "rss_after_first_mib": _rss_mib(), "threads": torch.get_num_threads(),
    }
    if evaluate:
        from aiayn.eval.evaluate import EvalData, evaluate_translation

        record = evaluate_translation(run_dir, EvalData(split=split, name=f"{split}.bench-{precision}"),
                                      device="cpu", precision=precision)
        out.update(bleu=record["scores"]["bleu"], chrf=record["scores"]["chrf"], wall_s=record["wall_s"],
                   sentences=record["n_sentences"], hyp_path=str(Path(record["json_path"]).with_suffix(".hyp")),
                   signature=record["signatures"]["bleu"])
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_worker(args: argparse.Namespace, precision: str, evaluate: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.int8", "--worker", precision, "--run-dir", args.run_dir,
           "--split", args.split] + (["--threads", str(args.threads)] if args.threads else []) + (
           ["--evaluate"] if evaluate else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{NAME}: the {precision} worker failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(result: dict[str, Any]) -> str:
    fp32, int8 = result["fp32"], result["int8"]
    rows = []
    for k, label, fmt in (("bleu", "BLEU (sacreBLEU, test split)", "{:.2f}"), ("chrf", "chrF", "{:.2f}"),
                          ("wall_s", "seconds to translate the split", "{:.1f}"),
                          ("load_s", "load the run (s, best)", "{:.2f}"),
                          ("first_sentence_s", "first sentence, preparing the weights (s, best)", "{:.2f}"),
                          ("rss_loaded_mib", "resident memory after loading (MiB)", "{:.0f}"),
                          ("rss_after_first_mib", "resident memory after the first sentence (MiB)", "{:.0f}"),
                          ("peak_rss_mib", "peak resident memory over the evaluation (MiB)", "{:.0f}")):
        rows.append([label, fmt.format(fp32[k]), fmt.format(int8[k]), fmt.format(int8[k] - fp32[k])])
    gap = int8["bleu"] - fp32["bleu"]
    return "\n".join([
        "## int8 on a CPU (`--precision int8`) against fp32\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- Run: `{result['args']['run_dir']}`, split {result['args']['split']} ({fp32['sentences']} sentences), the "
        "run's decoding options (`aiayn evaluate`'s: beam search, stop=exact); each precision in a fresh interpreter, "
        f"start-up times the best of {result['args']['repeats']}. int8: dynamic int8 linear layers (per-row weight "
        "and input scales, int32 sums; `aiayn/linear.py`); fp32: oneDNN with prepacked weights.",
        f"- Same output as fp32: {result['same_outputs']}/{fp32['sentences']} sentences.\n",
        common.markdown_table(["", "fp32", "int8", "int8 - fp32"], rows),
        f"Goal: int8 BLEU within 0.3 of fp32: {gap:+.2f} ({'met' if abs(gap) <= 0.3 else 'short'}).",
    ]) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/multi30k_en_de_quick", help="a trained translation run")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per core)")
    p.add_argument("--repeats", type=int, default=3, help="fresh interpreters per precision for the start-up times")
    p.add_argument("--worker", choices=PRECISIONS, help=argparse.SUPPRESS)
    p.add_argument("--evaluate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--md", default=str(common.DEFAULT_MD), help="markdown file whose section is rewritten")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.run_dir, args.split, args.worker, args.threads, args.evaluate)))
        return {}
    runs: dict[str, list[dict[str, Any]]] = {q: [] for q in PRECISIONS}
    for i in range(max(1, args.repeats)):
        for q in PRECISIONS:  # taking turns: a load that drifts falls on both
            runs[q].append(run_worker(args, q, evaluate=i == 0))
    result: dict[str, Any] = {"benchmark": NAME, "date": common.utc_now(), "command": common.command_line(NAME, argv),
                              "machine": common.machine_info(runs["fp32"][0]["threads"]), "args": vars(args)}
    for q in PRECISIONS:
        best = dict(runs[q][0])
        for key in ("load_s", "first_sentence_s"):
            best[key] = min(r[key] for r in runs[q])
        best["all"] = runs[q]
        result[q] = best
    hyps = {q: Path(result[q]["hyp_path"]).read_text(encoding="utf-8").splitlines() for q in PRECISIONS}
    result["same_outputs"] = sum(a == b for a, b in zip(hyps["fp32"], hyps["int8"]))
    result["bleu_gap"] = result["int8"]["bleu"] - result["fp32"]["bleu"]
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    common.update_section(args.md, NAME, markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
