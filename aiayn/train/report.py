"""``aiayn report RUN``: what a run did, read from its files (nothing is loaded or recomputed).

From ``metrics.jsonl``: the last update and epoch, the training time (``elapsed_s``, which includes
the time before a ``--resume``), throughput as the median and middle half of the logged windows'
target tokens/s (each window is ``train.log_every`` updates; the median ignores the odd window slowed
by an evaluation, a checkpoint or another process), and the validation NLL, last and best.
From the evaluation files (``eval/*.json`` of a run directory, or ``*.json`` beside the metrics in a
``results/`` copy): each file's scores. README and docs quote throughput from this command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.train.metrics_log import curves_data, metrics_path

REPORT_KEYS = ("epoch", "elapsed_s", "tokens_per_s", "valid_nll")


def _eval_scores(run: Path) -> dict[str, dict[str, float]]:
    """{file stem: numeric scores} of the evaluation files in ``run/eval`` (or ``run`` itself)."""
    folder = run / "eval" if (run / "eval").is_dir() else run
    out = {}
    for p in sorted(folder.glob("*.json")):
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except ValueError:
            continue  # not an evaluation file (or one being written)
        if isinstance(rec, dict) and isinstance(rec.get("scores"), dict):
            out[p.stem] = {k: v for k, v in rec["scores"].items() if isinstance(v, (int, float))}
    return out


def _precision(path: Path) -> dict[str, str] | None:
    """{"precision", "why"} of the last start named in the metrics file (None for a run trained before it was
    logged)."""
    found = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"precision"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if isinstance(rec, dict) and isinstance(rec.get("precision"), str):
                found = {"precision": rec["precision"], "why": str(rec.get("precision_why") or "")}
    return found


def run_report(run_or_file: str | Path) -> dict[str, Any]:
    """The numbers ``aiayn report`` prints, as a dict (``--json`` prints it as is).

    Keys: ``metrics`` (path), ``step``, ``epoch``, ``elapsed_s`` and ``elapsed_step`` (the time at the
    last training log and its step), ``tokens_per_s`` ({median, p25, p75,
    windows}) or None, ``valid_nll`` ({last, last_step, best, best_step}) or None, ``precision``
    ({precision, why} of the last start) or None, ``evals`` ({name: scores}).
    """
    path = metrics_path(run_or_file)
    series = curves_data(path, keys=REPORT_KEYS)
    steps = [int(s.steps[-1]) for s in series.values()]
    rep: dict[str, Any] = {"metrics": str(path), "step": max(steps)}
    rep["epoch"] = int(series["epoch"].values[-1]) if "epoch" in series else None
    el = series.get("elapsed_s")
    # Time is logged with the training windows only, so the last value can precede the last step.
    rep["elapsed_s"] = float(el.values[-1]) if el is not None else None
    rep["elapsed_step"] = int(el.steps[-1]) if el is not None else None
    rep["elapsed_at"] = "log"
    last = _last_checkpoint(path.parent)  # the state a stopped run saved: its real last update and time
    if last is not None and last["step"] >= rep["step"] and isinstance(last.get("elapsed_s"), (int, float)):
        rep.update(step=last["step"], elapsed_s=float(last["elapsed_s"]), elapsed_step=last["step"],
                   elapsed_at="checkpoint")
    tps = series.get("tokens_per_s")
    if tps is not None:  # curves_data returns only series that have points
        p25, med, p75 = np.percentile(tps.values, [25, 50, 75])
        rep["tokens_per_s"] = {"median": float(med), "p25": float(p25), "p75": float(p75), "windows": len(tps)}
    else:
        rep["tokens_per_s"] = None
    nll = series.get("valid_nll")
    if nll is not None:
        b = int(np.argmin(nll.values))
        rep["valid_nll"] = {"last": float(nll.values[-1]), "last_step": int(nll.steps[-1]),
                            "best": float(nll.values[b]), "best_step": int(nll.steps[b])}
    else:
        rep["valid_nll"] = None
    rep["precision"] = _precision(path)
    rep["evals"] = _eval_scores(path.parent)
    return rep


def _last_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The newest checkpoint's state (its step and training time), or None. :func:`run_report` takes its step and
    time (``elapsed_at``: ``checkpoint``, else ``log``) when it is the run's last update, as when a run stops
    between two training logs."""
    from aiayn.run.weights import checkpoint_paths, list_checkpoints

    steps = list_checkpoints(run_dir)
    if not steps:
        return None
    try:
        state = json.loads(checkpoint_paths(run_dir, steps[-1])[2].read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("step"), int) else None


def format_report(rep: dict[str, Any]) -> str:
    """Human-readable lines of :func:`run_report`'s dict."""
    lines = [f"metrics      {rep['metrics']}"]
    upd = f"updates      {rep['step']:,}"
    if rep["epoch"] is not None:
        upd += f" (epoch {rep['epoch']})"
    if rep["elapsed_s"] is not None:
        at = "its last checkpoint" if rep.get("elapsed_at") == "checkpoint" else "the last training log"
        upd += (f"; {rep['elapsed_s']:,.0f} s ({rep['elapsed_s'] / 60:.1f} min) of training at {at} "
                f"(step {rep['elapsed_step']:,})")
    lines.append(upd)
    p = rep.get("precision")
    if p:
        lines.append(f"precision    {p['precision']}" + (f" ({p['why']})" if p["why"] else ""))
    t = rep["tokens_per_s"]
    if t:
        lines.append(f"throughput   {t['median']:,.0f} target tokens/s median (middle half {t['p25']:,.0f}-"
                     f"{t['p75']:,.0f}) over {t['windows']} logged windows")
    v = rep["valid_nll"]
    if v:
        lines.append(f"valid NLL    last {v['last']:.3f} (step {v['last_step']:,}), "
                     f"best {v['best']:.3f} (step {v['best_step']:,})")
    if rep["evals"]:
        width = max(len(n) for n in rep["evals"])
        for name, scores in rep["evals"].items():
            vals = "  ".join(f"{k} {val:.2f}" for k, val in scores.items())
            lines.append(f"eval         {name:<{width}}  {vals}")
    return "\n".join(lines)


def report_cli(args) -> int:
    """``aiayn report RUN [--json]``."""
    rep = run_report(args.run)
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0
