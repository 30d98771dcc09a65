"""Benchmark 2: translation speed, beam 4, the same weights in every engine, on the CPU or a GPU.

Engines, all given one trained run's weights:

* ``aiayn``        aiayn.search.beam_search, stop='hf' (Hugging Face's stopping rule, so its
                   output must equal ``generate()``'s token for token)
* ``aiayn-exact``  the same with stop='exact' (the default of ``aiayn translate``: never stops before
                   the best hypothesis is certain, so it may run more steps)
* ``aiayn-first``  the same with stop='first', CTranslate2's own stopping rule (patience 1): the same
                   search as CTranslate2's, so it shows the engines' speed at equal work
* ``aiayn-graphs`` stop='hf' with ``cuda_graphs`` (aiayn.search.fixed: each step after the first one CUDA graph
                   replayed; off CUDA the same fixed-shape steps without a graph, so not a default engine there)
* ``aiayn-int8``   stop='exact' with ``--precision int8`` (aiayn.linear: int8 weights, the rows quantized too or
                   rounded to bf16, as this CPU's probe measured faster: aiayn.device.int8_kind; CPU only)
* ``hf``           Hugging Face ``MarianMTModel.generate()`` (early_stopping=False, its default), the
                   model converted with aiayn.interop.marian.to_hf_marian. A run trained with the paper's
                   interleaved sinusoids is first re-laid out to Marian's concat layout
                   (aiayn.interop.marian.concat_layout_copy); the logits are checked to agree (< 1e-4).
* ``ct2-fp32`` / ``ct2-int8`` / ``ct2-bf16`` / ``ct2-fp16``  CTranslate2 ``Translator.translate_batch``
                   on the run exported with aiayn.interop.ctranslate2.export_run (int8: exported with
                   quantization='int8'; bf16 / fp16: the fp32 export loaded with that compute type).
                   CTranslate2's own stopping rule (patience 1: stop once 4 hypotheses have finished).

Every engine: beam 4, length penalty score / |Y|^alpha ('power', alpha 0.6, as HF and CTranslate2
compute it), at most ``--max-len`` decoding steps (EOS included), no minimum length, one best
hypothesis. Sources are sorted by length once. Modes: "batch-1" one sentence at a time; "batched"
the same batches of ``--batch-size`` sentences in that order for every engine; "parallel" the batched mode's
batches searched side by side, as many at once as threads, each on one thread: aiayn's as ``aiayn translate``
searches them (aiayn.search.sources.search_batches: W workers of T / W intra-op threads), CTranslate2's with
``inter_threads`` = threads and ``intra_threads`` 1, every batch submitted at once (HF has no such setting);
"tokens" the token-budget batches ``aiayn translate`` makes on that device (aiayn.search.decode_batches,
``--max-tokens`` or the device's default budget), given to every engine. ``--precision fp32 bf16``
runs every mode once per precision: aiayn's as ``aiayn translate --precision`` runs it (on CUDA the weights cast;
on a CPU with native bf16, fp32 weights and bf16 linear layers), HF's weights cast to it, CTranslate2 with the
matching compute type (fp32: ct2-fp32 and ct2-int8). On a CPU the report ends with each engine at its fastest
over the thread counts and precisions measured (a row counts if its BLEU is within 0.3 of the engine's fp32).
Timed: the search on token ids (CTranslate2: pieces) only, after warm-up batches; SentencePiece
tokenization and detokenization, the same for all engines, are outside. BLEU is sacreBLEU (13a,
cased) of each engine's own detokenized output.

    python -m benchmarks.translate_speed --run-dir runs/multi30k_en_de_quick
    python -m benchmarks.translate_speed --run-dir RUN --device cuda --precision fp32 bf16 \
        --modes batch-1 batched tokens --engines aiayn hf ct2-fp32 ct2-bf16
    python -m benchmarks.translate_speed --run-dir RUN --threads 1 2 --modes batched --limit 300
    python -m benchmarks.translate_speed --smoke --md /tmp/B.md --out-json /tmp/s.json

``--threads 1 2`` measures every engine once per thread count (aiayn's intra-op threads and CTranslate2's
``intra_threads`` alike), in one run, on one model.
"""

from __future__ import annotations

import argparse
import copy
import json
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import DecodeOptions, ModelConfig
from aiayn.data.batching import pad_batch
from aiayn.data.tokenizer import SpecialIds
from aiayn.device import DTYPES, int8_kind, resolve_device, resolve_precision, weights_dtype
from aiayn.engine import inference_linear_kind, keep_freed_memory
from aiayn.errors import UserError
from aiayn.linear import use_linear
from aiayn.model.transformer import Transformer
from aiayn.search import SearchSpec, beam_search, decode_batches
from aiayn.search.sources import search_batches
from benchmarks import common
from benchmarks.flops import synchronize

NAME = "translate_speed"
ENGINES = ("aiayn", "aiayn-exact", "aiayn-first", "aiayn-graphs", "aiayn-int8", "hf", "ct2-fp32", "ct2-int8",
           "ct2-bf16", "ct2-fp16")
MODES = ("batch-1", "batched", "parallel", "tokens")
LABELS = {
    "aiayn": "aiayn (stop=hf)",
    "aiayn-exact": "aiayn (stop=exact)",
    "aiayn-first": "aiayn (stop=first)",
    "aiayn-graphs": "aiayn CUDA graphs (stop=hf)",
    "aiayn-int8": "aiayn int8 (stop=exact)",
    "hf": "HF generate()",
    "ct2-fp32": "CTranslate2 fp32",
    "ct2-int8": "CTranslate2 int8",
    "ct2-bf16": "CTranslate2 bf16",
    "ct2-fp16": "CTranslate2 fp16",
}
# aiayn's fp32 engines: their stop rule
STOPS = {"aiayn": "hf", "aiayn-exact": "exact", "aiayn-first": "first", "aiayn-graphs": "hf"}
# CTranslate2 engines: compute type, and the --precision pass they belong to.
CT2 = {"ct2-fp32": ("float32", "fp32"), "ct2-int8": ("int8", "fp32"), "ct2-bf16": ("bfloat16", "bf16"),
       "ct2-fp16": ("float16", "fp16")}
PAD, UNK, BOS, EOS = 0, 1, 2, 3


@dataclass
class Task:
    """What every engine translates: a model, its source ids (without EOS), references and vocabulary."""

    model: Transformer  # fp32, on the CPU; each engine copies it where it runs
    sources: list[list[int]]
    refs: list[str]
    pieces: list[str]  # id -> piece of the (shared or target) vocabulary
    src_pieces: list[str]
    detok: Callable[[list[int]], str]
    ct2_dirs: dict[str, Path]
    description: str


# The task: a trained run on Multi30k, or a random tiny model for --smoke -------------------------------


def _ct2_exports(engines: Sequence[str], export: Callable[[Path, str | None], Path], work: Path) -> dict[str, Path]:
    """CTranslate2 model directories: fp32 (also loaded as bf16 / fp16) and int8."""
    dirs: dict[str, Path] = {}
    for e in engines:
        if e in CT2:
            quant = "int8" if e == "ct2-int8" else None
            key = "int8" if quant else "fp32"
            if key not in dirs:
                dirs[key] = export(work / f"ct2-{key}", quant)
            dirs[e] = dirs[key]
    return {e: d for e, d in dirs.items() if e in CT2}


def run_task(run_dir: str, split: str, limit: int | None, work: Path, engines: Sequence[str]) -> Task:
    from aiayn.data.datasets import multi30k_split
    from aiayn.interop.ctranslate2 import export_run
    from aiayn.run.directory import load_run

    run = load_run(run_dir, "cpu")
    if not isinstance(run.model, Transformer):
        raise SystemExit(f"{run_dir} is a {run.cfg.task} run; this benchmark needs a translation run")
    d = run.cfg.data
    pairs = multi30k_split(split, d.src_lang, d.tgt_lang)[:limit]
    tok = run.tokenizers
    cap = run.cfg.model.max_positions - 1
    sources = [tok.src.encode(s)[:cap] for s, _ in pairs]
    ct2 = _ct2_exports(engines, lambda out, q: export_run(run_dir, out, quantization=q), work)
    return Task(
        model=run.model.eval(), sources=sources, refs=[t for _, t in pairs],
        pieces=[tok.tgt.id_to_piece(i) for i in range(tok.tgt.vocab_size)],
        src_pieces=[tok.src.id_to_piece(i) for i in range(tok.src.vocab_size)],
        detok=tok.tgt.decode, ct2_dirs=ct2,
        description=f"Multi30k {split} {d.src_lang}->{d.tgt_lang} ({len(sources)} sentences), the run `{run_dir}` "
                    f"({run.cfg.model.n_encoder_layers}+{run.cfg.model.n_decoder_layers} layers, d_model "
                    f"{run.cfg.model.d_model}, vocabulary {run.cfg.model.vocab_size}, positional layout "
                    f"{run.cfg.model.positional_layout})",
    )


def smoke_task(n: int, work: Path, engines: Sequence[str]) -> Task:
    """A random 2+2-layer model (interleaved layout, so the re-layout is exercised) on random sources."""
    from aiayn.interop.ctranslate2 import export_ctranslate2

    letters = list(string.ascii_lowercase) + [a + b for a in "xyz" for b in string.ascii_lowercase]
    pieces = ["<pad>", "<unk>", "<s>", "</s>"] + ["▁" + w for w in letters[:44]]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=len(pieces), d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2,
                      n_decoder_layers=2, dropout=0.0, max_positions=64, positional_layout="interleaved")
    model = Transformer(cfg).eval()
    with torch.no_grad():  # biases start at 0 and LayerNorms at (1, 0): randomise them too
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    sources = [torch.randint(4, len(pieces), (int(k),), generator=g).tolist()
               for k in torch.randint(2, 12, (n,), generator=g)]

    def detok(ids: list[int]) -> str:
        return " ".join(pieces[i][1:] for i in ids)

    ct2 = _ct2_exports(engines, lambda out, q: export_ctranslate2(model, pieces, out, quantization=q), work)
    return Task(model, sources, [detok(list(reversed(s))) for s in sources], pieces, pieces, detok, ct2,
                f"a random tiny model (smoke test) on {n} random sources")


# Engines: each translates a list of sources (ids without EOS) to a list of id lists ----------------------


@dataclass(frozen=True)
class Limit:
    """At most int(a * source length + b) decoding steps, EOS included, the source counted with its EOS: aiayn's
    ``--max-len-a/--max-len-b`` (per sentence); HF and CTranslate2, which take one limit per batch, get the batch's
    largest (an output that reached its own limit would tell them apart; the "= aiayn" column counts them)."""

    a: float
    b: int

    def of(self, batch: Sequence[list[int]]) -> int:
        """The largest limit of a batch of sources (ids without EOS)."""
        return max(int(self.a * (len(s) + 1) + self.b) for s in batch)


def aiayn_engine(model: nn.Module, alpha: float, limit: Limit, stop: str, device: torch.device, graphs: bool = False):
    spec = SearchSpec.of(SpecialIds(pad=PAD, bos=BOS, eos=EOS, decoder_start=BOS), beam=4, alpha=alpha,
                         length_penalty="power", max_len_a=limit.a, max_len_b=limit.b, stop=stop, cuda_graphs=graphs)

    def translate(batch: list[list[int]]) -> list[list[int]]:
        src = pad_batch([s + [EOS] for s in batch], PAD).to(device)
        hyps = beam_search(model, src, src != PAD, spec)
        return [h[0].tokens for h in hyps]

    def many(batches: list[list[list[int]]]) -> list[list[list[int]]]:  # the parallel mode: side by side
        padded = [pad_batch([s + [EOS] for s in batch], PAD).to(device) for batch in batches]
        return [[h[0].tokens for h in hyps] for hyps in search_batches(model, padded, spec)]

    translate.many = many
    return translate


def hf_engine(hf: nn.Module, alpha: float, limit: Limit, device: torch.device):
    def translate(batch: list[list[int]]) -> list[list[int]]:
        src = pad_batch([s + [EOS] for s in batch], PAD).to(device)
        with torch.no_grad():
            out = hf.generate(
                src, attention_mask=(src != PAD).long(), num_beams=4, num_return_sequences=1, length_penalty=alpha,
                early_stopping=False, max_length=limit.of(batch) + 1,  # HF's max_length counts the start token
                min_length=0, do_sample=False, no_repeat_ngram_size=0, repetition_penalty=1.0,
                bad_words_ids=None, forced_bos_token_id=None, forced_eos_token_id=None,
            )
        result = []
        for seq in out.tolist():
            seq = seq[1:]  # the decoder start token
            result.append(seq[: seq.index(EOS)] if EOS in seq else seq)
        return result

    return translate


def ct2_engine(path: Path, compute_type: str, threads: int, task: Task, alpha: float, limit: Limit,
               device: torch.device):
    import ctranslate2

    translator = ctranslate2.Translator(str(path), device=device.type, device_index=device.index or 0,
                                        compute_type=compute_type, inter_threads=1, intra_threads=threads)
    piece_id = {p: i for i, p in enumerate(task.pieces)}

    def submit(on: Any, batch: list[list[int]], asynchronous: bool = False) -> list[Any]:
        # Pieces without </s>: the exported config appends it, as aiayn training did.
        return on.translate_batch(
            [[task.src_pieces[i] for i in s] for s in batch], beam_size=4, num_hypotheses=1,
            length_penalty=alpha, max_decoding_length=limit.of(batch), min_decoding_length=0, max_batch_size=0,
            asynchronous=asynchronous,
        )

    def ids(results: list[Any]) -> list[list[int]]:
        out = []
        for r in results:
            hyp = (r.result() if hasattr(r, "result") else r).hypotheses[0]
            out.append([piece_id[p] for p in (hyp[:-1] if hyp and hyp[-1] == "</s>" else hyp)])
        return out

    def translate(batch: list[list[int]]) -> list[list[int]]:
        return ids(submit(translator, batch))

    side: list[Any] = []  # the parallel mode's translator: one batch per thread at once, each on one thread

    def many(batches: list[list[list[int]]]) -> list[list[list[int]]]:
        if not side:
            side.append(ctranslate2.Translator(str(path), device=device.type, device_index=device.index or 0,
                                               compute_type=compute_type, inter_threads=threads, intra_threads=1))
        pending = [submit(side[0], batch, asynchronous=True) for batch in batches]  # all at once, then waited for
        return [ids(p) for p in pending]

    translate.many = many
    translate([task.sources[0]])  # fails here, not in the timing, when the engine cannot run on this device
    return translate


# Timing -------------------------------------------------------------------------------------------------


def run_mode(translate: Callable, sources: Sequence[list[int]], batches: Sequence[list[int]],
             warmup_batches: int, device: torch.device = torch.device("cpu"), side_by_side: bool = False
             ) -> tuple[list[list[int]], float]:
    """Translate ``batches`` (lists of source indices) after ``warmup_batches`` untimed ones; ``side_by_side`` (the
    parallel mode): all of them in one call of the engine's ``many``. Returns (outputs in source order, seconds)."""
    search = translate.many if side_by_side else (lambda bs: [translate(b) for b in bs])
    search([[sources[i] for i in idx] for idx in batches[:warmup_batches]])
    out: list[list[int]] = [[] for _ in sources]
    synchronize(device)
    t0 = time.perf_counter()
    found = search([[sources[i] for i in idx] for idx in batches])
    for idx, hyps in zip(batches, found):
        for i, hyp in zip(idx, hyps):
            out[i] = hyp
    synchronize(device)
    return out, time.perf_counter() - t0


def profile_search(translate: Callable, sources: Sequence[list[int]], batches: Sequence[list[int]],
                   path: Path, device: torch.device = torch.device("cpu")) -> None:
    """Python-level (cProfile, by own time) and operator-level (torch.profiler) tables of one batched pass."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    prof.enable()
    run_mode(translate, sources, batches, 0, device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as tp:
        run_mode(translate, sources, batches, 0, device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("== cProfile (aiayn beam search, batched)\n" + text.getvalue() + "\n== torch.profiler\n"
                    + tp.key_averages().table(sort_by=sort, row_limit=30) + "\n", encoding="utf-8")


def bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    from aiayn.eval.scorers import sacrebleu_scores

    return sacrebleu_scores(hyps, refs)["bleu"]


def pass_engines(engines: Sequence[str], precision: str) -> list[str]:
    """The engines of one --precision pass: aiayn and HF at that precision, the CTranslate2 engines of it (aiayn's
    int8 with CTranslate2's, in the fp32 pass)."""
    return [e for e in engines if (CT2[e][1] == precision if e in CT2 else e != "aiayn-int8" or precision == "fp32")]


def build_engines(task: Task, engines: Sequence[str], alpha: float, limit: Limit, threads: int,
                  check_batch: Sequence[int], device: torch.device = torch.device("cpu"), precision: str = "fp32",
                  ) -> tuple[dict[str, Callable], dict[str, Any]]:
    """The engines' translate functions on ``device`` in ``precision``, and what was checked while building
    them. A CTranslate2 engine that cannot run on a GPU is left out, with the reason in the checks."""
    from aiayn.interop.marian import concat_layout_copy, to_hf_marian
    from benchmarks.train_throughput import HFMarianSeq2Seq

    dtype = DTYPES[precision]  # Hugging Face's weights: cast whole (it has no kernel of aiayn's)
    fns: dict[str, Callable] = {}
    checks: dict[str, Any] = {}
    # as load_run(precision=...) casts: on a CPU, bf16 keeps fp32 weights and multiplies in bf16 (aiayn.linear)
    ours = copy.deepcopy(task.model).to(device=device, dtype=weights_dtype(precision, device)).eval()
    use_linear(ours, inference_linear_kind(device, precision))  # the linear layers' kernel, as load_run chooses
    for e in engines:
        if e in STOPS:
            fns[e] = aiayn_engine(ours, alpha, limit, STOPS[e], device, graphs=e == "aiayn-graphs")
        elif e == "aiayn-int8":
            if device.type != "cpu":
                checks[f"{e}_not_run"] = "int8 runs on the CPU only"
                continue
            kind = inference_linear_kind(device, "int8")  # as load_run(precision="int8") chooses
            int8 = use_linear(copy.deepcopy(task.model).eval(), kind)
            checks["aiayn-int8_kind"] = f"{kind}: {int8_kind()[1]}"
            fns[e] = aiayn_engine(int8, alpha, limit, "exact", device)
        elif e == "hf":
            hf = to_hf_marian(concat_layout_copy(task.model)).eval()
            src = pad_batch([task.sources[i] + [EOS] for i in check_batch], PAD)
            g = torch.Generator().manual_seed(0)  # any target ids will do
            tgt = torch.cat([torch.full((len(check_batch), 1), BOS),
                             torch.randint(4, len(task.pieces), (len(check_batch), 12), generator=g)], dim=1)
            diff = common.max_logit_diff(task.model, HFMarianSeq2Seq(hf), src, tgt)  # fp32, CPU
            if diff > 1e-4:
                raise SystemExit(f"the Hugging Face model does not compute aiayn's logits (max diff {diff:.2e})")
            checks["hf_max_logit_diff"] = diff
            checks["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
            fns[e] = hf_engine(hf.to(device=device, dtype=dtype), alpha, limit, device)
        elif e in CT2:
            supported = _ct2_compute_types(device)
            if supported is not None and CT2[e][0] not in supported:
                checks[f"{e}_not_run"] = (f"CTranslate2 has no {CT2[e][0]} on {device.type} (it offers "
                                          f"{', '.join(sorted(supported))})")
                continue
            try:
                fns[e] = ct2_engine(task.ct2_dirs[e], CT2[e][0], threads, task, alpha, limit, device)
            except (ImportError, RuntimeError, ValueError, OSError) as err:
                if device.type == "cpu":
                    raise
                checks[f"{e}_not_run"] = f"{type(err).__name__}: {err}"
                print(f"[{NAME}] {e} cannot run on {device}: {err}", file=sys.stderr)
        else:
            raise SystemExit(f"unknown engine {e!r} (known: {', '.join(ENGINES)})")
    return fns, checks


def _ct2_compute_types(device: torch.device) -> set[str] | None:
    """The compute types CTranslate2 offers on ``device`` (None where it cannot say)."""
    try:
        import ctranslate2

        return set(ctranslate2.get_supported_compute_types(device.type))
    except (ImportError, RuntimeError, ValueError):
        return None


# Report -------------------------------------------------------------------------------------------------


def section_name(device: torch.device) -> str:
    """The BENCHMARKS.md section (and JSON name): CPU and GPU tables live side by side."""
    return NAME if device.type == "cpu" else f"{NAME}_gpu"


def _key_parts(result: dict[str, Any], key: str) -> tuple[str, str]:
    """(mode, precision) of a row group (results written before "keys" existed: parsed from the key)."""
    if key in result.get("keys", {}):
        return result["keys"][key]["mode"], result["keys"][key]["precision"]
    parts = key.split()
    return parts[0], parts[1] if len(parts) > 1 else "fp32"


def _ratio(res: dict[str, Any], ours: str, theirs: str, goal: float) -> str:
    return common.goal_cell(res[ours]["sentences_per_s"] / res[theirs]["sentences_per_s"], goal)


def _goals(result: dict[str, Any], gpu: bool) -> list[str]:
    """GPU: aiayn (stop=hf) >= 3x HF generate() batched (2x at batch 1) and >= 1x CTranslate2; bf16 no slower than
    fp32 with BLEU within 0.3. CPU (issue 60): the default exact search >= 1x CTranslate2 fp32, aiayn int8 >= 1x
    CTranslate2 int8 with BLEU within 0.3 of fp32, and aiayn (stop=hf) >= 3x HF generate()."""
    goals = []
    for key, res in result["modes"].items():
        if "aiayn" not in res and "aiayn-exact" not in res:
            continue
        mode, precision = _key_parts(result, key)
        if gpu and "aiayn" in res:
            for ours in ("aiayn", "aiayn-graphs"):
                if "hf" in res and ours in res:
                    name = "aiayn" if ours == "aiayn" else LABELS[ours]
                    goals.append(f"- {key}: {name} / HF generate() sentences/s = "
                                 + _ratio(res, ours, "hf", 2.0 if mode == "batch-1" else 3.0))
            for e in ("ct2-fp32", "ct2-bf16", "ct2-fp16"):
                if e in res and mode != "batch-1":
                    goals.append(f"- {key}: aiayn / {LABELS[e]} sentences/s = " + _ratio(res, "aiayn", e, 1.0))
        elif not gpu:
            if "aiayn" in res and "hf" in res and mode != "batch-1":
                goals.append(f"- {key}: aiayn / HF generate() sentences/s = " + _ratio(res, "aiayn", "hf", 3.0))
            for ours, theirs in (("aiayn-exact", "ct2-fp32"), ("aiayn-int8", "ct2-int8")):
                if ours in res and theirs in res:
                    goals.append(f"- {key}: {LABELS[ours]} / {LABELS[theirs]} sentences/s = "
                                 + _ratio(res, ours, theirs, 1.0))
            if "aiayn-int8" in res and "aiayn-exact" in res:
                gap = res["aiayn-int8"]["bleu"] - res["aiayn-exact"]["bleu"]
                goals.append(f"- {key}: aiayn int8 BLEU {res['aiayn-int8']['bleu']:.2f} vs fp32 "
                             f"{res['aiayn-exact']['bleu']:.2f} ({gap:+.2f}; goal: within 0.3: "
                             + ("met" if abs(gap) <= 0.3 else "short") + ")")
        fp32 = result["modes"].get(key.replace(f" {precision}", "", 1)) if precision != "fp32" else None
        ours = next((e for e in ("aiayn", "aiayn-exact") if e in res and e in (fp32 or {})), None)
        if ours:  # a bf16 / fp16 pass against fp32
            a, b = res[ours], fp32[ours]
            goals.append(f"- {key}: {'aiayn' if ours == 'aiayn' else LABELS[ours]} speed vs fp32 = "
                         + common.goal_cell(a["sentences_per_s"] / b["sentences_per_s"], 1.0)
                         + f"; BLEU {a['bleu']:.2f} vs {b['bleu']:.2f} (goal: within 0.3: "
                         + ("met" if abs(a["bleu"] - b["bleu"]) <= 0.3 else "short") + ")")
    return goals + ([] if gpu else _best_settings(result))


def _best_settings(result: dict[str, Any]) -> list[str]:
    """Each engine at its own fastest setting (thread count and precision) against the other's, per mode: a user
    picks the best setting of each, and CTranslate2's is not always the most threads. A row counts only if its BLEU
    is within 0.3 of its engine's fp32 row at the same thread count (CTranslate2's: of ct2-fp32's). Each engine's
    int8 is one of its settings (CTranslate2's int8 counts for CTranslate2, aiayn's for aiayn's exact search, which
    it runs), and is also compared on its own (int8 against int8)."""
    fastest: dict[str, dict[str, tuple[float, str]]] = {}  # mode -> family -> (sentences/s, setting)
    families = {"aiayn-exact": "aiayn exact", "aiayn-int8": "aiayn int8", "ct2-fp32": "CTranslate2",
                "ct2-int8": "CTranslate2", "ct2-bf16": "CTranslate2", "ct2-int8-only": "CTranslate2 int8"}
    keys = result.get("keys", {})
    where = {(i.get("mode"), i.get("precision"), i.get("threads")): k for k, i in keys.items()}
    for key, res in result["modes"].items():
        info = keys.get(key, {})
        mode, precision, threads = info.get("mode"), info.get("precision"), info.get("threads")
        if mode is None:
            continue
        side = mode == "parallel"  # the batched mode's batches, side by side: one more setting of the batched work
        mode = "batched" if side else mode
        fp32 = result["modes"].get(where.get((mode, "fp32", threads), ""), {})
        for e, r in res.items():
            names = [families[e]] if e in families else []
            if e == "ct2-int8":
                names.append(families["ct2-int8-only"])
            if e == "aiayn-int8":
                names.append(families["aiayn-exact"])
            ref = fp32.get("ct2-fp32" if e.startswith("ct2-") else ("aiayn-exact" if e == "aiayn-int8" else e))
            if not names or (ref is not None and abs(r["bleu"] - ref["bleu"]) > 0.3):
                continue
            setting = f"{precision if e.startswith('aiayn-exact') else e.split('-', 1)[1]}" + (
                f", {threads}t" if threads else "") + (", side by side" if side else "")
            for name in names:
                if r["sentences_per_s"] > fastest.setdefault(mode, {}).get(name, (0.0, ""))[0]:
                    fastest[mode][name] = (r["sentences_per_s"], setting)
    lines = []
    goals = {"batched": 1.0, "tokens": 1.0, "batch-1": 0.5}
    for mode, group in fastest.items():
        for ours, theirs, goal in (("aiayn exact", "CTranslate2", goals.get(mode, 1.0)),
                                   ("aiayn int8", "CTranslate2 int8", 1.0)):
            if ours in group and theirs in group:
                (a, sa), (b, sb) = group[ours], group[theirs]
                lines.append(f"- {mode}, each at its fastest: {ours} ({sa}) / {theirs} ({sb}) sentences/s = "
                             + common.goal_cell(a / b, goal))
    return lines


def _timed(a: dict[str, Any], budget: int | None) -> str:
    """The markdown's line on what was timed and how."""
    return (
        f"- Timed: the search on ids only (tokenization/detokenization outside), after "
        f"{a['warmup_batches']} warm-up batches"
        + (f"; batch-1 = the first {a['batch1_limit']} sentences one at a time" if a.get("batch1_limit") else "")
        + f"; batched = the same length-sorted batches of {a['batch_size']} sentences for every engine"
        + ("; parallel = those batches searched side by side, one per thread at once, each on one thread (aiayn: "
           "`aiayn translate`'s workers, aiayn.search.sources.search_batches; CTranslate2: inter_threads = threads, "
           "intra_threads 1, the batches submitted at once)" if "parallel" in a.get("modes", []) else "")
        + (f"; tokens = the token-budget batches of `aiayn translate` ({budget} tokens = sentences x (longest "
           "+ 1) x beam)" if budget else "")
        + (f"; each engine's fastest of {a['repeats']} passes" + ("" if a.get("isolated") else
                                                                  ", the engines taking turns")
           if a.get("repeats", 1) > 1 else "")
        + ("; each engine in a process of its own (in one process, the OpenMP threads one engine leaves spinning slow "
           "the next one's)" if a.get("isolated") else "")
        + ("; threads: `Nt` in a row's mode is aiayn's intra-op threads and CTranslate2's intra_threads"
           if len(a.get("threads") or []) > 1 else "")
        + ". BLEU: sacreBLEU 13a, cased, of each engine's own output.\n")


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    gpu = a.get("device", "cpu") != "cpu"
    where = (result["machine"].get("gpu") or a.get("device")) if gpu else "CPU"
    budget = a.get("batch_tokens")
    lines = [
        f"## 2. Translation speed (beam 4, {where})\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- Task: {result['task']}.",
        f"- Search: beam 4, length penalty score / |Y|^{a['alpha']} in every engine, at most "
        + (f"{a['max_len_a']:g} x source length + {a['max_len']} (the batch's largest for HF and CTranslate2)"
           if a.get("max_len_a") else f"{a['max_len']}")
        + " decoding steps, one hypothesis. aiayn stop=hf and HF `generate()` (early_stopping=False) apply "
        "the same stopping rule and must agree token for token (column *= aiayn*); aiayn stop=exact is "
        "`aiayn translate`'s default; CTranslate2 stops once 4 hypotheses have finished (its default), as aiayn "
        "stop=first does. aiayn int8: stop=exact with `--precision int8` ("
        + (f"`{result['checks']['aiayn-int8_kind']}`" if "aiayn-int8_kind" in result["checks"] else
           "int8 linear layers") + ").",
        f"- Same weights: HF is the run converted by `to_hf_marian` (after the interleaved -> concat "
        f"re-layout; max |Δlogits| vs aiayn {result['checks'].get('hf_max_logit_diff', float('nan')):.1e}), "
        "CTranslate2 the run exported by `export_run` (int8: `quantization='int8'`). bf16 / fp16 rows: aiayn as "
        "`--precision` runs it (on a GPU its weights cast; on a CPU fp32 weights and bf16 linear layers), HF's "
        "weights cast to that type, CTranslate2 with that compute type where it has it.",
        _timed(a, budget),
    ]
    if gpu:
        lines.insert(-1, f"- CUDA attention: cuDNN SDPA backend {a.get('cudnn_sdpa', 'off')}; HF attention "
                         f"implementation {result['checks'].get('hf_attn_implementation')}.")
    not_run = {k[: -len("_not_run")]: v for k, v in result["checks"].items() if k.endswith("_not_run")}
    for e, why in not_run.items():
        lines.insert(-1, f"- {LABELS[e]} not run on this device: {why}")
    headers = ["mode", "engine", "sentences/s", "target tokens/s", "seconds", "BLEU", "= aiayn",
               "aiayn speed-up"]
    rows = []
    for mode, res in result["modes"].items():
        ours = res.get("aiayn")
        for e, r in res.items():
            ratio = ours["sentences_per_s"] / r["sentences_per_s"] if ours and e != "aiayn" else None
            rows.append([mode, LABELS[e], f"{r['sentences_per_s']:,.1f}", f"{r['tokens_per_s']:,.0f}",
                         f"{r['seconds']:.1f}", f"{r['bleu']:.2f}",
                         f"{r['same_as_aiayn']}/{r['sentences']}" if "same_as_aiayn" in r else "",
                         f"{ratio:.2f}x" if ratio else ""])
    lines.append(common.markdown_table(headers, rows))
    goals = _goals(result, gpu)
    if goals:
        lines.append("Goals (" + ("GPU: batched beam >= 3x HF generate() and >= 1x CTranslate2, batch 1 >= 2x "
                                  "generate(), bf16 no slower than fp32 with BLEU within 0.3" if gpu else
                                  "CPU: batched beam >= 3x HF generate(); the default exact search >= 1x CTranslate2 "
                                  "fp32; int8 >= 1x CTranslate2 int8 with BLEU within 0.3 of fp32") + "):\n")
        lines += goals
    if a.get("profile"):
        lines.append(f"\nProfiles of aiayn's batched pass (cProfile, torch.profiler): `{a['profile']}`.")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.translate_speed", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/multi30k_en_de_quick", help="a trained translation run")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--limit", type=int, help="translate the first N sentences only")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default cpu)")
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16", "fp16"],
                   help="one pass per precision (fp16 on CUDA only; bf16 on CUDA or a CPU with native bf16)")
    p.add_argument("--engines", nargs="+", default=None, choices=list(ENGINES),
                   help="default: all (aiayn-graphs on CUDA only)")
    p.add_argument("--modes", nargs="+", default=["batch-1", "batched"], choices=list(MODES))
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch in batched mode")
    p.add_argument("--batch1-limit", type=int, default=None,
                   help="batch-1 mode translates the first N sentences only (its BLEU is theirs)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="token budget of the 'tokens' mode (default: aiayn translate's for the device)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty exponent (power)")
    p.add_argument("--max-len", type=int, default=100,
                   help="decoding steps at most (EOS included): b of a * source + b")
    p.add_argument("--max-len-a", type=float, default=0.0,
                   help="a of at most a * source length + b steps (aiayn translate's default: a 1, b 50)")
    p.add_argument("--warmup-batches", type=int, default=2)
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="intra-op threads, every engine's (default: one per core); several: one pass per count")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes per engine, taking turns; each keeps its fastest (for a shared machine)")
    p.add_argument("--cudnn-sdpa", choices=["on", "off"], default="off",
                   help="CUDA: PyTorch's cuDNN attention backend for aiayn and HF (default off: it re-plans for "
                        "every new shape)")
    p.add_argument("--profile", help="write cProfile and torch.profiler tables of aiayn's batched pass here")
    p.add_argument("--smoke", action="store_true", help="seconds-long run on a random tiny model (CI)")
    p.add_argument("--isolate", choices=["auto", "yes", "no"], default="auto",
                   help="each engine in a process of its own (auto: when a thread count above 1 is measured, where "
                        "one engine's spinning threads slow the next one's; not with --profile)")
    p.add_argument("--worker", choices=list(ENGINES), help=argparse.SUPPRESS)  # run_isolated's child process
    p.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-precision", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    p.add_argument("--md", default=str(common.DEFAULT_MD), help="markdown file whose section is rewritten")
    p.add_argument("--out-json", default=None, help="default: benchmarks/results/<section>.json")
    args = p.parse_args(argv)
    args.run_dir_given = run_dir_given(argv)
    args.engines = [e for e in ENGINES if e in (args.engines or ENGINES)]  # aiayn first: the others are compared
    args.engines_given = "--engines" in argv
    args.modes = [m for m in MODES if m in args.modes]
    args.precision = [q for q in ("fp32", "bf16", "fp16") if q in args.precision]
    if args.smoke:
        args.limit = args.limit or 8
        args.batch_size, args.max_len, args.warmup_batches = 4, 8, 1
        args.max_tokens = args.max_tokens or 4 * 4 * 12  # a few token-budget batches of the 8 sources
    return args


def by_length(task: Task) -> list[int]:
    """Source indices, shortest first (ties by index)."""
    return sorted(range(len(task.sources)), key=lambda i: (len(task.sources[i]), i))


def plans(task: Task, args: argparse.Namespace, device: torch.device, order: list[int]) -> dict[str, list[list[int]]]:
    """The batches (source indices) of each mode, ``order`` the sources by length; "tokens": those
    ``aiayn translate`` makes on ``device``."""
    opts = DecodeOptions(beam=4, max_tokens=args.max_tokens)
    args.batch_tokens = opts.batch_tokens(device.type) if "tokens" in args.modes else None
    batched = [order[k: k + args.batch_size] for k in range(0, len(order), args.batch_size)]
    return {
        "batch-1": [[i] for i in range(min(len(task.sources), args.batch1_limit or len(task.sources)))],
        "batched": batched,
        "parallel": batched,  # the same batches, searched side by side
        "tokens": decode_batches([len(s) + 1 for s in task.sources], opts, device.type),  # each source and its EOS
    }


def summarize(task: Task, per_engine: dict[str, tuple[list[list[int]], list[float]]], batches: list[list[int]],
              label: str) -> dict[str, Any]:
    """Each engine's row from its outputs on ``batches`` (indexed by source) and its passes' seconds: speed (the
    fastest pass), BLEU of the sources translated, agreement with aiayn."""
    res: dict[str, Any] = {}
    done = sorted(i for b in batches for i in b)
    for e, (outputs, passes) in per_engine.items():
        outputs = [outputs[i] for i in done]
        tokens = sum(len(o) for o in outputs)
        r = {"sentences": len(outputs), "target_tokens": tokens, "batches": len(batches),
             "bleu": bleu([task.detok(o) for o in outputs], [task.refs[i] for i in done])}
        if "aiayn" in res:
            r["same_as_aiayn"] = sum(a == b for a, b in zip(outputs, res["aiayn"]["outputs"]))
        seconds = min(passes)
        r.update(outputs=outputs, seconds=seconds, sentences_per_s=len(outputs) / seconds,
                 tokens_per_s=tokens / seconds)
        if len(passes) > 1:
            r["passes_seconds"] = passes
        print(f"[{NAME}] {label}: {e} {r['sentences_per_s']:.1f} sentences/s, BLEU {r['bleu']:.2f}", file=sys.stderr)
        res[e] = r
    return res


def measure(task: Task, fns: dict[str, Callable], batches: list[list[int]], warm: int,
            device: torch.device, label: str, repeats: int = 1, side_by_side: bool = False) -> dict[str, Any]:
    """Every engine on the same batches (which may cover only some sources), in this process: speed, BLEU of the
    sources translated, and agreement with aiayn. With ``repeats`` > 1 the engines take turns (each one pass per
    round, the warm-up in the first), and each keeps its fastest pass: on a shared machine the other processes'
    load then falls on every engine alike."""
    per_engine: dict[str, tuple[list[list[int]], list[float]]] = {}
    fns = {e: fn for e, fn in fns.items() if hasattr(fn, "many") or not side_by_side}
    for round_ in range(repeats):
        for e, fn in fns.items():
            print(f"[{NAME}] {label}: {e} ...", file=sys.stderr, flush=True)
            outputs, seconds = run_mode(fn, task.sources, batches, warm if round_ == 0 else 0, device, side_by_side)
            per_engine.setdefault(e, (outputs, []))[1].append(seconds)
    return summarize(task, per_engine, batches, label)


def run_dir_given(argv: Sequence[str]) -> bool:
    """Whether the command line names a run (``--smoke`` without one uses a random tiny model)."""
    return any(a == "--run-dir" or a.startswith("--run-dir=") for a in argv)


def load_task(args: argparse.Namespace, work: Path, engines: Sequence[str]) -> Task:
    """The run's task, or the smoke test's random one."""
    if args.smoke and not args.run_dir_given:
        return smoke_task(args.limit, work, engines)
    return run_task(args.run_dir, args.split, args.limit, work, engines)


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One engine (``--worker``), one thread count and precision, every mode with its repeats, in this process:
    {"modes": {mode: {"outputs", "passes"}}, "checks"}. What :func:`run_isolated` runs in a fresh interpreter."""
    device = torch.device(args.device)
    threads = common.set_threads(args.worker_threads)
    with tempfile.TemporaryDirectory() as tmp:
        task = load_task(args, Path(tmp), [args.worker])
        order = by_length(task)
        batches = plans(task, args, device, order)
        fns, checks = build_engines(task, [args.worker], args.alpha, Limit(args.max_len_a, args.max_len), threads,
                                    order[-8:], device, args.worker_precision)
        modes: dict[str, Any] = {}
        for mode in args.modes if args.worker in fns else []:
            if mode == "parallel" and not hasattr(fns[args.worker], "many"):
                continue
            print(f"[{NAME}] {mode} {threads}t: {args.worker} (a process of its own) ...", file=sys.stderr, flush=True)
            warm = args.warmup_batches * (8 if mode == "batch-1" else 1)
            passes, outputs = [], None
            for r in range(args.repeats):
                out, seconds = run_mode(fns[args.worker], task.sources, batches[mode], warm if r == 0 else 0, device,
                                        mode == "parallel")
                passes.append(seconds)
                outputs = out if outputs is None else outputs
            modes[mode] = {"outputs": outputs, "passes": passes}
    return {"modes": modes, "checks": checks}


def run_isolated(argv: Sequence[str], engine: str, threads: int, precision: str) -> dict[str, Any]:
    """:func:`run_worker` in a fresh interpreter: an engine measured alone, as a user runs it. In one process, the
    OpenMP threads one engine leaves spinning after its pass slowed the next one's (aiayn at 2 threads: 128 against
    208 sentences/s after CTranslate2 had run, batched)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.translate_speed", *argv, "--worker", engine, "--worker-threads",
               str(threads), "--worker-precision", precision, "--worker-result", str(out)]
        subprocess.run(cmd, check=True, cwd=common.REPO)
        return json.loads(out.read_text())


def measure_isolated(task: Task, argv: Sequence[str], engines: Sequence[str], pass_: tuple[int, str],
                     batches: dict[str, list[list[int]]], keys: dict[str, str], result: dict[str, Any]) -> None:
    """One thread count and precision, ``pass_`` = (threads, precision): each of its ``engines`` in a process of its
    own (:func:`run_isolated`), the rows of every mode (``keys``: mode -> row group) into ``result``."""
    threads, q = pass_
    got = {e: run_isolated(argv, e, threads, q) for e in engines}
    for r in got.values():
        result["checks"].update(r["checks"])
    for mode, key in keys.items():
        per_engine = {e: (r["modes"][mode]["outputs"], r["modes"][mode]["passes"]) for e, r in got.items()
                      if mode in r["modes"]}
        result["modes"][key] = summarize(task, per_engine, batches[mode], key)


def mode_key(mode: str, precision: str, threads: int | None) -> str:
    """A row group's name: the mode, the precision unless fp32, the thread count when several were measured."""
    return " ".join([mode] + ([precision] if precision != "fp32" else []) + ([f"{threads}t"] if threads else []))


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:  # an absent device, or bf16 / fp16 off CUDA: one line, before any work
        device = resolve_device(args.device)
        for q in args.precision:
            resolve_precision(q, device, training=False)
    except UserError as err:
        raise SystemExit(f"{NAME}: error: {err}") from None
    args.device = str(device)
    if not args.engines_given and device.type != "cuda":  # aiayn-graphs without CUDA: no graph, no default there
        args.engines.remove("aiayn-graphs")
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(args.cudnn_sdpa == "on")
    args.kept_freed_memory = keep_freed_memory()  # as the aiayn command does at its start (CTranslate2 has its own)
    if args.worker:
        result = run_worker(args)
        common.write_json(args.worker_result, result)
        return result
    thread_counts = args.threads or [None]
    threads = common.set_threads(thread_counts[0])
    result: dict[str, Any] = {
        "benchmark": section_name(device), "date": common.utc_now(),
        "command": command or common.command_line(NAME, argv), "machine": common.machine_info(threads),
        "args": vars(args), "modes": {}, "keys": {}, "checks": {},
    }
    args.isolated = args.isolate == "yes" or (args.isolate == "auto" and not args.profile and any(
        (n if n is not None else threads) > 1 for n in thread_counts))
    with tempfile.TemporaryDirectory() as tmp:
        task = load_task(args, Path(tmp), [] if args.isolated else args.engines)  # isolated: each worker exports
        result["task"] = task.description
        order = by_length(task)
        batches = plans(task, args, device, order)
        for n_threads in thread_counts:
            threads = common.set_threads(n_threads)
            for q in args.precision:
                keys = {mode: mode_key(mode, q, threads if len(thread_counts) > 1 else None) for mode in args.modes}
                for mode, key in keys.items():
                    result["keys"][key] = {"mode": mode, "precision": q, "threads": threads}
                if args.isolated:
                    measure_isolated(task, argv, pass_engines(args.engines, q), (threads, q), batches, keys, result)
                    continue
                fns, checks = build_engines(task, pass_engines(args.engines, q), args.alpha,
                                            Limit(args.max_len_a, args.max_len), threads, order[-8:], device, q)
                result["checks"].update(checks)
                for mode, key in keys.items():
                    warm = args.warmup_batches * (8 if mode == "batch-1" else 1)
                    result["modes"][key] = measure(task, fns, batches[mode], warm, device, key, args.repeats,
                                                   mode == "parallel")
                if args.profile and "aiayn" in fns and q == args.precision[0] and n_threads == thread_counts[0]:
                    profile_search(fns["aiayn"], task.sources, batches["batched"], Path(args.profile), device)
    for res in result["modes"].values():  # token ids are not worth keeping in the JSON
        for r in res.values():
            r.pop("outputs")
    common.write_json(args.out_json or common.RESULTS_DIR / f"{section_name(device)}.json", result)
    common.update_section(args.md, section_name(device), markdown(result))
    return result


if __name__ == "__main__":
    main()
