"""Benchmark 1: training throughput (target tokens/s) and peak memory: fp32 on CPU, or bf16 / fp16 on a GPU.

Implementations of the same architecture (the paper's post-LN Transformer, shared and tied embeddings, sinusoidal
positions, ReLU), built from the same initial weights and checked to compute the same logits before anything is
timed (``benchmarks/train_peers.py`` builds them):

* ``aiayn``              aiayn.Transformer, eager; ``aiayn+LEVER+...`` with aiayn's speed levers (``cast``: weights
                         cast once, ``fused-loss``: output projection fused into the loss, ``fuse-norms``: fused
                         residual + layer norm, ``cudnn``: cuDNN attention first), as the ``train.*`` keys set them
* ``aiayn-compile``      aiayn.Transformer and its loss under ``torch.compile``, as ``train.compile`` (levers too)
* ``hf-marian``          Hugging Face ``MarianMTModel`` (converted with aiayn.interop.marian.to_hf_marian)
* ``hf-marian-compile``  the same, its layers and the loss compiled by regions in the same shape policy
* ``torch-nn``           embeddings + sinusoids + ``torch.nn.Transformer`` + the tied output projection

Every update goes through the same code, ``aiayn.train.update.Update``: forward, our
label-smoothed cross entropy (eps 0.1) on the logits, backward, Adam(0.9, 0.98, 1e-9). So the work
per update is equal and only the model differs. Each implementation runs W warm-up and N timed
updates on the same sequence of length-bucketed batches (Multi30k train pairs tokenized with a run's
tokenizer, or synthetic pairs with Multi30k's or WMT14-like lengths), in its own process so that its peak
memory (``ru_maxrss``; on CUDA ``torch.cuda.max_memory_allocated``) is its own. On a GPU it also prints
MFU against the 989 TFLOP/s datasheet peak and against a matmul peak measured in the same run. Each row also
says the slowest timed update against the median one, the graphs torch.compile built during the timed updates
(recompiles) and, for aiayn, the SDPA backend of encoder self-, decoder self- and cross-attention.

    python -m benchmarks.train_throughput --run-dir runs/multi30k_en_de_quick
    python -m benchmarks.train_throughput --device cuda --precision bf16 --configs paper-base paper-big \\
        --impls aiayn aiayn-compile hf-marian torch-nn --lengths wmt multi30k --warmup 5 --steps 20
    python -m benchmarks.train_throughput --smoke --md /tmp/B.md --out-json /tmp/t.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import aiayn.engine as engine
from aiayn.config import COMPILE_MODES, ModelConfig, TrainConfig, model_config
from aiayn.data.batching import Batch
from aiayn.device import DTYPES, autocast_context
from aiayn.engine import CompileCounter, kernels
from aiayn.train.loss import label_smoothed_cross_entropy
from aiayn.train.schedule import build_optimizer
from aiayn.train.update import Update, batch_to_device
from benchmarks import common, flops
from benchmarks.train_peers import (  # noqa: F401  (HFMarianSeq2Seq, TorchNNTransformer, build_impl: re-exported)
    BASE_LABELS,
    HFMarianSeq2Seq,
    TorchNNTransformer,
    Variant,
    build_impl,
    build_variant,
    label,
)

NAME = "train_throughput"
IMPLS = ("aiayn", "hf-marian", "torch-nn")
COMPILED = "aiayn-compile"
LABELS = BASE_LABELS  # by base implementation (benchmarks.mfu); a variant's: train_peers.label
LABEL_SMOOTHING = 0.1
LR = 1e-4  # any fixed rate: the speed of an update does not depend on it


def build_training(impl: str, cfg: ModelConfig, seed: int = 1, compile_mode: str = "default",
                   device: str | torch.device = "cpu", precision: str = "fp32") -> tuple[nn.Module, dict[str, Any]]:
    """Variant ``impl`` on ``device`` and the :class:`Update` fields it trains with (its loss and levers)."""
    built = build_variant(impl, cfg, seed, compile_mode, device, precision)
    return built.model, built.fields


# Configurations and data ---------------------------------------------------------------------------------


def bench_config(preset: str, dropout: float | None = None) -> ModelConfig:
    """The preset with the concat sinusoid layout (Marian's; the speed does not depend on it).
    ``smoke`` is a few-thousand-parameter model for CI."""
    over: dict[str, Any] = {"positional_layout": "concat"}
    if preset == "smoke":
        preset = "tiny"
        over.update(vocab_size=300, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1,
                    max_positions=128)
    if dropout is not None:
        over["dropout"] = dropout
    return model_config(preset, **over)


def make_batches(args: argparse.Namespace, vocab_size: int, count: int,
                 lengths: str = "multi30k") -> tuple[list[Batch], str]:
    """The shared batches and a sentence describing them (``lengths``: the synthetic distribution)."""
    pad = getattr(args, "pad_to_multiple", None) or 1
    if args.run_dir:
        pairs = common.multi30k_token_pairs(args.run_dir, "train", limit=args.pairs)
        top = max(max(max(s, default=0), max(t, default=0)) for s, t in pairs)
        if top >= vocab_size:
            raise SystemExit(f"the run's tokenizer has ids up to {top}, above the model vocabulary {vocab_size}")
        what = f"Multi30k train pairs tokenized with the tokenizer of `{args.run_dir}`"
    else:
        pairs = common.synthetic_token_pairs(args.pairs or 29000, vocab_size, seed=args.seed, lengths=lengths)
        what = f"synthetic pairs (random ids) with {common.LENGTH_DISTRIBUTIONS[lengths]}"
    if pad > 1:
        what += f", lengths padded to a multiple of {pad}"
    batches = common.training_batches(pairs, args.max_tokens, count, seed=args.seed, pad_to_multiple=pad)
    return batches, what


# Timing -------------------------------------------------------------------------------------------------


def current_rss_mib() -> float:
    """Resident memory now (Linux /proc; falls back to the peak)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize() / 2**20
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()


def peak_rss_mib() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def updater(model: nn.Module, device: torch.device | str = "cpu", precision: str = "fp32",
            fields: dict[str, Any] | None = None) -> Callable[[Batch], None]:
    """One training update per call, as aiayn training runs it: the batch copied to the device (pinned,
    non-blocking on CUDA), autocast forward, the loss, backward, Adam (fused on CUDA), a GradScaler for fp16;
    ``fields``: the :class:`Update` fields of the variant (its loss and levers; default: aiayn's plain loss)."""
    device = torch.device(device)
    model.to(device).train()
    optimizer = build_optimizer(model, TrainConfig())
    autocast = autocast_context(precision, device)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    fields = fields or {"loss_fn": label_smoothed_cross_entropy}
    step = Update(module=model, optimizer=optimizer, label_smoothing=LABEL_SMOOTHING, pad_id=0, autocast=autocast,
                  scaler=scaler, **fields)

    def update(b: Batch) -> None:
        step([batch_to_device(b, device)], LR)

    return update


def time_training(model: nn.Module, batches: Sequence[Batch], warmup: int, seed: int = 1,
                  device: torch.device | str = "cpu", precision: str = "fp32",
                  fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """W = ``warmup`` untimed then len(batches) - W timed updates through ``aiayn.train.update.Update``; with the
    slowest timed update against the median and the graphs torch.compile built in the timed updates
    (``recompiles``: a compiled variant should build all of its graphs in the warm-up)."""
    device = torch.device(device)
    update = updater(model, device, precision, fields)
    torch.manual_seed(seed)  # reproducible dropout
    graphs = CompileCounter()
    for b in batches[:warmup]:
        update(b)
    graphs.warmed_up()
    steps = [flops.timed(lambda b=b: update(b), device) for b in batches[warmup:]]
    timed = batches[warmup:]
    tokens = sum(b.ntokens for b in timed)
    seconds = sum(steps)
    median = statistics.median(steps)
    return {
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "seconds": seconds,
        "target_tokens": tokens,
        "source_tokens": sum(int((b.src != 0).sum()) for b in timed),
        "tokens_per_s": tokens / seconds,
        "ms_per_update": 1000 * seconds / len(timed),
        "median_ms_per_update": 1000 * median,
        "slowest_over_median": max(steps) / median,
        "graphs": graphs.graphs,
        "recompiles": graphs.recompiles,
        "step_seconds": steps,
    }


def profile_updates(update: Callable[[Batch], None], batches: Sequence[Batch], device: torch.device, path: Path,
                    title: str, rows: int = 25, backends: Sequence[str] = ()) -> str:
    """torch.profiler's table of two updates (after one untimed), the top ``rows`` operators by self
    device time on CUDA (kernels) or self CPU time; appended to ``path`` and returned. The updates run with the
    timed ones' attention backends (:func:`aiayn.engine.kernels`, ``backends`` as ``train.attention_backends``):
    outside it, PyTorch's default picks cuDNN's attention on Hopper, which the timed updates never use (the first
    H200 profile had it)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with kernels(device, attention_backends=backends):
        update(batches[0])
        with profile(activities=activities, record_shapes=False) as prof:
            for b in batches[:2]:
                update(b)
            flops.synchronize(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(f"== {title}\n{table}\n")
    return table


def run_worker(impl: str, cfg: ModelConfig, batches: Sequence[Batch], args: argparse.Namespace,
               threads: int) -> dict[str, Any]:
    """Build ``impl`` and time it, as ``args`` say (warmup, seed, device, precision, compile_mode, profile);
    training memory is the peak RSS minus the RSS before the model is built (on CUDA also the peak of GPU memory
    allocated while it trains)."""
    warmup, seed, device, precision = args.warmup, args.seed, args.device, args.precision
    common.set_threads(threads)
    engine.COMPILE_BACKEND = args.compile_backend
    dev = torch.device(device)
    # One throwaway update of a tiny model of the same kind first, so that library code loaded on first
    # use (transformers modules, autograd and optimizer paths, CUDA kernels) is in the baseline, not the peak.
    primer_cfg = bench_config("smoke")
    primer_data = common.training_batches(common.synthetic_token_pairs(4, primer_cfg.vocab_size), 64, 1)
    primer = build_impl(Variant.parse(impl).eager_base, primer_cfg, seed)
    time_training(primer, primer_data, 0, seed, dev, precision)
    del primer
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    base = current_rss_mib()
    built = build_variant(impl, cfg, seed, args.compile_mode, dev, precision, probe=batches[0])
    with kernels(dev, precision, built.backends):  # the same attention backends for every implementation
        out = time_training(built.model, batches, warmup, seed, dev, precision, built.fields)
    out.update(impl=impl, rss_before_model_mib=base, peak_rss_mib=peak_rss_mib(), attention=built.attention)
    out["training_memory_mib"] = out["peak_rss_mib"] - base
    if dev.type == "cuda":
        out["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if impl.startswith("hf-marian"):
        out["hf_attn_implementation"] = getattr(built.model.hf.config, "_attn_implementation", None)
    if args.profile:
        title = f"{cfg.d_model}x{cfg.n_encoder_layers}+{cfg.n_decoder_layers} {label(impl)}, {device}, {precision}"
        out["profile"] = profile_updates(updater(built.model, dev, precision, built.fields), batches[warmup:], dev,
                                         Path(args.profile), title, backends=built.backends)
    return out


def run_isolated(impl: str, cfg: ModelConfig, batches_path: Path, args: argparse.Namespace,
                 threads: int) -> dict[str, Any]:
    """:func:`run_worker` in a fresh interpreter, so ``ru_maxrss`` (and the CUDA state) is this
    implementation's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, result = Path(tmp) / "cfg.json", Path(tmp) / "result.json"
        cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
        cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--worker", impl, "--worker-config",
               str(cfg_path), "--worker-batches", str(batches_path), "--worker-result", str(result),
               "--warmup", str(args.warmup), "--threads", str(threads), "--seed", str(args.seed),
               "--device", args.device, "--precision", args.precision, "--compile-mode", args.compile_mode,
               "--compile-backend", args.compile_backend]
        if args.profile:
            cmd += ["--profile", args.profile]
        subprocess.run(cmd, check=True, cwd=common.REPO)
        return json.loads(result.read_text())


@torch.no_grad()
def logits_agreement(cfg: ModelConfig, impls: Sequence[str], batch: Batch, seed: int) -> dict[str, float]:
    """max |logits - aiayn's| per implementation, eval mode, fp32 on CPU, on the first 4 sentences."""
    src, tgt_in = batch.src[:4], batch.tgt_in[:4]
    ref = build_impl("aiayn", cfg, seed).eval()
    out = {}
    for impl in impls:
        if Variant.parse(impl).ours or Variant.parse(impl).compiled:  # aiayn itself; a compiled peer is its eager self
            continue
        m = build_impl(impl, cfg, seed).eval()
        with warnings.catch_warnings():  # nn.Transformer's eval fast path warns about nested tensors
            warnings.simplefilter("ignore")
            out[impl] = common.max_logit_diff(ref, m, src, tgt_in)
        del m
    return out


# Report -------------------------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    """The CPU section (the table format of the measured CPU numbers in BENCHMARKS.md)."""
    a = result["args"]
    memory = (
        "- Memory: each implementation runs in its own process; *peak RSS* is its `ru_maxrss`, *training "
        "memory* that minus the RSS before the model was built (after imports, data loading and one "
        "throwaway update of a tiny model of the same kind): model, gradients, Adam state, activations."
        if a["isolate"] else "- Memory: not measured (`--no-isolate`: one process for all implementations)."
    )
    bf16 = any(c.get("precision") == "bf16" for c in result["configs"])
    lines = [
        "## 1. Training throughput and memory (fp32, CPU)\n" if not bf16 else
        "## 1b. Training throughput on a CPU: bf16 autocast against fp32, in one run\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- Work: one update = forward + label-smoothed cross entropy (eps {LABEL_SMOOTHING}) + backward + "
        "Adam, all through `aiayn.train.update.Update`, so only the model differs; dropout "
        f"{result['dropout']} on embeddings and sub-layer outputs (the paper's places) in all three.",
        f"- Data: {result['data']}; length-bucketed batches of <= {a['max_tokens']} tokens "
        f"({result['mean_batch_target_tokens']:.0f} target tokens per batch on average), the same batches "
        f"in the same order for every implementation; {a['warmup']} warm-up + {a['steps']} timed updates.",
        memory,
        "- Same architecture: built from the same initial weights; max |logits - aiayn| (eval mode) "
        "in the last column.\n",
    ]
    headers = ["config", "implementation", "target tokens/s", "ms / update", "peak RSS (MiB)",
               "training memory (MiB)", "aiayn speed-up", "max abs Δlogits"]
    rows, goals = [], []
    for c in result["configs"]:
        ours = c["results"].get("aiayn")
        for impl, r in c["results"].items():
            ratio = ours["tokens_per_s"] / r["tokens_per_s"] if ours and impl != "aiayn" else None
            diff = c["logit_diff"].get(impl)
            mem = [f"{r['peak_rss_mib']:,.0f}", f"{r['training_memory_mib']:,.0f}"] if a["isolate"] else ["-", "-"]
            name = c["config"] + (f" ({c['lengths']} lengths)" if c.get("lengths") == "wmt" else "") + (
                f", {c['precision']}" if bf16 else "")
            rows.append([name, label(impl), f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_update']:,.0f}", *mem,
                         f"{ratio:.2f}x" if ratio else "", f"{diff:.1e}" if diff is not None else ""])
        hf = c["results"].get("hf-marian")
        where = f"{c['config']}" + (f", {c['precision']}" if bf16 else "")
        if ours and hf:
            goals.append(f"- {where}: aiayn / HF Marian tokens/s = "
                         f"{common.goal_cell(ours['tokens_per_s'] / hf['tokens_per_s'], 1.5)}")
        fp32 = next((f for f in result["configs"] if f.get("precision") == "fp32" and f["config"] == c["config"]
                     and f.get("lengths") == c.get("lengths")), None) if c.get("precision") == "bf16" else None
        for impl, r in c["results"].items() if fp32 else ():
            peer = impl if impl in fp32["results"] else "aiayn" if impl.startswith("aiayn") else impl
            base = fp32["results"].get(peer)
            if base:  # issue 69: bf16 training on a CPU with native bf16 >= 1.7x fp32's updates
                goals.append(f"- {c['config']}: {label(impl)} bf16 / {label(peer)} fp32 tokens/s = "
                             f"{common.goal_cell(r['tokens_per_s'] / base['tokens_per_s'], 1.7)}")
    lines.append(common.markdown_table(headers, rows))
    if goals:
        lines.append("Goals (training >= 1.5x Hugging Face Marian tokens/s" + ("; bf16 >= 1.7x fp32 on a CPU with "
                     "native bf16, issue 69" if bf16 else "") + "):\n")
        lines += goals
    return "\n".join(lines) + "\n"


# % of the datasheet peak and tokens/s ratios over the peers (issue 59)
MFU_GOALS = {"paper-base": 22.0, "paper-big": 40.0}
PEER_GOALS = {"hf-marian": 1.5, "hf-marian-compile": 1.2, "torch-nn": 1.5}


def _accelerator_intro(result: dict[str, Any]) -> list[str]:
    """The accelerator section's heading, provenance and what was measured (work, data, MFU, memory)."""
    a, peak = result["args"], result["peak"]
    return [
        f"## Training throughput on {result['machine']['gpu'] or a['device']} ({a['precision']})\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- Work: one update = batch copy to the GPU + {a['precision']} autocast forward + label-smoothed "
        f"cross entropy (eps {LABEL_SMOOTHING}) + backward + Adam (fused), all through "
        "`aiayn.train.update.Update`; the cuDNN attention backend off for every implementation but `cuDNN attention "
        "first` (`aiayn.engine.kernels`); `+ torch.compile` compiles the layers by regions and the loss as "
        f"`train.compile: true` does (mode {a['compile_mode']}), aiayn's levers are the `train.*` keys' "
        "(`benchmarks/train_peers.py`).",
        f"- Data: batches of <= {a['max_tokens']} tokens (padded lengths counted), the same batches in the "
        f"same order for every implementation; {a['warmup']} warm-up + {a['steps']} timed updates; *slowest* is the "
        "slowest timed update over the median one, *recompiles* the graphs torch.compile built in the timed updates.",
        f"- MFU = model FLOPs (3 x forward matmul FLOPs at the real lengths, `benchmarks/flops.py`) per second "
        f"over the {flops.DATASHEET_PEAK_NAME}, and over the best {peak['dtype']} `torch.mm` measured in this "
        f"run ({peak['flops_per_s'] / 1e12:,.0f} TFLOP/s, n = {', '.join(map(str, peak['sizes']))}).",
        "- Peak GPU memory: `torch.cuda.max_memory_allocated` while the implementation trains (model, gradients, "
        "Adam state, activations).\n",
    ]


def markdown_accelerator(result: dict[str, Any]) -> str:
    """The section of a run on an accelerator: tokens/s, MFU against the datasheet and the measured peak,
    peak GPU memory, the slowest update and the recompiles, per implementation, configuration and length
    distribution; the best aiayn variant against each peer; the attention backends aiayn's updates took."""
    a = result["args"]
    lines = _accelerator_intro(result)
    headers = ["config", "lengths", "implementation", "target tokens/s", "ms / update", "slowest", "recompiles",
               "peak GPU memory (GiB)", "MFU (989 TFLOP/s)", "MFU (measured peak)", "best aiayn / this"]
    rows, goals, backends = [], [], []
    for c in result["configs"]:
        res = c["results"]
        best_name = max((i for i in res if Variant.parse(i).ours), key=lambda i: res[i]["tokens_per_s"], default=None)
        best = res.get(best_name)
        for impl, r in res.items():
            ratio = best["tokens_per_s"] / r["tokens_per_s"] if best and not Variant.parse(impl).ours else None
            rows.append([c["config"], c["lengths"], label(impl), f"{r['tokens_per_s']:,.0f}",
                         f"{r['ms_per_update']:,.1f}", f"{r.get('slowest_over_median', 0):.2f}x",
                         str(r.get("recompiles", "")), f"{r.get('peak_gpu_memory_gib', 0):,.1f}",
                         f"{100 * r['mfu_datasheet']:.1f}%", f"{100 * r['mfu_measured']:.1f}%",
                         f"{ratio:.2f}x" if ratio else ""])
            if r.get("attention") and impl == best_name:
                backends.append(f"- {c['config']}, {c['lengths']}, {label(impl)}: "
                                + ", ".join(f"{k} {v}" for k, v in r["attention"].items()))
        if best:
            goal = MFU_GOALS.get(c["config"])
            if goal:
                goals.append(f"- {c['config']}, {c['lengths']} lengths: best aiayn ({label(best_name)}) MFU = "
                             f"{common.goal_cell(100 * best['mfu_datasheet'], goal, '%')}")
            for peer, want in PEER_GOALS.items():
                if peer in res:
                    goals.append(f"- {c['config']}, {c['lengths']}: best aiayn / {label(peer)} tokens/s = "
                                 f"{common.goal_cell(best['tokens_per_s'] / res[peer]['tokens_per_s'], want)}")
    lines.append(common.markdown_table(headers, rows))
    if goals:
        lines.append("Goals (issue 59: on the WMT-like lengths paper-big >= 40% and paper-base >= 22% MFU of 989 "
                     "TFLOP/s; >= 1.5x HF Marian eager and torch.nn.Transformer, >= 1.2x Marian compiled):\n")
        lines += goals
    if backends:
        lines.append("\nAttention backends of the best aiayn variant (`aiayn.engine.attention_backends`):\n")
        lines += backends
    if a.get("profile"):
        lines.append(f"\ntorch.profiler tables (top kernels by GPU time, two updates per implementation): "
                     f"`{a['profile']}`.")
    return "\n".join(lines) + "\n"


def _variant(name: str) -> str:
    try:
        Variant.parse(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_throughput", description=__doc__.split("\n")[0])
    common.add_training_args(p)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), type=_variant,
                   help="implementations, each a row: aiayn, aiayn-compile, hf-marian, hf-marian-compile, torch-nn; "
                        "aiayn's with levers: aiayn+cast+fused-loss+fuse-norms+cudnn (benchmarks/train_peers.py)")
    p.add_argument("--compile-mode", default="default", choices=list(COMPILE_MODES),
                   help="torch.compile mode of aiayn-compile (train.compile_mode)")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="torch.compile backend of the compiled variants (aot_eager / eager: a CPU dry run of the "
                        "GPU rows without inductor's C++ build)")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run every implementation in this process (faster; memory not comparable)")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}[_cuda].json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--worker-batches", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    common.apply_smoke(args)
    return args


def run_config(args: argparse.Namespace, preset: str, lengths: str, threads: int, peak: float | None) -> dict:
    """Every implementation of one configuration on one length distribution."""
    cfg = bench_config(preset, args.dropout)
    batches, data_what = make_batches(args, cfg.vocab_size, args.warmup + args.steps, lengths)
    diffs = logits_agreement(cfg, args.impls, batches[0], args.seed)
    for impl, d in diffs.items():
        if d > 1e-3:
            raise SystemExit(f"{impl} does not compute aiayn's logits (max diff {d:.2e}): not the same model")
    timed = batches[args.warmup:]
    model_flops = sum(flops.batch_training_flops(cfg, b) for b in timed)
    entry = {"config": preset, "lengths": lengths, "data": data_what, "model": dataclasses.asdict(cfg),
             "logit_diff": diffs, "results": {}, "model_flops_timed": model_flops,
             "mean_batch_target_tokens": sum(b.ntokens for b in batches) / len(batches)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "batches.pt"
        common.save_batches(batches, path)
        for impl in args.impls:
            print(f"[{NAME}] {preset} ({lengths}): {impl} ...", file=sys.stderr, flush=True)
            if args.isolate:
                r = run_isolated(impl, cfg, path, args, threads)
            else:
                r = run_worker(impl, cfg, batches, args, threads)
            achieved = model_flops / r["seconds"]
            r["mfu_datasheet"] = achieved / flops.DATASHEET_PEAK_FLOPS
            r["mfu_measured"] = achieved / peak if peak else None
            mem = f", peak GPU memory {r['peak_gpu_memory_gib']:.1f} GiB" if "peak_gpu_memory_gib" in r else ""
            mfu = (f", MFU {100 * r['mfu_datasheet']:.1f}% of 989 TFLOP/s, {100 * r['mfu_measured']:.1f}% of the "
                   f"measured peak" if peak else "")
            print(f"[{NAME}] {preset} ({lengths}): {impl} {r['tokens_per_s']:,.0f} target tokens/s{mfu}{mem}",
                  file=sys.stderr)
            if r.get("profile"):
                print(r.pop("profile"), file=sys.stderr)
            entry["results"][impl] = r
    return entry


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = common.resolve_run_device(args)
    threads = common.set_threads(args.threads)
    if args.worker:  # one implementation in a fresh process (see run_isolated)
        cfg = ModelConfig(**json.loads(Path(args.worker_config).read_text()))
        out = run_worker(args.worker, cfg, common.load_batches(args.worker_batches), args, threads)
        common.write_json(args.worker_result, out)
        return out

    accelerator = device.type != "cpu"
    # On a CPU, --precision bf16 measures fp32 first in the same run (the speed-up is the point, and this machine's
    # speed drifts between runs), into a section of its own.
    passes = ["fp32", "bf16"] if not accelerator and args.precision == "bf16" else [args.precision]
    section = f"{NAME}_{device.type}" if accelerator else NAME if passes == ["fp32"] else f"{NAME}_cpu_bf16"
    result: dict[str, Any] = {
        "benchmark": section, "date": common.utc_now(), "command": command or common.command_line(NAME, argv),
        "machine": common.machine_info(threads), "args": vars(args), "configs": [],
    }
    peak = None
    if accelerator:
        print(f"[{NAME}] measuring the {args.precision} matmul peak of {device} ...", file=sys.stderr, flush=True)
        dtype = DTYPES[args.precision]
        measured = flops.matmul_peak(flops.CUDA_PEAK_SIZES if not args.smoke else (256,), 5, device, dtype)
        result["peak"] = {**measured, "sizes": list(measured["per_size"])}
        peak = measured["flops_per_s"]
    for q in passes:
        args.precision = q
        for preset in args.configs:
            for lengths in ([None] if args.run_dir else args.lengths):
                entry = run_config(args, preset, lengths or "multi30k", threads, peak)
                entry["precision"] = q
                if args.run_dir:
                    entry["lengths"] = "Multi30k (tokenized)"
                result["configs"].append(entry)
    first = result["configs"][0] if result["configs"] else {}
    result["data"] = first.get("data")
    result["mean_batch_target_tokens"] = first.get("mean_batch_target_tokens")
    result["dropout"] = first["model"]["dropout"] if first else None
    common.write_json(args.out_json or common.RESULTS_DIR / f"{section}.json", result)
    common.update_section(args.md, section, markdown_accelerator(result) if accelerator else markdown(result))
    return result


if __name__ == "__main__":
    main()
