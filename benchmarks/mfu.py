"""Benchmark 3: training efficiency, model FLOPs utilization (MFU) of aiayn on CPU, fp32.

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

The peak is the best of several ``torch.mm`` of two n x n fp32 matrices (n = 2048 and 4096),
2 n^3 FLOPs each, measured before and after the training timing.

    python -m benchmarks.mfu --run-dir runs/multi30k_en_de_quick
    python -m benchmarks.mfu --smoke --md /tmp/B.md --out-json /tmp/m.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aiayn.config import ModelConfig, TrainConfig
from aiayn.data.batching import Batch
from aiayn.model.transformer import count_parameters
from aiayn.train.schedule import build_optimizer
from aiayn.train.trainer import train_update
from benchmarks import common
from benchmarks.train_throughput import LABEL_SMOOTHING, LR, bench_config, build_impl, make_batches, time_training

NAME = "mfu"
PEAK_SIZES = (2048, 4096)


def sentence_forward_flops(cfg: ModelConfig, S: int, T: int, attention: bool = True) -> int:
    """Forward FLOPs of one sentence pair (S source tokens with EOS, T target positions with BOS);
    ``attention=False`` leaves out QK^T and PV (the projections, FFN and output layer only)."""
    D, F, V = cfg.d_model, cfg.d_ff, cfg.target_vocab_size
    a = 1 if attention else 0
    enc = S * (4 * D * D + 2 * D * F) + a * 2 * S * S * D
    dec = T * (6 * D * D + 2 * D * F) + 2 * S * D * D + a * (2 * T * T * D + 2 * T * S * D)
    return 2 * (cfg.n_encoder_layers * enc + cfg.n_decoder_layers * dec + T * D * V)


def batch_training_flops(cfg: ModelConfig, batch: Batch, padded: bool = False, attention: bool = True) -> int:
    """3 x forward FLOPs of ``batch``: real lengths, or the padded tensor shapes when ``padded``."""
    if padded:
        B, S = batch.src.shape
        return 3 * B * sentence_forward_flops(cfg, S, batch.tgt_in.size(1), attention)
    src_lens = (batch.src != cfg.pad_id).sum(dim=1).tolist()
    tgt_lens = (batch.tgt_out != cfg.pad_id).sum(dim=1).tolist()  # = real length of tgt_in (BOS + y)
    return 3 * sum(sentence_forward_flops(cfg, s, t, attention) for s, t in zip(src_lens, tgt_lens))


def matmul_peak(sizes: Sequence[int] = PEAK_SIZES, reps: int = 5) -> dict[str, Any]:
    """Best fp32 ``torch.mm`` FLOP/s over ``reps`` runs per size (after one warm-up run)."""
    per_size = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = min(_timed(lambda: torch.mm(a, b)) for _ in range(reps))  # noqa: B023
        per_size[n] = 2 * n**3 / best
    return {"flops_per_s": max(per_size.values()), "per_size": per_size, "reps": reps}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def counted_training_flops(model: torch.nn.Module, batch: Batch) -> int:
    """FLOPs of one real update on ``batch`` as torch's FlopCounterMode counts them (padded shapes),
    attention through aiayn's explicit path (matmuls the counter sees) whatever the sequence length."""
    from torch.utils.flop_counter import FlopCounterMode

    from aiayn.model.attention import cpu_attention_path

    optimizer = build_optimizer(model, TrainConfig())
    with cpu_attention_path("explicit"), FlopCounterMode(display=False) as counter:
        train_update(model, optimizer, [batch], LR, LABEL_SMOOTHING, pad_id=0)
    return int(counter.get_total_flops())


def profile_update(model: torch.nn.Module, batches: Sequence[Batch], path: Path, title: str) -> None:
    """Append torch.profiler's table (top 30 operators by self CPU time) of two updates to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    optimizer = build_optimizer(model, TrainConfig())
    train_update(model, optimizer, [batches[0]], LR, LABEL_SMOOTHING, pad_id=0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for b in batches[:2]:
            train_update(model, optimizer, [b], LR, LABEL_SMOOTHING, pad_id=0)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(f"== {title}\n{table}\n")


def markdown(result: dict[str, Any]) -> str:
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
        f"- Updates: aiayn `train_update` (forward, label-smoothed loss, backward, Adam) on {result['data']}, "
        f"batches of <= {a['max_tokens']} tokens, {a['warmup']} warm-up + {a['steps']} timed.\n",
    ]
    headers = ["config", "parameters", "target tokens / update", "ms / update", "model GFLOP / update",
               "achieved GFLOP/s", "MFU", "executed GFLOP/s (padded)", "counted / executed"]
    rows, goals = [], []
    for c in result["configs"]:
        rows.append([
            c["config"], f"{c['parameters'] / 1e6:.1f}M", f"{c['tokens_per_update']:,.0f}",
            f"{c['ms_per_update']:,.0f}", f"{c['model_flops_per_update'] / 1e9:,.1f}",
            f"{c['achieved_flops_per_s'] / 1e9:,.1f}", f"{100 * c['mfu']:.1f}%",
            f"{c['executed_flops_per_s'] / 1e9:,.1f}",
            f"{c['counted_over_executed']:.3f}" if c.get("counted_over_executed") else "",
        ])
        goals.append(f"- {c['config']}: MFU = {common.goal_cell(100 * c['mfu'], 50.0, '%')}")
    lines.append(common.markdown_table(headers, rows))
    lines.append("Goal (training MFU on CPU >= 50%):\n")
    lines += goals
    if a.get("profile"):
        lines.append(f"\ntorch.profiler tables of the updates: `{a['profile']}`.")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mfu", description=__doc__.split("\n")[0])
    common.add_training_args(p)
    p.add_argument("--peak-sizes", type=int, nargs="+", default=list(PEAK_SIZES), help="n of the n x n matmuls")
    p.add_argument("--peak-reps", type=int, default=5)
    p.add_argument("--no-count", dest="count", action="store_false",
                   help="skip the FlopCounterMode check (one extra update per config)")
    p.add_argument("--profile", help="append torch.profiler tables of two updates per config to this file")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    args = p.parse_args(argv)
    common.apply_smoke(args)
    if args.smoke:
        args.peak_sizes, args.peak_reps = [256], 2
    return args


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    result: dict[str, Any] = {
        "benchmark": NAME, "date": common.utc_now(), "command": command or common.command_line(NAME, argv),
        "machine": common.machine_info(threads), "args": vars(args), "configs": [],
    }
    print(f"[{NAME}] measuring the fp32 matmul peak ...", file=sys.stderr, flush=True)
    before = matmul_peak(args.peak_sizes, args.peak_reps)
    for preset in args.configs:
        cfg = bench_config(preset, args.dropout)
        batches, result["data"] = make_batches(args, cfg.vocab_size, args.warmup + args.steps)
        timed = batches[args.warmup:]
        print(f"[{NAME}] {preset}: timing {args.steps} updates ...", file=sys.stderr, flush=True)
        model = build_impl("aiayn", cfg, args.seed)
        r = time_training(model, batches, args.warmup, args.seed)
        model_flops = sum(batch_training_flops(cfg, b) for b in timed)
        executed = sum(batch_training_flops(cfg, b, padded=True) for b in timed)
        entry = {
            "config": preset, "model": dataclasses.asdict(cfg), "parameters": count_parameters(model),
            "seconds": r["seconds"], "ms_per_update": r["ms_per_update"], "step_seconds": r["step_seconds"],
            "tokens_per_update": r["target_tokens"] / len(timed), "tokens_per_s": r["tokens_per_s"],
            "model_flops_per_update": model_flops / len(timed), "achieved_flops_per_s": model_flops / r["seconds"],
            "executed_flops_per_update": executed / len(timed), "executed_flops_per_s": executed / r["seconds"],
        }
        if args.count:
            counted = counted_training_flops(build_impl("aiayn", cfg, args.seed), timed[0])
            entry["counted_flops_first_update"] = counted
            entry["counted_over_executed"] = counted / batch_training_flops(cfg, timed[0], True)
        if args.profile:
            profile_update(build_impl("aiayn", cfg, args.seed), timed, Path(args.profile),
                           f"{preset}: aiayn train_update, {threads} threads")
        result["configs"].append(entry)
        print(f"[{NAME}] {preset}: {entry['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s", file=sys.stderr)
        del model
    after = matmul_peak(args.peak_sizes, args.peak_reps)
    peak = max(before["flops_per_s"], after["flops_per_s"])
    result["peak"] = {"flops_per_s": peak, "before": before["flops_per_s"], "after": after["flops_per_s"],
                      "sizes": list(args.peak_sizes), "detail": {"before": before, "after": after}}
    for entry in result["configs"]:
        entry["mfu"] = entry["achieved_flops_per_s"] / peak
        entry["executed_utilization"] = entry["executed_flops_per_s"] / peak
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    common.update_section(args.md, NAME, markdown(result))
    return result


if __name__ == "__main__":
    main()
