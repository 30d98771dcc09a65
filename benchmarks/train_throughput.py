"""Benchmark 1: training throughput (target tokens/s) and peak memory, fp32 on CPU.

Three implementations of the same architecture (the paper's post-LN Transformer, shared and tied
embeddings, sinusoidal positions, ReLU), built from the same initial weights and checked to compute
the same logits before anything is timed:

* ``aiayn``      aiayn.Transformer
* ``hf-marian``  Hugging Face ``MarianMTModel`` (converted with aiayn.interop.marian.to_hf_marian)
* ``torch-nn``   embeddings + sinusoids + ``torch.nn.Transformer(batch_first=True, norm_first=False)``
                 (final encoder/decoder LayerNorms removed, dropout only where the paper has it)
                 + the tied output projection

Every update goes through the same code, ``aiayn.train.trainer.train_update``: forward, our
label-smoothed cross entropy (eps 0.1) on the logits, backward, Adam(0.9, 0.98, 1e-9). So the work
per update is equal and only the model differs. Each implementation runs W warm-up and N timed
updates on the same sequence of length-bucketed batches (Multi30k train pairs tokenized with a run's
tokenizer, or synthetic pairs with Multi30k's lengths), in its own process so that its peak resident
memory (``ru_maxrss``) is its own.

    python -m benchmarks.train_throughput --run-dir runs/multi30k_en_de_quick
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
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig, TrainConfig, model_config
from aiayn.data.batching import Batch
from aiayn.model.embeddings import sinusoidal_table
from aiayn.model.transformer import Transformer
from aiayn.train.schedule import build_optimizer
from aiayn.train.trainer import train_update
from benchmarks import common

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


def build_impl(impl: str, cfg: ModelConfig, seed: int = 1) -> nn.Module:
    """The implementation ``impl`` with the initial weights of ``Transformer(cfg)`` under ``seed``."""
    torch.manual_seed(seed)
    ours = Transformer(cfg)
    if impl == "aiayn":
        return ours
    if impl == COMPILED:
        return torch.compile(ours, dynamic=True)  # batch shapes vary: one graph for all of them
    if impl == "hf-marian":
        from aiayn.interop.marian import to_hf_marian

        return HFMarianSeq2Seq(to_hf_marian(ours), cfg.pad_id)
    if impl == "torch-nn":
        return TorchNNTransformer.from_aiayn(ours)
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


def make_batches(args: argparse.Namespace, vocab_size: int, count: int) -> tuple[list[Batch], str]:
    """The shared batches and a sentence describing them."""
    if args.run_dir:
        pairs = common.multi30k_token_pairs(args.run_dir, "train", limit=args.pairs)
        top = max(max(max(s, default=0), max(t, default=0)) for s, t in pairs)
        if top >= vocab_size:
            raise SystemExit(f"the run's tokenizer has ids up to {top}, above the model vocabulary {vocab_size}")
        what = f"Multi30k train pairs tokenized with the tokenizer of `{args.run_dir}`"
    else:
        pairs = common.synthetic_token_pairs(args.pairs or 29000, vocab_size, seed=args.seed)
        what = (f"synthetic pairs (random ids) with Multi30k's token lengths ({common.SYNTHETIC_SRC_MEAN} +- "
                f"{common.SYNTHETIC_SRC_SD} source tokens, target/source {common.SYNTHETIC_TGT_RATIO})")
    batches = common.training_batches(pairs, args.max_tokens, count, seed=args.seed)
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


def time_training(model: nn.Module, batches: Sequence[Batch], warmup: int, seed: int = 1) -> dict[str, Any]:
    """W = ``warmup`` untimed then len(batches) - W timed updates through ``train_update``."""
    model.train()
    optimizer = build_optimizer(model, TrainConfig())
    torch.manual_seed(seed)  # reproducible dropout

    def update(b: Batch) -> None:
        train_update(model, optimizer, [b], LR, LABEL_SMOOTHING, pad_id=0)

    for b in batches[:warmup]:
        update(b)
    steps = []
    for b in batches[warmup:]:
        t0 = time.perf_counter()
        update(b)
        steps.append(time.perf_counter() - t0)
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


def run_worker(impl: str, cfg: ModelConfig, batches: Sequence[Batch], warmup: int, threads: int,
               seed: int) -> dict[str, Any]:
    """Build ``impl`` and time it; training memory is the peak RSS minus the RSS before the model is built."""
    common.set_threads(threads)
    # One throwaway update of a tiny model of the same kind first, so that library code loaded on first
    # use (transformers modules, autograd and optimizer paths) is in the baseline, not in the peak.
    primer_cfg = bench_config("smoke")
    primer_data = common.training_batches(common.synthetic_token_pairs(4, primer_cfg.vocab_size), 64, 1)
    time_training(build_impl("aiayn" if impl == COMPILED else impl, primer_cfg, seed), primer_data, 0, seed)
    gc.collect()
    base = current_rss_mib()
    model = build_impl(impl, cfg, seed)
    out = time_training(model, batches, warmup, seed)
    out.update(impl=impl, rss_before_model_mib=base, peak_rss_mib=peak_rss_mib())
    out["training_memory_mib"] = out["peak_rss_mib"] - base
    if impl == "hf-marian":
        out["hf_attn_implementation"] = getattr(model.hf.config, "_attn_implementation", None)
    return out


def run_isolated(impl: str, cfg: ModelConfig, batches_path: Path, warmup: int, threads: int,
                 seed: int) -> dict[str, Any]:
    """:func:`run_worker` in a fresh interpreter, so ``ru_maxrss`` is this implementation's alone."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, result = Path(tmp) / "cfg.json", Path(tmp) / "result.json"
        cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
        cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--worker", impl, "--worker-config",
               str(cfg_path), "--worker-batches", str(batches_path), "--worker-result", str(result),
               "--warmup", str(warmup), "--threads", str(threads), "--seed", str(seed)]
        subprocess.run(cmd, check=True, cwd=common.REPO)
        return json.loads(result.read_text())


@torch.no_grad()
def logits_agreement(cfg: ModelConfig, impls: Sequence[str], batch: Batch, seed: int) -> dict[str, float]:
    """max |logits - aiayn's| per implementation, eval mode, on the first 4 sentences of ``batch``."""
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
        "Adam, all through `aiayn.train.trainer.train_update`, so only the model differs; dropout "
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
            rows.append([c["config"], LABELS[impl], f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_update']:,.0f}", *mem,
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


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_throughput", description=__doc__.split("\n")[0])
    common.add_training_args(p)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS) + [COMPILED])
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run every implementation in this process (faster; memory not comparable)")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--worker-batches", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    common.apply_smoke(args)
    return args


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    if args.worker:  # one implementation in a fresh process (see run_isolated)
        cfg = ModelConfig(**json.loads(Path(args.worker_config).read_text()))
        out = run_worker(args.worker, cfg, common.load_batches(args.worker_batches), args.warmup, threads, args.seed)
        common.write_json(args.worker_result, out)
        return out

    result: dict[str, Any] = {
        "benchmark": NAME, "date": common.utc_now(), "command": command or common.command_line(NAME, argv),
        "machine": common.machine_info(threads), "args": vars(args), "configs": [],
    }
    data_what = None
    for preset in args.configs:
        cfg = bench_config(preset, args.dropout)
        batches, data_what = make_batches(args, cfg.vocab_size, args.warmup + args.steps)
        diffs = logits_agreement(cfg, args.impls, batches[0], args.seed)
        for impl, d in diffs.items():
            if d > 1e-3:
                raise SystemExit(f"{impl} does not compute aiayn's logits (max diff {d:.2e}): not the same model")
        entry = {"config": preset, "model": dataclasses.asdict(cfg), "logit_diff": diffs, "results": {}}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "batches.pt"
            common.save_batches(batches, path)
            for impl in args.impls:
                print(f"[{NAME}] {preset}: {impl} ...", file=sys.stderr, flush=True)
                if args.isolate:
                    r = run_isolated(impl, cfg, path, args.warmup, threads, args.seed)
                else:
                    r = run_worker(impl, cfg, batches, args.warmup, threads, args.seed)
                print(f"[{NAME}] {preset}: {impl} {r['tokens_per_s']:,.0f} target tokens/s", file=sys.stderr)
                entry["results"][impl] = r
        result["configs"].append(entry)
        result["mean_batch_target_tokens"] = sum(b.ntokens for b in batches) / len(batches)
    result["data"] = data_what
    result["dropout"] = result["configs"][0]["model"]["dropout"] if result["configs"] else None
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    common.update_section(args.md, NAME, markdown(result))
    return result


if __name__ == "__main__":
    main()
