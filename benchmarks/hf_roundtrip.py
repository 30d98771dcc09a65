"""Full-size equality check of the Hugging Face round trip (a command, not a CI test): one trained run, every
line of a split, token for token.

1. Export: ``aiayn export hf RUN DIR``; ``MarianTokenizer.from_pretrained(DIR)`` must encode every source
   line as the run's tokenizer does, and ``MarianMTModel.from_pretrained(DIR).generate()`` (fp32, beam and
   alpha of the run, power length penalty, ``early_stopping=False``, each sentence's ``max_length`` from
   aiayn's rule ``int(a * (source tokens + 1) + b) + 1``) must give the token ids of
   ``aiayn translate RUN --beam B --length-penalty power --stop hf``; the texts (``batch_decode`` with
   ``skip_special_tokens=True`` vs aiayn's output) are compared too.
2. Import back: ``aiayn import hf DIR RUN2``; ``aiayn translate RUN2`` with its own (imported) decoding
   settings must give what plain ``generate()`` gives with DIR's generation config.

    python -m benchmarks.hf_roundtrip --run-dir runs/m30k_quick --split test_2016_flickr

Prints one summary line per check and the first differing lines; ``--out-json`` keeps the numbers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import aiayn
from aiayn.config import load_config
from aiayn.eval.evaluate import split_pairs
from aiayn.interop.hf import export_hf, hf_generate, import_hf
from benchmarks import common


def _report(name: str, ours: Sequence, theirs: Sequence, show: int = 3) -> dict:
    same = [a == b for a, b in zip(ours, theirs)]
    print(f"{name}: {sum(same)} equal of {len(same)}")
    for i, ok in enumerate(same):
        if not ok and show > 0:
            show -= 1
            print(f"  line {i + 1}:\n    aiayn: {ours[i]!r}\n    hf:    {theirs[i]!r}")
    return {"equal": sum(same), "total": len(same), "differ": [i + 1 for i, ok in enumerate(same) if not ok]}


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, help="a trained translation run (SentencePiece BPE)")
    p.add_argument("--split", default="test_2016_flickr", help="a split of the run's dataset")
    p.add_argument("--limit", type=int, default=None, help="only the first N lines")
    p.add_argument("--work-dir", default=None, help="where the export and the re-import go (default: a temp dir)")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per generate() call")
    p.add_argument("--skip-import", action="store_true", help="only the export direction")
    p.add_argument("--import-limit", type=int, default=None,
                   help="the import direction on the first N lines only (its max_length is the model's: slow)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-json", default=None)
    args = p.parse_args(argv)
    threads = common.set_threads(args.threads)
    from transformers import MarianMTModel, MarianTokenizer

    run = Path(args.run_dir)
    sources = [s for s, _ in split_pairs(load_config(run / "config.yaml"), args.split)][: args.limit]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hf-roundtrip-"))
    result: dict = {"command": common.command_line("hf_roundtrip", sys.argv[1:] if argv is None else argv),
                    "machine": common.machine_info(threads), "run": str(run.resolve()), "split": args.split,
                    "lines": len(sources)}

    out = export_hf(run, work / "hf", force=True)
    tok, hf = MarianTokenizer.from_pretrained(out), MarianMTModel.from_pretrained(out).eval()
    translator = aiayn.load(run, "cpu")
    result["tokenization"] = _report("tokenization (MarianTokenizer vs the run's)", [
        translator.tokenizers.src.encode(s) + [translator.tokenizers.specials.eos] for s in sources],
        [tok(s)["input_ids"] for s in sources], show=1)
    opts = translator.options(length_penalty="power", stop="hf")
    t0 = time.perf_counter()
    ours = translator.translate_hypotheses(sources, opts)
    t1 = time.perf_counter()
    theirs = hf_generate(hf, tok, sources, opts, translator.cfg.model.max_positions, args.batch_size)
    t2 = time.perf_counter()
    start = hf.generation_config.decoder_start_token_id
    result["export_ids"] = _report(f"export: generate() vs aiayn translate --beam {opts.beam} --alpha {opts.alpha} "
                                   "--length-penalty power --stop hf, token ids", [h[0].ids for h in ours], theirs)
    result["export_text"] = _report("export: batch_decode vs aiayn text", [h[0].text for h in ours],
                                    tok.batch_decode([[start] + t for t in theirs], skip_special_tokens=True))
    result["seconds"] = {"aiayn": round(t1 - t0, 1), "hf": round(t2 - t1, 1)}

    if not args.skip_import:
        run2 = import_hf(out, work / "imported", force=True)
        again, lines = aiayn.load(run2, "cpu"), sources[: args.import_limit]
        eos = hf.generation_config.eos_token_id
        plain = []
        with torch.no_grad():
            for k in range(0, len(lines), args.batch_size):
                batch = tok(lines[k : k + args.batch_size], return_tensors="pt", padding=True)
                for seq in hf.generate(**batch).tolist():
                    plain.append(seq[1 : seq.index(eos, 1)] if eos in seq[1:] else seq[1:])
        result["import_ids"] = _report("import: aiayn translate RUN2 vs plain generate(), token ids",
                                       [h[0].ids for h in again.translate_hypotheses(lines)], plain)
    print(f"seconds: aiayn {result['seconds']['aiayn']}, hf {result['seconds']['hf']} ({threads} threads); "
          f"export in {out}")
    if args.out_json:
        common.write_json(args.out_json, result)
    return result


if __name__ == "__main__":
    main()
