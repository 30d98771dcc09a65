"""Benchmark 1: training throughput (target tokens/s) and peak memory: fp32 on CPU, or bf16 / fp16 on a GPU.

Three implementations of the same architecture (the paper's post-LN Transformer, shared and tied
embeddings, sinusoidal positions, ReLU), built from the same initial weights and checked to compute
the same logits before anything is timed:

* ``aiayn``      aiayn.Transformer
* ``hf-marian``  Hugging Face ``MarianMTModel`` (converted with aiayn.interop.marian.to_hf_marian)
* ``torch-nn``   embeddings + sinusoids + ``torch.nn.Transformer(batch_first=True, norm_first=False)``
                 (final encoder/decoder LayerNorms removed, dropout only where the paper has it)
                 + the tied output projection
* ``aiayn-compile`` (optional) aiayn.Transformer and its loss under ``torch.compile``, as ``train.compile``

Every update goes through the same code, ``aiayn.train.update.Update``: forward, our
label-smoothed cross entropy (eps 0.1) on the logits, backward, Adam(0.9, 0.98, 1e-9). So the work
per update is equal and only the model differs. Each implementation runs W warm-up and N timed
updates on the same sequence of length-bucketed batches (Multi30k train pairs tokenized with a run's
tokenizer, or synthetic pairs with Multi30k's or WMT14-like lengths), in its own process so that its peak
memory (``ru_maxrss``; on CUDA ``torch.cuda.max_memory_allocated``) is its own. On a GPU it also prints
MFU against the 989 TFLOP/s datasheet peak and against a matmul peak measured in the same run.

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
import math
import resource
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import COMPILE_MODES, Config, ModelConfig, TrainConfig, model_config
from aiayn.data.batching import Batch
from aiayn.device import DTYPES, autocast_context
from aiayn.engine import kernels, prepare_model
from aiayn.model.embeddings import sinusoidal_table
from aiayn.model.transformer import Transformer
from aiayn.train.loss import label_smoothed_cross_entropy
from aiayn.train.schedule import build_optimizer
from aiayn.train.update import LossFn, Update, batch_to_device, compile_for_training
from benchmarks import common, flops

NAME = "train_throughput"
IMPLS = ("aiayn", "hf-marian", "torch-nn")
COMPILED = "aiayn-compile"
LABELS = {
    "aiayn": "aiayn",
    COMPILED: "aiayn + torch.compile",
    "hf-marian": "HF MarianMTModel",
    "torch-nn": "torch.nn.Transformer",
}
LABEL_SMOOTHING = 0.1
LR = 1e-4  # any fixed rate: the speed of an update does not depend on it


# The peers ------------------------------------------------------------------------------------------


class HFMarianSeq2Seq(nn.Module):
    """``MarianMTModel`` behind aiayn's ``model(src, tgt_in) -> logits`` interface."""

    def __init__(self, hf: nn.Module, pad_id: int = 0) -> None:
        super().__init__()
        self.hf, self.pad_id = hf, pad_id

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V). No KV cache is kept when training."""
        out = self.hf(input_ids=src, attention_mask=(src != self.pad_id).long(), decoder_input_ids=tgt_in,
                      use_cache=False)
        return out.logits


class TorchNNTransformer(nn.Module):
    """The paper's model on ``torch.nn.Transformer``: scaled shared embedding + sinusoids, post-LN layers,
    tied output projection.

    ``nn.Transformer`` adds a final LayerNorm to both stacks (a pre-LN habit the paper does not have):
    they are removed. Its single ``dropout`` also drops attention probabilities and FFN activations;
    those are set to the config's ``attention_dropout`` / ``activation_dropout`` (0 in the paper), so
    the three implementations drop the same things.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not (cfg.share_embeddings and cfg.tie_output) or cfg.norm_first or cfg.positional != "sinusoidal":
            raise ValueError("TorchNNTransformer builds the paper's shared/tied post-LN sinusoidal model only")
        D = cfg.d_model
        self.pad_id, self.scale = cfg.pad_id, math.sqrt(D) if cfg.scale_embeddings else 1.0
        self.embed = nn.Embedding(cfg.vocab_size, D, padding_idx=cfg.pad_id)
        self.register_buffer("pe", sinusoidal_table(cfg.max_positions, D, cfg.positional_layout), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(
            D, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.d_ff, cfg.dropout,
            activation=cfg.activation if cfg.activation != "swish" else F.silu,
            layer_norm_eps=cfg.layer_norm_eps, batch_first=True, norm_first=False,
        )
        self.transformer.encoder.norm = None
        self.transformer.decoder.norm = None
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.self_attn.dropout = cfg.attention_dropout
            if hasattr(layer, "multihead_attn"):
                layer.multihead_attn.dropout = cfg.attention_dropout
            layer.dropout.p = cfg.activation_dropout

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V)."""
        S, T = src.size(1), tgt_in.size(1)
        pad = src == self.pad_id  # (B, S), True = ignore (nn.Transformer's convention)
        x = self.dropout(self.embed(src) * self.scale + self.pe[:S])
        y = self.dropout(self.embed(tgt_in) * self.scale + self.pe[:T])
        causal = torch.ones(T, T, dtype=torch.bool, device=src.device).triu(1)  # True = may not attend
        h = self.transformer(x, y, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad,
                             tgt_is_causal=True)
        return F.linear(h, self.embed.weight)

    @classmethod
    @torch.no_grad()
    def from_aiayn(cls, ours: Transformer) -> TorchNNTransformer:
        """The same weights as ``ours`` (nn.MultiheadAttention stores Q|K|V rows like aiayn's in_proj)."""
        m = cls(ours.cfg)
        m.embed.weight.copy_(ours.encoder.embed.weight)

        def attn(dst: nn.MultiheadAttention, src: nn.Module) -> None:
            dst.in_proj_weight.copy_(src.in_proj.weight)
            dst.in_proj_bias.copy_(src.in_proj.bias)
            dst.out_proj.weight.copy_(src.out_proj.weight)
            dst.out_proj.bias.copy_(src.out_proj.bias)

        def lin(dst: nn.Module, src: nn.Module) -> None:
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)

        for dst, src in zip(m.transformer.encoder.layers, ours.encoder.layers):
            attn(dst.self_attn, src.self_attn)
            lin(dst.norm1, src.sub_attn.norm)
            lin(dst.linear1, src.ffn.fc1)
            lin(dst.linear2, src.ffn.fc2)
            lin(dst.norm2, src.sub_ffn.norm)
        for dst, src in zip(m.transformer.decoder.layers, ours.decoder.layers):
            attn(dst.self_attn, src.self_attn)
            lin(dst.norm1, src.sub_self.norm)
            attn(dst.multihead_attn, src.cross_attn)
            lin(dst.norm2, src.sub_cross.norm)
            lin(dst.linear1, src.ffn.fc1)
            lin(dst.linear2, src.ffn.fc2)
            lin(dst.norm3, src.sub_ffn.norm)
        return m.train(ours.training)


def build_impl(impl: str, cfg: ModelConfig, seed: int = 1, compile_mode: str = "default") -> nn.Module:
    """The implementation ``impl`` with the initial weights of ``Transformer(cfg)`` under ``seed``."""
    return build_training(impl, cfg, seed, compile_mode)[0]


def build_training(impl: str, cfg: ModelConfig, seed: int = 1, compile_mode: str = "default",
                   device: str | torch.device = "cpu") -> tuple[nn.Module, LossFn]:
    """``impl`` on ``device`` and the loss it trains with: aiayn's loss for all, compiled with the model for
    ``aiayn-compile`` (as ``train.compile: true`` does, :func:`aiayn.train.update.compile_for_training`).
    aiayn's model gets the engine's training choices for the device, as the trainer gives it."""
    torch.manual_seed(seed)
    ours = Transformer(cfg)
    if impl in ("aiayn", COMPILED):
        prepare_model(ours, device, training=True)
    if impl == "aiayn":
        return ours, label_smoothed_cross_entropy
    if impl == COMPILED:
        return compile_for_training(ours, Config(model=cfg, train=TrainConfig(compile=True,
                                                                              compile_mode=compile_mode)))
    if impl == "hf-marian":
        from aiayn.interop.marian import to_hf_marian

        return HFMarianSeq2Seq(to_hf_marian(ours), cfg.pad_id), label_smoothed_cross_entropy
    if impl == "torch-nn":
        return TorchNNTransformer.from_aiayn(ours), label_smoothed_cross_entropy
    raise ValueError(f"unknown implementation {impl!r} (known: {', '.join(IMPLS + (COMPILED,))})")


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
            loss_fn: LossFn = label_smoothed_cross_entropy) -> Callable[[Batch], None]:
    """One training update per call, as aiayn training runs it: the batch copied to the device (pinned,
    non-blocking on CUDA), autocast forward, the loss, backward, Adam (fused on CUDA), a GradScaler for fp16."""
    device = torch.device(device)
    model.to(device).train()
    optimizer = build_optimizer(model, TrainConfig())
    autocast = autocast_context(precision, device)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    step = Update(model, optimizer, LABEL_SMOOTHING, pad_id=0, autocast=autocast, scaler=scaler, loss_fn=loss_fn)

    def update(b: Batch) -> None:
        step([batch_to_device(b, device)], LR)

    return update


def time_training(model: nn.Module, batches: Sequence[Batch], warmup: int, seed: int = 1,
                  device: torch.device | str = "cpu", precision: str = "fp32",
                  loss_fn: LossFn = label_smoothed_cross_entropy) -> dict[str, Any]:
    """W = ``warmup`` untimed then len(batches) - W timed updates through ``aiayn.train.update.Update``."""
    device = torch.device(device)
    update = updater(model, device, precision, loss_fn)
    torch.manual_seed(seed)  # reproducible dropout
    for b in batches[:warmup]:
        update(b)
    steps = [flops.timed(lambda b=b: update(b), device) for b in batches[warmup:]]
    timed = batches[warmup:]
    tokens = sum(b.ntokens for b in timed)
    seconds = sum(steps)
    return {
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "seconds": seconds,
        "target_tokens": tokens,
        "source_tokens": sum(int((b.src != 0).sum()) for b in timed),
        "tokens_per_s": tokens / seconds,
        "ms_per_update": 1000 * seconds / len(timed),
        "step_seconds": steps,
    }


def profile_updates(update: Callable[[Batch], None], batches: Sequence[Batch], device: torch.device, path: Path,
                    title: str, rows: int = 25) -> str:
    """torch.profiler's table of two updates (after one untimed), the top ``rows`` operators by self
    device time on CUDA (kernels) or self CPU time; appended to ``path`` and returned. The updates run with the
    timed ones' attention backends (:func:`aiayn.engine.kernels`): outside it, PyTorch's default picks cuDNN's
    attention on Hopper, which the timed updates never use (the first H200 profile had it)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with kernels(device):
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
    compile_mode, profile = args.compile_mode, args.profile
    common.set_threads(threads)
    dev = torch.device(device)
    # One throwaway update of a tiny model of the same kind first, so that library code loaded on first
    # use (transformers modules, autograd and optimizer paths, CUDA kernels) is in the baseline, not the peak.
    primer_cfg = bench_config("smoke")
    primer_data = common.training_batches(common.synthetic_token_pairs(4, primer_cfg.vocab_size), 64, 1)
    primer = build_impl("aiayn" if impl == COMPILED else impl, primer_cfg, seed)
    time_training(primer, primer_data, 0, seed, dev, precision)
    del primer
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    base = current_rss_mib()
    model, loss_fn = build_training(impl, cfg, seed, compile_mode, dev)
    with kernels(dev):  # the same attention backends for every implementation
        out = time_training(model, batches, warmup, seed, dev, precision, loss_fn)
    out.update(impl=impl, rss_before_model_mib=base, peak_rss_mib=peak_rss_mib())
    out["training_memory_mib"] = out["peak_rss_mib"] - base
    if dev.type == "cuda":
        out["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if impl == "hf-marian":
        out["hf_attn_implementation"] = getattr(model.hf.config, "_attn_implementation", None)
    if profile:
        title = f"{cfg.d_model}x{cfg.n_encoder_layers}+{cfg.n_decoder_layers} {LABELS[impl]}, {device}, {precision}"
        out["profile"] = profile_updates(updater(model, dev, precision, loss_fn), batches[warmup:], dev,
                                         Path(profile), title)
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
               "--device", args.device, "--precision", args.precision, "--compile-mode", args.compile_mode]
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
        if impl in ("aiayn", COMPILED):
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
    lines = [
        "## 1. Training throughput and memory (fp32, CPU)\n",
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
            name = c["config"] + (f" ({c['lengths']} lengths)" if c.get("lengths") == "wmt" else "")
            rows.append([name, LABELS[impl], f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_update']:,.0f}", *mem,
                         f"{ratio:.2f}x" if ratio else "", f"{diff:.1e}" if diff is not None else ""])
        hf = c["results"].get("hf-marian")
        if ours and hf:
            goals.append(f"- {c['config']}: aiayn / HF Marian tokens/s = "
                         f"{common.goal_cell(ours['tokens_per_s'] / hf['tokens_per_s'], 1.5)}")
    lines.append(common.markdown_table(headers, rows))
    if goals:
        lines.append("Goal (training >= 1.5x Hugging Face Marian tokens/s):\n")
        lines += goals
    return "\n".join(lines) + "\n"


MFU_GOALS = {"paper-base": 40.0, "paper-big": 50.0}  # % of the datasheet peak, issue 20


def markdown_accelerator(result: dict[str, Any]) -> str:
    """The section of a run on an accelerator: tokens/s, MFU against the datasheet and the measured peak,
    peak GPU memory, per implementation, configuration and length distribution."""
    a, peak = result["args"], result["peak"]
    lines = [
        f"## Training throughput on {result['machine']['gpu'] or a['device']} ({a['precision']})\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- Work: one update = batch copy to the GPU + {a['precision']} autocast forward + label-smoothed "
        f"cross entropy (eps {LABEL_SMOOTHING}) + backward + Adam (fused), all through "
        "`aiayn.train.update.Update`; the cuDNN attention backend off for every implementation "
        "(`aiayn.engine.kernels`); `aiayn + torch.compile` compiles the model and the loss as "
        f"`train.compile: true` does (mode {a['compile_mode']}).",
        f"- Data: batches of <= {a['max_tokens']} tokens (padded lengths counted), the same batches in the "
        f"same order for every implementation; {a['warmup']} warm-up + {a['steps']} timed updates.",
        f"- MFU = model FLOPs (3 x forward matmul FLOPs at the real lengths, `benchmarks/flops.py`) per second "
        f"over the {flops.DATASHEET_PEAK_NAME}, and over the best {peak['dtype']} `torch.mm` measured in this "
        f"run ({peak['flops_per_s'] / 1e12:,.0f} TFLOP/s, n = {', '.join(map(str, peak['sizes']))}).",
        "- Peak GPU memory: `torch.cuda.max_memory_allocated` while the implementation trains, each in its own "
        "process (model, gradients, Adam state, activations).\n",
    ]
    headers = ["config", "lengths", "implementation", "target tokens/s", "ms / update", "peak GPU memory (GiB)",
               "MFU (989 TFLOP/s)", "MFU (measured peak)", "aiayn / this"]
    rows, goals = [], []
    for c in result["configs"]:
        ours = c["results"].get("aiayn")
        best = max((c["results"][i] for i in ("aiayn", COMPILED) if i in c["results"]),
                   key=lambda r: r["tokens_per_s"], default=None)
        for impl, r in c["results"].items():
            ratio = best["tokens_per_s"] / r["tokens_per_s"] if best and impl not in ("aiayn", COMPILED) else None
            rows.append([c["config"], c["lengths"], LABELS[impl], f"{r['tokens_per_s']:,.0f}",
                         f"{r['ms_per_update']:,.1f}", f"{r.get('peak_gpu_memory_gib', 0):,.1f}",
                         f"{100 * r['mfu_datasheet']:.1f}%", f"{100 * r['mfu_measured']:.1f}%",
                         f"{ratio:.2f}x" if ratio else ""])
        if best and ours:
            goal = MFU_GOALS.get(c["config"])
            if goal:
                goals.append(f"- {c['config']}, {c['lengths']} lengths: best aiayn MFU = "
                             f"{common.goal_cell(100 * best['mfu_datasheet'], goal, '%')}")
            for peer in ("hf-marian", "torch-nn"):
                if peer in c["results"]:
                    goals.append(f"- {c['config']}, {c['lengths']}: best aiayn / {LABELS[peer]} tokens/s = "
                                 f"{common.goal_cell(best['tokens_per_s'] / c['results'][peer]['tokens_per_s'], 1.5)}")
    lines.append(common.markdown_table(headers, rows))
    if goals:
        lines.append("Goals (issue 20: paper-big >= 50% and paper-base >= 40% MFU of 989 TFLOP/s on the WMT-like "
                     "lengths; >= 1.5x HF Marian and torch.nn.Transformer):\n")
        lines += goals
    if a.get("profile"):
        lines.append(f"\ntorch.profiler tables (top kernels by GPU time, two updates per implementation): "
                     f"`{a['profile']}`.")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_throughput", description=__doc__.split("\n")[0])
    common.add_training_args(p)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS) + [COMPILED])
    p.add_argument("--compile-mode", default="default", choices=list(COMPILE_MODES),
                   help="torch.compile mode of aiayn-compile (train.compile_mode)")
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
    section = f"{NAME}_{device.type}" if accelerator else NAME
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
    for preset in args.configs:
        for lengths in ([None] if args.run_dir else args.lengths):
            entry = run_config(args, preset, lengths or "multi30k", threads, peak)
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
