"""Validation BLEU after each kept checkpoint of a translation run: what a recipe's updates give, the numbers a
recipe's ``expect.bleu`` quotes to a user whose machine will only reach some of them.

    python -m benchmarks.bleu_by_updates RUN [--split val] [--beam 1] [--precision fp32] [--out-json F]

Train the run with every checkpoint kept (e.g. ``--set train.keep_last=1000``). Each checkpoint's weights are
loaded into the run's model in turn and the split is translated (greedy by default, as validation BLEU during
training is) and scored with sacreBLEU (13a, cased), in fp32 by default whatever the CPU (so runs trained in
different precisions are scored alike). Prints one JSON line per checkpoint and the YAML ready
for the recipe's ``expect`` section.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bleu_by_updates", description=__doc__.split("\n")[0])
    p.add_argument("run")
    p.add_argument("--split", default="val")
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--precision", default="fp32", help="the decoding's (aiayn.load's; default fp32)")
    p.add_argument("--out-json")
    args = p.parse_args(argv)

    import sacrebleu

    import aiayn
    from aiayn.eval.evaluate import split_pairs
    from aiayn.run.weights import checkpoint_paths, list_checkpoints, load_weights

    tr = aiayn.load(args.run, precision=args.precision)
    pairs = split_pairs(tr.cfg, args.split)
    sources, refs = [s for s, _ in pairs], [r for _, r in pairs]
    rows = []
    for step in list_checkpoints(args.run):
        load_weights(tr.model, checkpoint_paths(args.run, step)[0])
        t0 = time.perf_counter()
        hyps = tr.translate(sources, beam=args.beam)
        bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
        rows.append({"step": step, "bleu": round(bleu, 2), "decode_s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    result = {"command": "python -m benchmarks.bleu_by_updates " + " ".join(argv or sys.argv[1:]),
              "split": args.split, "beam": args.beam, "precision": args.precision, "lines": len(pairs), "rows": rows}
    print("expect:\n  bleu: [" + ", ".join(f"[{r['step']}, {r['bleu']:.1f}]" for r in rows) + "]")
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
