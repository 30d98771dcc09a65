"""Benchmark 2: translation speed, beam 4, the same weights in every engine, fp32 (and int8) on CPU.

Engines, all given one trained run's weights:

* ``aiayn``        aiayn.decode.search.beam_search, stop='hf' (Hugging Face's stopping rule, so its
                   output must equal ``generate()``'s token for token)
* ``aiayn-exact``  the same with stop='exact' (the default of ``aiayn translate``: never stops before
                   the best hypothesis is certain, so it may run more steps)
* ``hf``           Hugging Face ``MarianMTModel.generate()`` (early_stopping=False, its default), the
                   model converted with aiayn.interop.marian.to_hf_marian. A run trained with the paper's
                   interleaved sinusoids is first re-laid out to Marian's concat layout
                   (aiayn.interop.marian.concat_layout_copy); the logits are checked to agree (< 1e-4).
* ``ct2-fp32`` / ``ct2-int8``  CTranslate2 ``Translator.translate_batch`` on the run exported with
                   aiayn.interop.ctranslate2.export_run (int8: exported with quantization='int8').
                   CTranslate2's own stopping rule (patience 1: stop once 4 hypotheses have finished).

Every engine: beam 4, length penalty score / |Y|^alpha ('power', alpha 0.6, as HF and CTranslate2
compute it), at most ``--max-len`` decoding steps (EOS included), no minimum length, one best
hypothesis. Sources are sorted by length once; "batched" feeds every engine the same batches of
``--batch-size`` sentences in that order, "batch 1" one sentence at a time. Timed: the search on
token ids (CTranslate2: pieces) only; SentencePiece tokenization and detokenization, the same for
all engines, are outside. BLEU is sacreBLEU (13a, cased) of each engine's own detokenized output.

    python -m benchmarks.translate_speed --run-dir runs/multi30k_en_de_quick
    python -m benchmarks.translate_speed --smoke --md /tmp/B.md --out-json /tmp/s.json
"""

from __future__ import annotations

import argparse
import string
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.data.batching import pad_batch
from aiayn.decode.search import beam_search
from aiayn.model.transformer import Transformer
from benchmarks import common

NAME = "translate_speed"
ENGINES = ("aiayn", "aiayn-exact", "hf", "ct2-fp32", "ct2-int8")
LABELS = {
    "aiayn": "aiayn (stop=hf)",
    "aiayn-exact": "aiayn (stop=exact)",
    "hf": "HF generate()",
    "ct2-fp32": "CTranslate2 fp32",
    "ct2-int8": "CTranslate2 int8",
}
PAD, UNK, BOS, EOS = 0, 1, 2, 3


@dataclass
class Task:
    """What every engine translates: a model, its source ids (without EOS), references and vocabulary."""

    model: Transformer
    sources: list[list[int]]
    refs: list[str]
    pieces: list[str]  # id -> piece of the (shared or target) vocabulary
    src_pieces: list[str]
    detok: Callable[[list[int]], str]
    ct2_dirs: dict[str, Path]
    description: str


# The task: a trained run on Multi30k, or a random tiny model for --smoke -------------------------------


def run_task(run_dir: str, split: str, limit: int | None, work: Path, engines: Sequence[str]) -> Task:
    from aiayn.data.datasets import multi30k_split
    from aiayn.interop.ctranslate2 import export_run
    from aiayn.run_dir import load_run

    run = load_run(run_dir, "cpu")
    if not isinstance(run.model, Transformer):
        raise SystemExit(f"{run_dir} is a {run.cfg.task} run; this benchmark needs a translation run")
    d = run.cfg.data
    pairs = multi30k_split(split, d.src_lang, d.tgt_lang)[:limit]
    tok = run.tokenizers
    cap = run.cfg.model.max_positions - 1
    sources = [tok.src.encode(s)[:cap] for s, _ in pairs]
    ct2 = {}
    for e in engines:
        if e.startswith("ct2-"):
            quant = None if e == "ct2-fp32" else e.split("-", 1)[1]
            ct2[e] = export_run(run_dir, work / e, quantization=quant)
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

    ct2 = {}
    for e in engines:
        if e.startswith("ct2-"):
            quant = None if e == "ct2-fp32" else e.split("-", 1)[1]
            ct2[e] = export_ctranslate2(model, pieces, work / e, quantization=quant)
    return Task(model, sources, [detok(list(reversed(s))) for s in sources], pieces, pieces, detok, ct2,
                f"a random tiny model (smoke test) on {n} random sources")


# Engines: each translates a list of sources (ids without EOS) to a list of id lists ----------------------


def aiayn_engine(model: nn.Module, alpha: float, max_len: int, stop: str):
    def translate(batch: list[list[int]]) -> list[list[int]]:
        src = pad_batch([s + [EOS] for s in batch], PAD)
        hyps = beam_search(model, src, src != PAD, beam=4, alpha=alpha, length_penalty="power", max_len_a=0.0,
                           max_len_b=max_len, stop=stop, bos_id=BOS, eos_id=EOS, pad_id=PAD)
        return [h[0].tokens for h in hyps]

    return translate


def hf_engine(hf: nn.Module, alpha: float, max_len: int):
    def translate(batch: list[list[int]]) -> list[list[int]]:
        src = pad_batch([s + [EOS] for s in batch], PAD)
        with torch.no_grad():
            out = hf.generate(
                src, attention_mask=(src != PAD).long(), num_beams=4, num_return_sequences=1, length_penalty=alpha,
                early_stopping=False, max_length=max_len + 1,  # HF's max_length counts the start token
                min_length=0, do_sample=False, no_repeat_ngram_size=0, repetition_penalty=1.0,
                bad_words_ids=None, forced_bos_token_id=None, forced_eos_token_id=None,
            )
        result = []
        for seq in out.tolist():
            seq = seq[1:]  # the decoder start token
            result.append(seq[: seq.index(EOS)] if EOS in seq else seq)
        return result

    return translate


def ct2_engine(path: Path, compute_type: str, threads: int, task: Task, alpha: float, max_len: int):
    import ctranslate2

    translator = ctranslate2.Translator(str(path), device="cpu", compute_type=compute_type, inter_threads=1,
                                        intra_threads=threads)
    piece_id = {p: i for i, p in enumerate(task.pieces)}

    def translate(batch: list[list[int]]) -> list[list[int]]:
        # Pieces without </s>: the exported config appends it, as aiayn training did.
        results = translator.translate_batch(
            [[task.src_pieces[i] for i in s] for s in batch], beam_size=4, num_hypotheses=1,
            length_penalty=alpha, max_decoding_length=max_len, min_decoding_length=0, max_batch_size=0,
        )
        out = []
        for r in results:
            hyp = r.hypotheses[0]
            out.append([piece_id[p] for p in (hyp[:-1] if hyp and hyp[-1] == "</s>" else hyp)])
        return out

    return translate


# Timing -------------------------------------------------------------------------------------------------


def run_mode(translate: Callable, sources: Sequence[list[int]], batches: Sequence[list[int]],
             warmup_batches: int) -> tuple[list[list[int]], float]:
    """Translate ``batches`` (lists of source indices) after ``warmup_batches`` untimed ones.
    Returns (outputs in source order, seconds)."""
    for idx in batches[:warmup_batches]:
        translate([sources[i] for i in idx])
    out: list[list[int]] = [[] for _ in sources]
    t0 = time.perf_counter()
    for idx in batches:
        for i, hyp in zip(idx, translate([sources[i] for i in idx])):
            out[i] = hyp
    return out, time.perf_counter() - t0


def profile_search(translate: Callable, sources: Sequence[list[int]], batches: Sequence[list[int]],
                   path: Path) -> None:
    """Python-level (cProfile, by own time) and operator-level (torch.profiler) tables of one batched pass."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    prof.enable()
    run_mode(translate, sources, batches, 0)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        run_mode(translate, sources, batches, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("== cProfile (aiayn beam search, batched)\n" + text.getvalue() + "\n== torch.profiler\n"
                    + tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n", encoding="utf-8")


def bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    from aiayn.eval.metrics import sacrebleu_scores

    return sacrebleu_scores(hyps, refs)["bleu"]


def build_engines(task: Task, engines: Sequence[str], alpha: float, max_len: int, threads: int,
                  check_batch: Sequence[int]) -> tuple[dict[str, Callable], dict[str, Any]]:
    """The engines' translate functions, and what was checked while building them."""
    from aiayn.interop.marian import concat_layout_copy, to_hf_marian
    from benchmarks.train_throughput import HFMarianSeq2Seq

    fns: dict[str, Callable] = {}
    checks: dict[str, Any] = {}
    for e in engines:
        if e == "aiayn":
            fns[e] = aiayn_engine(task.model, alpha, max_len, "hf")
        elif e == "aiayn-exact":
            fns[e] = aiayn_engine(task.model, alpha, max_len, "exact")
        elif e == "hf":
            hf = to_hf_marian(concat_layout_copy(task.model)).eval()
            src = pad_batch([task.sources[i] + [EOS] for i in check_batch], PAD)
            g = torch.Generator().manual_seed(0)  # any target ids will do
            tgt = torch.cat([torch.full((len(check_batch), 1), BOS),
                             torch.randint(4, len(task.pieces), (len(check_batch), 12), generator=g)], dim=1)
            diff = common.max_logit_diff(task.model, HFMarianSeq2Seq(hf), src, tgt)
            if diff > 1e-4:
                raise SystemExit(f"the Hugging Face model does not compute aiayn's logits (max diff {diff:.2e})")
            checks["hf_max_logit_diff"] = diff
            checks["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
            fns[e] = hf_engine(hf, alpha, max_len)
        elif e in ("ct2-fp32", "ct2-int8"):
            fns[e] = ct2_engine(task.ct2_dirs[e], "float32" if e == "ct2-fp32" else "int8", threads, task,
                                alpha, max_len)
        else:
            raise SystemExit(f"unknown engine {e!r} (known: {', '.join(ENGINES)})")
    return fns, checks


# Report -------------------------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "## 2. Translation speed (beam 4, CPU)\n",
        common.provenance(result["machine"], result["command"], result["date"]),
        f"- Task: {result['task']}.",
        f"- Search: beam 4, length penalty score / |Y|^{a['alpha']} in every engine, at most {a['max_len']} "
        "decoding steps, one hypothesis. aiayn stop=hf and HF `generate()` (early_stopping=False) apply "
        "the same stopping rule and must agree token for token (column *= aiayn*); aiayn stop=exact is "
        "`aiayn translate`'s default; CTranslate2 stops once 4 hypotheses have finished (its default).",
        f"- Same weights: HF is the run converted by `to_hf_marian` (after the interleaved -> concat "
        f"re-layout; max |Δlogits| vs aiayn {result['checks'].get('hf_max_logit_diff', float('nan')):.1e}), "
        "CTranslate2 the run exported by `export_run` (int8: `quantization='int8'`).",
        f"- Timed: the search on ids only (tokenization/detokenization outside), after "
        f"{a['warmup_batches']} warm-up batches; batched = the same length-sorted batches of {a['batch_size']} "
        "sentences for every engine. BLEU: sacreBLEU 13a, cased, of each engine's own output.\n",
    ]
    headers = ["mode", "engine", "sentences/s", "target tokens/s", "seconds", "BLEU", "= aiayn",
               "aiayn speed-up"]
    rows, goals = [], []
    for mode, res in result["modes"].items():
        ours = res.get("aiayn")
        for e, r in res.items():
            ratio = ours["sentences_per_s"] / r["sentences_per_s"] if ours and e != "aiayn" else None
            rows.append([mode, LABELS[e], f"{r['sentences_per_s']:,.1f}", f"{r['tokens_per_s']:,.0f}",
                         f"{r['seconds']:.1f}", f"{r['bleu']:.2f}",
                         f"{r['same_as_aiayn']}/{r['sentences']}" if "same_as_aiayn" in r else "",
                         f"{ratio:.2f}x" if ratio else ""])
        if mode == "batched" and ours:
            if "hf" in res:
                goals.append("- batched aiayn / HF generate() sentences/s = "
                             + common.goal_cell(ours["sentences_per_s"] / res["hf"]["sentences_per_s"], 3.0))
            if "ct2-fp32" in res:
                goals.append("- batched aiayn / CTranslate2 fp32 sentences/s = "
                             + common.goal_cell(ours["sentences_per_s"] / res["ct2-fp32"]["sentences_per_s"], 0.5))
    lines.append(common.markdown_table(headers, rows))
    if goals:
        lines.append("Goals (batched beam decoding >= 3x HF generate() and >= 0.5x CTranslate2 fp32):\n")
        lines += goals
    if a.get("profile"):
        lines.append(f"\nProfiles of aiayn's batched pass (cProfile, torch.profiler): `{a['profile']}`.")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.translate_speed", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/multi30k_en_de_quick", help="a trained translation run")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--limit", type=int, help="translate the first N sentences only")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--modes", nargs="+", default=["batch-1", "batched"], choices=["batch-1", "batched"])
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch in batched mode")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty exponent (power)")
    p.add_argument("--max-len", type=int, default=100, help="decoding steps at most (EOS included)")
    p.add_argument("--warmup-batches", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per core)")
    p.add_argument("--profile", help="write cProfile and torch.profiler tables of aiayn's batched pass here")
    p.add_argument("--smoke", action="store_true", help="seconds-long run on a random tiny model (CI)")
    p.add_argument("--md", default=str(common.DEFAULT_MD), help="markdown file whose section is rewritten")
    p.add_argument("--out-json", default=None, help=f"default: benchmarks/results/{NAME}.json")
    args = p.parse_args(argv)
    args.engines = [e for e in ENGINES if e in args.engines]  # aiayn first: the others are compared with it
    if args.smoke:
        args.limit = args.limit or 8
        args.batch_size, args.max_len, args.warmup_batches = 4, 8, 1
    return args


def main(argv: Sequence[str] | None = None, command: str | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    result: dict[str, Any] = {
        "benchmark": NAME, "date": common.utc_now(), "command": command or common.command_line(NAME, argv),
        "machine": common.machine_info(threads), "args": vars(args), "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.smoke and "--run-dir" not in argv:
            task = smoke_task(args.limit, work, args.engines)
        else:
            task = run_task(args.run_dir, args.split, args.limit, work, args.engines)
        order = sorted(range(len(task.sources)), key=lambda i: (len(task.sources[i]), i))
        fns, checks = build_engines(task, args.engines, args.alpha, args.max_len, threads, order[-8:])
        result["task"], result["checks"] = task.description, checks
        plans = {
            "batch-1": [[i] for i in range(len(task.sources))],
            "batched": [order[k: k + args.batch_size] for k in range(0, len(order), args.batch_size)],
        }
        for mode in args.modes:
            batches = plans[mode]
            warm = args.warmup_batches * (8 if mode == "batch-1" else 1)
            res: dict[str, Any] = {}
            for e in args.engines:
                print(f"[{NAME}] {mode}: {e} ...", file=sys.stderr, flush=True)
                outputs, seconds = run_mode(fns[e], task.sources, batches, warm)
                tokens = sum(len(o) for o in outputs)
                r = {"sentences": len(outputs), "seconds": seconds, "sentences_per_s": len(outputs) / seconds,
                     "target_tokens": tokens, "tokens_per_s": tokens / seconds,
                     "bleu": bleu([task.detok(o) for o in outputs], task.refs)}
                if "aiayn" in res:
                    r["same_as_aiayn"] = sum(a == b for a, b in zip(outputs, res["aiayn"]["outputs"]))
                r["outputs"] = outputs
                res[e] = r
                print(f"[{NAME}] {mode}: {e} {r['sentences_per_s']:.1f} sentences/s, BLEU {r['bleu']:.2f}",
                      file=sys.stderr)
            result["modes"][mode] = res
        if args.profile and "aiayn" in fns:
            profile_search(fns["aiayn"], task.sources, plans["batched"], Path(args.profile))
    for res in result["modes"].values():  # token ids are not worth keeping in the JSON
        for r in res.values():
            r.pop("outputs")
    common.write_json(args.out_json or common.RESULTS_DIR / f"{NAME}.json", result)
    common.update_section(args.md, NAME, markdown(result))
    return result


if __name__ == "__main__":
    main()
