"""ROUGE of a run's summaries on a split, beside the lead-1 baseline (the document's first sentence).

``aiayn evaluate RUN --split test`` calls :func:`evaluate_summaries` for summarization runs (both kinds:
a "document <sep> summary" language model and an encoder-decoder); it writes
``RUN/eval/rouge_<split>.{json,hyp}``. The lead-1 baseline alone::

    python -m aiayn.eval.summaries --lead1 [--split test]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiayn.config import DecodeOptions
from aiayn.data.registry import dataset_of
from aiayn.data.summarization import collapse_whitespace, lead_1, xsum_split
from aiayn.decode.loaded import merged_options
from aiayn.errors import UserError, first_line
from aiayn.eval.results import check_writable, scored_weights, write_result
from aiayn.eval.scorers import rouge_scores
from aiayn.files import now


def lead1_scores(split: str = "test") -> dict[str, float]:
    """ROUGE-1/2/L (percent) of the lead-1 baseline on an XSum split: each document's first sentence."""
    rows = xsum_split(split)
    return rouge_scores([lead_1(r["document"]) for r in rows], [collapse_whitespace(r["summary"]) for r in rows])


def evaluate_summaries(run_dir: str | Path, split: str = "test", options: DecodeOptions | None = None,
                       device: str = "auto", precision: str = "auto", weights: str = "model", **overrides
                       ) -> dict[str, Any]:
    """Summarize a split of the run's data, score ROUGE-1/2/L (and lead-1 on XSum), write
    ``RUN/eval/rouge_<split>.json`` and ``.hyp`` (``rouge_<split>.<weights>`` for other ``weights`` than the run's
    own, :func:`aiayn.run.weights.select_weights`); return the record. Options: the run's ``decode`` section, then
    ``options``, then the non-None ``overrides`` (``max_new_tokens`` default 64)."""
    from aiayn.decode.generate import new_token_limit, summarize, summarizer_of
    from aiayn.run.directory import load_run

    run_dir = Path(run_dir)
    chosen, run_info, label = scored_weights(run_dir, weights)
    run = load_run(run_dir, device, chosen, precision=precision)
    opts = merged_options(run.cfg.decode, options, **overrides)
    pairs = dataset_of(run.cfg).pairs(run.cfg.data, run.cfg.kind, split)
    name = f"rouge_{split}" if label is None else f"rouge_{split}.{label}"
    check_writable(run_dir, name)
    start = time.perf_counter()
    hyps = summarize(run, [d for d, _ in pairs], opts)
    wall = time.perf_counter() - start
    kind = summarizer_of(run).how(opts)
    max_new = new_token_limit(opts, "summarize")
    result: dict[str, Any] = {
        "name": name,
        "task": run.cfg.task,
        "data": {"dataset": run.cfg.data.dataset, "split": split, "n_documents": len(pairs)},
        "scores": {k: round(v, 2) for k, v in rouge_scores(hyps, [s for _, s in pairs]).items()},
        "decode": {"how": kind, "max_new_tokens": max_new, "no_repeat_ngram": opts.no_repeat_ngram},
        "run": run_info,
        "wall_s": round(wall, 3),
        "created": now(),
    }
    if dataset_of(run.cfg).lead_1:
        result["lead1"] = {k: round(v, 2) for k, v in lead1_scores(split).items()}
    result["json_path"] = str(write_result(run_dir, result["name"], result, hyps))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiayn.eval.summaries --lead1 [--split test]``: ROUGE of the lead-1 baseline on XSum."""
    p = argparse.ArgumentParser(prog="python -m aiayn.eval.summaries", description="ROUGE of the lead-1 baseline")
    p.add_argument("--lead1", action="store_true", required=True, help="score the lead-1 baseline (XSum)")
    p.add_argument("--split", default="test")
    args = p.parse_args(argv)
    try:
        scores = lead1_scores(args.split)
    except (UserError, OSError) as e:
        print(f"aiayn: error: {first_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps({"lead1": {"split": args.split, **{k: round(v, 2) for k, v in scores.items()}}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
