"""Benchmark 3: training efficiency, model FLOPs utilization (MFU) of aiayn: fp32 on CPU, bf16 / fp16 on a GPU.

MFU = (model FLOPs of a training update / seconds per update) / the machine's fp32 matmul peak,
with both measured in the same run, with the same number of threads.

Model FLOPs (the convention of Kaplan et al. 2020 / PaLM): only matrix multiplications count, a
multiply-add is 2 FLOPs, and a training update costs 3 x the forward pass (the backward pass
computes gradients for activations and for weights: 2 x forward). Per sentence with S source tokens
(EOS included) and T target positions (BOS included), its *real* lengths (padding is not useful work):

    encoder layer:  S (4 D^2 + 2 D F)  +  2 S^2 D                   (Q,K,V,out projections, FFN; QK^T and PV)
    decoder layer:  T (6 D^2 + 2 D F)  +  2 S D^2  +  2 T^2 D  +  2 T S D
                    (self Q,K,V,out + cross Q,out; FFN; cross K,V of the memory; self and cross attention)
    output layer:   T D V
    forward FLOPs = 2 x (L_enc x encoder + L_dec x decoder + output)    [MACs -> FLOPs]

The causal self-attention is counted in full (T^2), as computed. Embedding lookups, LayerNorm,
softmax, the loss and Adam are not counted. The same formula on the padded (B, S_max) / (B, T_max)
shapes gives the FLOPs the hardware executed; ``torch.utils.flop_counter.FlopCounterMode`` counts
those independently (on aiayn's explicit attention path, so that QK^T and PV are matmuls it can
count; the fused CPU kernel has no FLOP formula): the check compares everything.

The peak is the best of several ``torch.mm`` of two n x n matrices (fp32 on CPU, n = 2048 and 4096;
the run's dtype on a GPU, n = 4096 and 8192), 2 n^3 FLOPs each, measured before and after the training
timing. On a GPU the MFU is also given against NVIDIA's 989 TFLOP/s dense bf16 datasheet peak (H100/H200),
the reference of issue 20's goals, and ``--compile`` adds aiayn under ``torch.compile`` (as
``train.compile: true``). The formula and the peak live in ``benchmarks/flops.py``.

    python -m benchmarks.mfu --run-dir runs/multi30k_en_de_quick
    python -m benchmarks.mfu --device cuda --precision bf16 --configs paper-base paper-big --lengths wmt \\
        --compile --warmup 5 --steps 20 --profile benchmarks/results/profile_mfu_cuda.txt
    python -m benchmarks.mfu --smoke --md /tmp/B.md --out-json /tmp/m.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aiayn.data.batching import Batch
from aiayn.device import DTYPES
from aiayn.engine import attention_path, kernels
from aiayn.model.transformer import count_parameters
from benchmarks import common, flops
from benchmarks.flops import batch_training_flops, sentence_forward_flops  # noqa: F401  (re-exported)
from benchmarks.train_throughput import (
    COMPILED,
    LABELS,
    bench_config,
    build_impl,
    build_training,
    make_batches,
    profile_updates,
    time_training,
    updater,
)

NAME = "mfu"
PEAK_SIZES = flops.CPU_PEAK_SIZES


def matmul_peak(sizes: Sequence[int] = PEAK_SIZES, reps: int = 5, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Best ``torch.mm`` FLOP/s over ``reps`` runs per size (:func:`benchmarks.flops.matmul_peak`)."""
    return flops.matmul_peak(sizes, reps, device, dtype)


def counted_training_flops(model: torch.nn.Module, batch: Batch, device: torch.device | str = "cpu",
                           precision: str = "fp32") -> int:
    """FLOPs of one real update on ``batch`` as torch's FlopCounterMode counts them (padded shapes).
    On CPU attention takes aiayn's explicit path (matmuls the counter sees) whatever the sequence length;
    on CUDA the counter has formulas for the fused attention kernels."""
    from torch.utils.flop_counter import FlopCounterMode

    update = updater(model, device, precision)
    explicit = attention_path(model, "explicit") if device.type == "cpu" else contextlib.nullcontext()
    with explicit, FlopCounterMode(display=False) as counter:
        update(batch)
    return int(counter.get_total_flops())


def markdown(result: dict[str, Any]) -> str:
    """The CPU section (the format of the measured CPU numbers in BENCHMARKS.md)."""
    a = result["args"]
    peak = result["peak"]
    lines = [
        "## 3. Training efficiency: model FLOPs utilization (fp32, CPU)\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- Peak: best fp32 `torch.mm` (n = {', '.join(str(n) for n in peak['sizes'])}) with the same threads: "
        f"{peak['before'] / 1e9:,.1f} GFLOP/s before the training timing, {peak['after'] / 1e9:,.1f} after; "
        f"MFU uses the larger, {peak['flops_per_s'] / 1e9:,.1f} GFLOP/s.",
        "- Model FLOPs of an update = 3 x forward; forward = 2 x the multiply-adds of every matmul (all "
        "projections, FFN, output layer, QK^T and PV) at the real sentence lengths (formula in "
        "`benchmarks/mfu.py`). *Executed* counts the padded shapes; *counted / executed* compares torch's "
        "`FlopCounterMode` count of one padded update (attention on aiayn's explicit matmul path, which "
        "the counter sees) with the formula, QK^T and PV included: 1.000 checks the formula independently.",
        f"- Updates: aiayn `Update` (forward, label-smoothed loss, backward, Adam) on {result['data']}, "
        f"batches of <= {a['max_tokens']} tokens, {a['warmup']} warm-up + {a['steps']} timed.\n",
    ]
    headers = ["config", "parameters", "target tokens / update", "ms / update", "model GFLOP / update",
               "achieved GFLOP/s", "MFU", "executed GFLOP/s (padded)", "counted / executed"]
    rows, goals = [], []
    for c in result["configs"]:
        rows.append([
            _name(c), f"{c['parameters'] / 1e6:.1f}M", f"{c['tokens_per_update']:,.0f}",
            f"{c['ms_per_update']:,.0f}", f"{c['model_flops_per_update'] / 1e9:,.1f}",
            f"{c['achieved_flops_per_s'] / 1e9:,.1f}", f"{100 * c['mfu']:.1f}%",
            f"{c['executed_flops_per_s'] / 1e9:,.1f}",
            f"{c['counted_over_executed']:.3f}" if c.get("counted_over_executed") else "",
        ])
        goals.append(f"- {_name(c)}: MFU = {common.goal_cell(100 * c['mfu'], 50.0, '%')}")
    lines.append(common.markdown_table(headers, rows))
    lines.append("Goal (training MFU on CPU >= 50%):\n")
    lines += goals
    if a.get("profile"):
        lines.append(f"\ntorch.profiler tables of the updates: `{a['profile']}`.")
    return "\n".join(lines) + "\n"


def _name(c: dict[str, Any]) -> str:
    extra = [x for x in (f"{c['lengths']} lengths" if c.get("lengths") == "wmt" else "",
                         "torch.compile" if c.get("impl") == COMPILED else "") if x]
    return c["config"] + (f" ({', '.join(extra)})" if extra else "")


def markdown_accelerator(result: dict[str, Any]) -> str:
    """The section of a run on a GPU: MFU against the datasheet peak and the peak measured in the run."""
    a, peak = result["args"], result["peak"]
    lines = [
        f"## Training efficiency (MFU) on {result['machine']['gpu'] or a['device']} ({a['precision']})\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- Peaks: the {flops.DATASHEET_PEAK_NAME}; and the best {peak['dtype']} `torch.mm` measured in this run "
        f"(n = {', '.join(str(n) for n in peak['sizes'])}): {peak['before'] / 1e12:,.0f} TFLOP/s before the "
        f"training timing, {peak['after'] / 1e12:,.0f} after; the larger, {peak['flops_per_s'] / 1e12:,.0f}, is used.",
        "- Model FLOPs of an update = 3 x forward matmul FLOPs at the real lengths (`benchmarks/flops.py`); "
        "*executed* counts the padded shapes; *counted / executed*: torch's `FlopCounterMode` count of one "
        "padded update (fused attention kernels included) over the formula.",
        f"- Updates: aiayn `Update` ({a['precision']} autocast forward, label-smoothed loss, backward, fused "
        f"Adam), batches of <= {a['max_tokens']} tokens, {a['warmup']} warm-up + {a['steps']} timed; "
        "peak GPU memory is `torch.cuda.max_memory_allocated` while it trains.\n",
    ]
    headers = ["config", "lengths", "implementation", "parameters", "target tokens / update", "ms / update",
               "target tokens/s", "achieved TFLOP/s", "MFU (989 TFLOP/s)", "MFU (measured peak)",
               "executed TFLOP/s (padded)", "peak GPU memory (GiB)", "counted / executed"]
    rows = []
    for c in result["configs"]:
        rows.append([
            c["config"], c["lengths"], LABELS[c["impl"]], f"{c['parameters'] / 1e6:.1f}M",
            f"{c['tokens_per_update']:,.0f}", f"{c['ms_per_update']:,.1f}", f"{c['tokens_per_s']:,.0f}",
            f"{c['achieved_flops_per_s'] / 1e12:,.1f}", f"{100 * c['mfu_datasheet']:.1f}%",
            f"{100 * c['mfu']:.1f}%", f"{c['executed_flops_per_s'] / 1e12:,.1f}",
            f"{c.get('peak_gpu_memory_gib', 0):,.1f}",
            f"{c['counted_over_executed']:.3f}" if c.get("counted_over_executed") else "",
        ])
    lines.append(common.markdown_table(headers, rows))
    if a.get("profile"):
        lines.append(f"\ntorch.profiler tables (top kernels by GPU time) of two updates each: `{a['profile']}`.")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mfu", description=__doc__.split("\n")[0])
    common.add_training_args(p)
    p.add_argument("--compile", action="store_true", help="also aiayn under torch.compile (train.compile)")
    p.add_argument("--compile-mode", default="default", help="its torch.compile mode (train.compile_mode)")
    p.add_argument("--peak-sizes", type=int, nargs="+", default=None,
                   help="n of the n x n matmuls (default: 2048 4096 on CPU, 4096 8192 on CUDA)")
    p.add_argument("--peak-reps", type=int, default=5)
    p.add_argument("--no-count", dest="count", action="store_false",
                   help="skip the FlopCounterMode check (one extra update per config)")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}[_cuda].json")
    args = p.parse_args(argv)
    common.apply_smoke(args)
    if args.smoke:
        args.peak_sizes, args.peak_reps = [256], 2
    return args


def measure(args: argparse.Namespace, preset: str, lengths: str, impl: str, device: torch.device,
            threads: int) -> dict[str, Any]:
    """Time ``impl`` on one configuration and length distribution; count and profile it if asked."""
    cfg = bench_config(preset, args.dropout)
    batches, data = make_batches(args, cfg.vocab_size, args.warmup + args.steps, lengths)
    timed = batches[args.warmup:]
    print(f"[{NAME}] {preset} ({lengths}, {impl}): timing {args.steps} updates ...", file=sys.stderr, flush=True)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, fields = build_training(impl, cfg, args.seed, args.compile_mode, device, args.precision)
    with kernels(device):
        r = time_training(model, batches, args.warmup, args.seed, device, args.precision, fields)
    model_flops = sum(flops.batch_training_flops(cfg, b) for b in timed)
    executed = sum(flops.batch_training_flops(cfg, b, padded=True) for b in timed)
    entry = {
        "config": preset, "lengths": lengths if not args.run_dir else "Multi30k (tokenized)", "impl": impl,
        "data": data, "model": dataclasses.asdict(cfg), "parameters": count_parameters(model),
        "seconds": r["seconds"], "ms_per_update": r["ms_per_update"], "step_seconds": r["step_seconds"],
        "tokens_per_update": r["target_tokens"] / len(timed), "tokens_per_s": r["tokens_per_s"],
        "model_flops_per_update": model_flops / len(timed), "achieved_flops_per_s": model_flops / r["seconds"],
        "executed_flops_per_update": executed / len(timed), "executed_flops_per_s": executed / r["seconds"],
    }
    if cuda:
        entry["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.count and impl == "aiayn":
        counted = counted_training_flops(build_impl("aiayn", cfg, args.seed), timed[0], device, args.precision)
        entry["counted_flops_first_update"] = counted
        entry["counted_over_executed"] = counted / flops.batch_training_flops(cfg, timed[0], True)
    if args.profile:
        title = f"{preset} ({lengths}): {LABELS[impl]} Update, {device}, {args.precision}, {threads} threads"
        table = profile_updates(updater(model, device, args.precision, fields), timed, device, Path(args.profile),
                                title)
        if cuda:
            print(table, file=sys.stderr)
    unit, scale = ("TFLOP/s", 1e12) if cuda else ("GFLOP/s", 1e9)
    print(f"[{NAME}] {preset} ({lengths}, {impl}): {entry['achieved_flops_per_s'] / scale:.1f} {unit}",
          file=sys.stderr)
    return entry


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = common.resolve_run_device(args)
    threads = common.set_threads(args.threads)
    accelerator = device.type != "cpu"
    section = f"{NAME}_{device.type}" if accelerator else NAME
    result: dict[str, Any] = {
        "benchmark": section, "date": common.utc_now(), "command": command or common.command_line(NAME, argv),
        "machine": common.machine_info(threads), "args": vars(args), "configs": [],
    }
    dtype = DTYPES[args.precision] if accelerator else torch.float32
    sizes = args.peak_sizes or (flops.CUDA_PEAK_SIZES if accelerator else flops.CPU_PEAK_SIZES)
    print(f"[{NAME}] measuring the {dtype} matmul peak of {device} ...", file=sys.stderr, flush=True)
    before = matmul_peak(sizes, args.peak_reps, device, dtype)
    impls = ["aiayn"] + ([COMPILED] if args.compile else [])
    for preset in args.configs:
        for lengths in ([args.lengths[0]] if args.run_dir else args.lengths):
            for impl in impls:
                result["configs"].append(measure(args, preset, lengths, impl, device, threads))
                result["data"] = result["configs"][-1]["data"]
    after = matmul_peak(sizes, args.peak_reps, device, dtype)
    peak = max(before["flops_per_s"], after["flops_per_s"])
    result["peak"] = {"flops_per_s": peak, "before": before["flops_per_s"], "after": after["flops_per_s"],
                      "sizes": list(sizes), "dtype": before["dtype"], "detail": {"before": before, "after": after}}
    for entry in result["configs"]:
        entry["mfu"] = entry["achieved_flops_per_s"] / peak
        entry["executed_utilization"] = entry["executed_flops_per_s"] / peak
        if accelerator:
            entry["mfu_datasheet"] = entry["achieved_flops_per_s"] / flops.DATASHEET_PEAK_FLOPS
            print(f"[{NAME}] {entry['config']} ({entry['lengths']}, {entry['impl']}): MFU "
                  f"{100 * entry['mfu_datasheet']:.1f}% of 989 TFLOP/s, {100 * entry['mfu']:.1f}% of the measured "
                  f"{peak / 1e12:.0f} TFLOP/s; peak GPU memory {entry['peak_gpu_memory_gib']:.1f} GiB",
                  file=sys.stderr)
    common.write_json(args.out_json or common.RESULTS_DIR / f"{section}.json", result)
    common.update_section(args.md, section, markdown_accelerator(result) if accelerator else markdown(result))
    return result


if __name__ == "__main__":
    main()
