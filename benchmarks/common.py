"""What the benchmark entry points share: the machine and versions they ran on, the environment of the processes
they start, JSON output, their sections of BENCHMARKS.md and the training batches (the re-layout that lets a model
trained with the paper's interleaved sinusoids run as a Hugging Face Marian model is
aiayn.interop.marian.concat_layout_copy).

Shapes: B batch, S source length, T target length, D model width, V vocabulary.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import random
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aiayn.cpu_probe import cpu_flags, cpu_model
from aiayn.data.batching import Batch, batch_shape, collate, token_batches

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MD = REPO / "BENCHMARKS.md"
RESULTS_DIR = REPO / "benchmarks" / "results"
SECTION_ORDER = ("train_throughput", "train_throughput_cpu_bf16", "translate_speed", "mfu", "train_throughput_cuda",
                 "mfu_cuda")

MD_HEADER = """\
# Benchmarks

aiayn measured side by side with what users would pick instead, in one run on one machine, by the
scripts in [`benchmarks/`](benchmarks/README.md). Each section below is rewritten by its script and says
when, on what machine, with which versions and by which command it was measured; the JSON beside it is
in `benchmarks/results/`. Regenerate everything with `python -m benchmarks.run_all`.

## GPU

`python -m benchmarks.run_all --gpu` measures training on one CUDA GPU in bf16 (sections
`train_throughput_cuda` and `mfu_cuda`, added by that command); where they are absent, no GPU number
has been measured.
"""


# Command line shared by the training benchmarks -------------------------------------------------------


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The options of the training benchmarks (train_throughput, mfu): which models, on which batches and
    device, how many updates, and where the results go."""
    p.add_argument("--configs", nargs="+", default=["paper-base", "small"], help="model presets (configs/*.yaml)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: cpu)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="autocast precision of the forward pass (bf16 / fp16 need CUDA)")
    p.add_argument("--run-dir", help="a run whose tokenizer tokenizes Multi30k train (default: synthetic pairs)")
    p.add_argument("--lengths", nargs="+", default=["multi30k"], choices=list(LENGTH_DISTRIBUTIONS),
                   help="length distribution(s) of the synthetic pairs, each measured in turn")
    p.add_argument("--pairs", type=int, help="use the first N pairs (default: all 29,000)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="token budget of a batch, as data.max_tokens (default: 4096 on CPU, 25000 on CUDA)")
    p.add_argument("--pad-to-multiple", type=int, default=1,
                   help="pad batch lengths to a multiple, as data.pad_to_multiple (default: 1, no extra padding)")
    p.add_argument("--warmup", type=int, default=2, help="untimed updates")
    p.add_argument("--steps", type=int, default=5, help="timed updates")
    p.add_argument("--dropout", type=float, default=None, help="override the presets' dropout (0.1)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per core)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", help="append torch.profiler tables (top operators / kernels) to this file")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run on a tiny model (CI)")
    p.add_argument("--md", default=str(DEFAULT_MD), help="markdown file whose section is rewritten")


def apply_smoke(args: argparse.Namespace) -> None:
    """``--smoke``: the tiny model, 1 warm-up + 2 timed updates on 200 pairs in 256-token batches."""
    if args.smoke:
        args.configs, args.warmup, args.steps = ["smoke"], 1, 2
        args.max_tokens, args.pairs = 256, args.pairs or 200


def resolve_run_device(args: argparse.Namespace) -> torch.device:
    """Check ``--device`` / ``--precision`` before any work (one clear line if they cannot run here) and
    fill the device-dependent default of ``--max-tokens``."""
    from aiayn.device import resolve_device, resolve_precision
    from aiayn.errors import DeviceError

    try:
        device = resolve_device(args.device)
        resolve_precision(args.precision, device, training=True)
    except DeviceError as e:
        raise SystemExit(f"benchmark: error: {e}") from None
    cuda = device.type == "cuda"
    if args.max_tokens is None:
        args.max_tokens = 25000 if cuda else 4096  # the paper's per-step budget on GPUs
    args.device = str(device)
    return device


# Machine, versions, provenance -----------------------------------------------------------------------


def set_threads(n: int | None) -> int:
    """Use ``n`` intra-op threads (None: one per core) and return the number used."""
    n = n or os.cpu_count() or 1
    # Only when it changes something: on torch 2.13's CPU build an explicit set_num_threads, even to the
    # default, made the fused attention kernel (HF's and torch.nn's default) slower (benchmarks.cpu_kernels).
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict[str, Any]:
    """Where and with what a benchmark ran (goes into every JSON and markdown section)."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_flags": list(cpu_flags()),  # the ones that decide kernels: AVX2/512, VNNI, bf16, AMX (aiayn.cpu_probe)
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "ctranslate2": package_version("ctranslate2"),
        "aiayn": package_version("aiayn"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
        "gpu_memory_gib": (round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
                           if torch.cuda.is_available() else None),
    }


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def child_env(**extra: str) -> dict[str, str]:
    """This process' environment with this repository first on PYTHONPATH (what was there stays: carried wheels)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces a run: ``python -m benchmarks.<module> <argv>``."""
    return " ".join(["python -m benchmarks." + module, shlex.join(list(argv))]).strip()


def provenance(info: dict[str, Any], command: str, date: str) -> str:
    """Markdown lines naming date, command, machine and versions."""
    versions = ", ".join(f"{k} {info[k]}" for k in ("python", "torch", "cuda", "transformers", "ctranslate2",
                                                     "aiayn") if info.get(k))
    return (
        f"- Date: {date}\n"
        f"- Command: `{command}`\n"
        f"- Machine: {info['platform']}; CPU: {info['cpu']}"
        + (f" ({', '.join(info['cpu_flags'])})" if info.get("cpu_flags") else "")
        + f", {info['cores']} cores, {info['threads']} threads used; GPU: {info['gpu'] or 'none'}\n"
        f"- Versions: {versions}\n"
    )


def check_outputs(parser: argparse.ArgumentParser, md: str | None, out_json: str | None) -> None:
    """Refuse, in one argparse line (exit 2) before any work, a ``--md`` that is not a .md file or an ``--out-json``
    that is not a .json file: each is rewritten (``--out-json BENCHMARKS.md`` would replace it with JSON)."""
    wrong_md = md is not None and not str(md).endswith(".md")
    if wrong_md or (out_json is not None and not str(out_json).endswith(".json")):
        parser.error("--md takes a .md file and --out-json a .json file (each is rewritten)")


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return "" if x is None else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def goal_cell(value: float | None, goal: float, unit: str = "x") -> str:
    """``2.31x (goal >= 1.5x: met)``; '-' when the value could not be measured."""
    if value is None:
        return "-"
    fmt = (lambda v: f"{v:.1f}%") if unit == "%" else (lambda v: f"{v:.2f}x")
    verdict = "met" if value >= goal else "short"
    return f"{fmt(value)} (goal >= {fmt(goal)}: {verdict})"


def _markers(key: str) -> tuple[str, str]:
    return f"<!-- BEGIN {key} -->", f"<!-- END {key} -->"


def update_section(md_path: str | os.PathLike, key: str, body: str) -> Path:
    """Replace (or add, in :data:`SECTION_ORDER`) the section ``key`` of the markdown file, leaving the
    rest of the file as it is. A missing file starts with :data:`MD_HEADER`."""
    path = Path(md_path)
    text = path.read_text(encoding="utf-8") if path.exists() else MD_HEADER
    begin, end = _markers(key)
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        # Insert before the first later section that is present, else at the end.
        later = SECTION_ORDER[SECTION_ORDER.index(key) + 1:] if key in SECTION_ORDER else ()
        at = min((text.index(_markers(k)[0]) for k in later if _markers(k)[0] in text), default=None)
        if at is None:
            text = text.rstrip() + "\n\n" + block + "\n"
        else:
            text = text[:at] + block + "\n\n" + text[at:]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


# Training batches -----------------------------------------------------------------------------------

# Multi30k En-De train (29,000 pairs) tokenized with an 8k shared SentencePiece BPE: 14.3 +- 4.8
# source and 14.8 +- 5.5 target tokens per sentence (without EOS / BOS), target/source 1.04 +- 0.19.
# Synthetic batches draw their lengths from these.
SYNTHETIC_SRC_MEAN, SYNTHETIC_SRC_SD = 14.3, 4.8
SYNTHETIC_TGT_RATIO, SYNTHETIC_TGT_SD = 1.04, 0.19

# WMT14 En-De-like lengths (no WMT corpus is used here; these are chosen, not measured on WMT): source
# lengths log-normal with mean 27 and standard deviation 15 tokens (the figures issue 20 quotes for a 37k
# BPE), i.e. log-length ~ N(3.161, 0.519), cut to [1, 128]; target = source x N(1.0, 0.2), also within
# [1, 128]. 200,000 draws (seed 1): source 27.0 +- 15.0 tokens (median 24, 99th percentile 80, 1 in ~2,200
# at 128), target 27.0 +- 16.1.
WMT_LOG_MEAN, WMT_LOG_SD, WMT_MAX_LEN = 3.161, 0.519, 128
WMT_TGT_RATIO, WMT_TGT_SD = 1.0, 0.2

LENGTH_DISTRIBUTIONS = {
    "multi30k": f"Multi30k's token lengths ({SYNTHETIC_SRC_MEAN} +- {SYNTHETIC_SRC_SD} source tokens, "
                f"target/source {SYNTHETIC_TGT_RATIO} +- {SYNTHETIC_TGT_SD})",
    "wmt": f"WMT14 En-De-like lengths (source log-normal, mean 27 +- 15 tokens, at most {WMT_MAX_LEN}; "
           f"target/source {WMT_TGT_RATIO} +- {WMT_TGT_SD})",
}


def multi30k_token_pairs(run_dir: str | os.PathLike, split: str = "train",
                         limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(source ids, target ids) of a Multi30k split, tokenized with the run's tokenizer (its languages)."""
    from aiayn.config import load_config
    from aiayn.data.datasets import multi30k_split
    from aiayn.data.tokenizer import TokenizerPair

    run_dir = Path(run_dir)
    data = load_config(run_dir / "config.yaml").data
    tok = TokenizerPair.load(run_dir / "tokenizer")
    pairs = multi30k_split(split, data.src_lang, data.tgt_lang)[:limit]
    return [(tok.src.encode(s), tok.tgt.encode(t)) for s, t in pairs]


def synthetic_lengths(n: int, seed: int = 1, lengths: str = "multi30k", max_len: int = 64) -> list[tuple[int, int]]:
    """``n`` (source, target) lengths from a distribution of :data:`LENGTH_DISTRIBUTIONS`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if lengths == "wmt":
            s = min(WMT_MAX_LEN, max(1, round(rng.lognormvariate(WMT_LOG_MEAN, WMT_LOG_SD))))
            t = min(WMT_MAX_LEN, max(1, round(s * rng.gauss(WMT_TGT_RATIO, WMT_TGT_SD))))
        elif lengths == "multi30k":
            s = min(max_len, max(2, round(rng.gauss(SYNTHETIC_SRC_MEAN, SYNTHETIC_SRC_SD))))
            t = min(max_len, max(2, round(s * rng.gauss(SYNTHETIC_TGT_RATIO, SYNTHETIC_TGT_SD))))
        else:
            raise ValueError(f"unknown length distribution {lengths!r} (known: {', '.join(LENGTH_DISTRIBUTIONS)})")
        out.append((s, t))
    return out


def synthetic_token_pairs(n: int, vocab_size: int, seed: int = 1, max_len: int = 64,
                          lengths: str = "multi30k") -> list[tuple[list[int], list[int]]]:
    """``n`` random pairs whose lengths follow ``lengths`` (see above); ids in [4, V)."""
    ids = random.Random(seed + 1)  # the same lengths whatever the vocabulary
    return [([ids.randrange(4, vocab_size) for _ in range(s)], [ids.randrange(4, vocab_size) for _ in range(t)])
            for s, t in synthetic_lengths(n, seed, lengths, max_len)]


def training_batches(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_tokens: int, count: int,
                     seed: int = 1, pad_to_multiple: int = 1) -> list[Batch]:
    """``count`` length-bucketed batches of at most ``max_tokens`` (as aiayn training makes them), in a
    seeded random order; cycles through the epoch if it has fewer batches. ``pad_to_multiple`` > 1 pads
    S and T as ``data.pad_to_multiple`` does (the budget then counts the padded lengths)."""
    src_lens, tgt_lens = [len(s) for s, _ in pairs], [len(t) for _, t in pairs]
    groups = token_batches(src_lens, tgt_lens, max_tokens, seed=seed, pad_to_multiple=pad_to_multiple)
    picked = [groups[i % len(groups)] for i in range(count)]
    out = []
    for g in picked:
        shape = None
        if pad_to_multiple > 1:
            shape = batch_shape([src_lens[i] + 1 for i in g], [tgt_lens[i] + 1 for i in g], max_tokens,
                                pad_to_multiple)
        out.append(collate([pairs[i][0] for i in g], [pairs[i][1] for i in g], g, shape=shape))
    return out


def save_batches(batches: Sequence[Batch], path: str | os.PathLike) -> None:
    torch.save([{"src": b.src, "tgt_in": b.tgt_in, "tgt_out": b.tgt_out, "ntokens": b.ntokens} for b in batches],
               path)


def load_batches(path: str | os.PathLike) -> list[Batch]:
    return [Batch(d["src"], d["tgt_in"], d["tgt_out"], int(d["ntokens"]), [])
            for d in torch.load(path, weights_only=True)]


@torch.no_grad()
def max_logit_diff(a: Any, b: Any, src: Tensor, tgt_in: Tensor) -> float:
    """max |logits_a - logits_b| of two callables ``f(src (B, S), tgt_in (B, T)) -> (B, T, V)`` at
    the real (non-pad) target positions."""
    keep = (tgt_in != 0).unsqueeze(-1)
    return float(((a(src, tgt_in) - b(src, tgt_in)).abs() * keep).max())
