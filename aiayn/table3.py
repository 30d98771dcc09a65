"""The paper's Table 3, runnable: every variation of the base model as a named row, a runner that trains and
evaluates each row on a base recipe, and the table it writes beside the paper's own numbers.

A row is a change relative to the base recipe, stated as the paper states it at its scale (d_model 512, h 8,
N 6, d_ff 2048) and applied in proportion to the base it is given: on paper-base it gives the paper's exact
values (row A1: h = 1, d_k = d_v = 512), on a small base the same ratios (h = 1, d_k = d_v = d_model). So the
command that runs a small table on a CPU is the recipe for the paper's table on GPUs, with a WMT14 base.

Each (row, seed) trains into OUT/runs/ROW-seedS and leaves OUT/results/ROW-seedS.json when evaluated; a
rerun skips what is done and resumes a row from its last checkpoint, so an interrupted table goes on row by
row. ``--parallel N`` trains N rows at a time in N processes (several small models share one GPU); several
runners may also share one OUT (e.g. one per GPU, or two one-thread runners on a 2-core CPU, with other --rows):
a row another runner or process holds is skipped, and every runner writes the table of all the results there
when it ends (:mod:`aiayn.runner` runs the plan, as for ``aiayn sweep``).

The columns are the paper's: perplexity per subword token on the validation set (the model's valid NLL after
the last update, no label smoothing) and BLEU on it (sacreBLEU, the recipe's beam search, no checkpoint
averaging, as the paper's Table 3), plus the parameter count at the paper's sizes (37k shared vocabulary).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from aiayn.config import SPEED_KEYS, Config, ConfigError, load_config
from aiayn.errors import DataError
from aiayn.files import atomic_write_json, atomic_write_text, check_writable, guard_output_dir
from aiayn.runner import Job, Trained, run_jobs, settings_of, share_cpu

log = logging.getLogger("aiayn.table3")

PAPER_STEPS = 100_000  # the paper's base rows train 100K steps; big 300K
PAPER_VOCAB = 37_000  # shared BPE vocabulary of the paper's En-De models


@dataclass(frozen=True)
class Paper:
    """A row's numbers in the paper: dev (newstest2013) perplexity per wordpiece and BLEU, parameters x 10^6
    (None where the paper leaves the cell empty: the same as base)."""

    ppl: float
    bleu: float
    params_m: float | None = None


@dataclass(frozen=True)
class Row:
    """One line of Table 3: ``change`` as the paper writes it; ``settings(base)`` gives the config overrides
    that make the change on ``base``; ``steps`` multiplies the base's updates (big trains 3x longer)."""

    name: str
    group: str
    change: str
    settings: Callable[[Config], dict[str, Any]]
    paper: Paper
    steps: float = 1.0


def _scaled(value: int, factor: float) -> int:
    return max(1, round(value * factor))


def _heads(factor: float) -> Callable[[Config], dict[str, Any]]:
    """Row A: h scaled, d_k = d_v = d_model / h (the amount of computation stays constant)."""
    def settings(c: Config) -> dict[str, Any]:
        h = _scaled(c.model.n_heads, factor)
        width = max(1, c.model.d_model // h)
        return {"model.n_heads": h, "model.d_k": width, "model.d_v": width}
    return settings


def _key_width(factor: float) -> Callable[[Config], dict[str, Any]]:
    """Row B: d_k scaled, d_v and everything else as base."""
    return lambda c: {"model.d_k": _scaled(c.model.key_width, factor), "model.d_v": c.model.value_width}


def _layers(factor: float) -> Callable[[Config], dict[str, Any]]:
    return lambda c: {"model.n_encoder_layers": _scaled(c.model.n_encoder_layers, factor),
                      "model.n_decoder_layers": _scaled(c.model.n_decoder_layers, factor)}


def _width(factor: float) -> Callable[[Config], dict[str, Any]]:
    """Row C, d_model: the model width scaled with h fixed, so d_k = d_v = d_model / h scale with it."""
    def settings(c: Config) -> dict[str, Any]:
        d = _scaled(c.model.d_model, factor)
        d -= d % 2  # sinusoidal positions need an even width
        width = max(1, d // c.model.n_heads)
        return {"model.d_model": d, "model.d_k": width, "model.d_v": width}
    return settings


def _big(c: Config) -> dict[str, Any]:
    d, h = 2 * c.model.d_model, 2 * c.model.n_heads
    return {"model.d_model": d, "model.n_heads": h, "model.d_ff": 2 * c.model.d_ff, "model.dropout": 0.3,
            "model.d_k": d // h, "model.d_v": d // h}


# Table 3 of the paper, in its order; every change relative to the base row (N=6, d_model=512, d_ff=2048,
# h=8, d_k=d_v=64, P_drop=0.1, eps_ls=0.1, 100K steps).
ROWS: tuple[Row, ...] = (
    Row("base", "base", "base", lambda c: {}, Paper(4.92, 25.8, 65)),
    Row("A1", "A", "h=1, d_k=d_v=512", _heads(1 / 8), Paper(5.29, 24.9)),
    Row("A2", "A", "h=4, d_k=d_v=128", _heads(1 / 2), Paper(5.00, 25.5)),
    Row("A3", "A", "h=16, d_k=d_v=32", _heads(2), Paper(4.91, 25.8)),
    Row("A4", "A", "h=32, d_k=d_v=16", _heads(4), Paper(5.01, 25.4)),
    Row("B1", "B", "d_k=16", _key_width(1 / 4), Paper(5.16, 25.1, 58)),
    Row("B2", "B", "d_k=32", _key_width(1 / 2), Paper(5.01, 25.4, 60)),
    Row("C1", "C", "N=2", _layers(1 / 3), Paper(6.11, 23.7, 36)),
    Row("C2", "C", "N=4", _layers(2 / 3), Paper(5.19, 25.3, 50)),
    Row("C3", "C", "N=8", _layers(4 / 3), Paper(4.88, 25.5, 80)),
    Row("C4", "C", "d_model=256, d_k=d_v=32", _width(1 / 2), Paper(5.75, 24.5, 28)),
    Row("C5", "C", "d_model=1024, d_k=d_v=128", _width(2), Paper(4.66, 26.0, 168)),
    Row("C6", "C", "d_ff=1024", lambda c: {"model.d_ff": _scaled(c.model.d_ff, 1 / 2)}, Paper(5.12, 25.4, 53)),
    Row("C7", "C", "d_ff=4096", lambda c: {"model.d_ff": _scaled(c.model.d_ff, 2)}, Paper(4.75, 26.2, 90)),
    Row("D1", "D", "P_drop=0.0", lambda c: {"model.dropout": 0.0}, Paper(5.77, 24.6)),
    Row("D2", "D", "P_drop=0.2", lambda c: {"model.dropout": 0.2}, Paper(4.95, 25.5)),
    Row("D3", "D", "eps_ls=0.0", lambda c: {"train.label_smoothing": 0.0}, Paper(4.67, 25.3)),
    Row("D4", "D", "eps_ls=0.2", lambda c: {"train.label_smoothing": 0.2}, Paper(5.47, 25.7)),
    Row("E", "E", "positional embedding instead of sinusoids", lambda c: {"model.positional": "learned"},
        Paper(4.92, 25.7)),
    Row("big", "big", "d_model=1024, d_ff=4096, h=16, P_drop=0.3, 300K steps", _big, Paper(4.33, 26.4, 213), 3.0),
)
BY_NAME = {r.name: r for r in ROWS}
GROUPS = ("base", "A", "B", "C", "D", "E", "big")


def select_rows(spec: str | Sequence[str]) -> list[Row]:
    """Rows named by ``spec``: "all", or names and group letters, comma-separated ("base,A,B1,C4"), in the
    paper's order; base always comes along (the other rows are read against it)."""
    items = [s.strip() for part in ([spec] if isinstance(spec, str) else spec) for s in part.split(",")]
    items = [s for s in items if s]
    if not items:
        raise ConfigError("--rows: name at least one row (all, a group A-E, big, or rows like A1,B2)")
    wanted: set[str] = {"base"}
    for item in items:
        if item.lower() == "all":
            wanted.update(BY_NAME)
        elif item in GROUPS:
            wanted.update(r.name for r in ROWS if r.group == item)
        elif item in BY_NAME:
            wanted.add(item)
        else:
            raise ConfigError(f"--rows: no row {item!r} in Table 3 (rows: all, {', '.join(GROUPS)}, "
                              f"{', '.join(r.name for r in ROWS if r.group not in ('base', 'big'))})")
    return [r for r in ROWS if r.name in wanted]


def _override_list(settings: dict[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in settings.items()]


def row_config(base: str | Path, row: Row, seed: int, updates: int | None = None,
               extra: Sequence[str] = ()) -> Config:
    """The config of ``row`` on the ``base`` recipe: its changes, ``seed``, the base's updates (or ``updates``)
    times the row's step factor; the last weights for inference (the paper averaged no checkpoints here)."""
    cfg = load_config(base, list(extra))
    n = updates if updates is not None else cfg.train.max_updates
    over = _override_list(row.settings(cfg)) + [
        f"train.seed={seed}", f"train.max_updates={max(1, round(n * row.steps))}",
        "train.inference_weights=last", "train.eval_bleu=false"]
    return load_config(base, [*extra, *over])


def parameters_at(cfg: Config) -> int:
    """Trainable parameters of ``cfg``'s model, counted on the meta device (no memory, no initialisation)."""
    from aiayn.model import build_model, count_parameters

    with torch.device("meta"):
        return count_parameters(build_model(cfg.model, cfg.task))


def paper_parameters(row: Row, base: str | Path = "paper-base") -> int:
    """``row`` applied to paper-base with the paper's 37k shared vocabulary: the paper's parameter column."""
    cfg = load_config(base, [f"model.vocab_size={PAPER_VOCAB}"])
    return parameters_at(load_config(base, [f"model.vocab_size={PAPER_VOCAB}", *_override_list(row.settings(cfg))]))


def _row_label(row: Row, cfg: Config, base: Config) -> str:
    """What the row sets on this base, e.g. "n_heads=1 d_k=128 d_v=128" (only the values that differ)."""
    out = []
    for key, shown in (("n_heads", "h"), ("key_width", "d_k"), ("value_width", "d_v"), ("n_encoder_layers", "N"),
                       ("d_model", "d_model"), ("d_ff", "d_ff"), ("dropout", "P_drop"), ("positional", "positions")):
        value = getattr(cfg.model, key)
        if value != getattr(base.model, key):
            out.append(f"{shown}={value}")
    if cfg.train.label_smoothing != base.train.label_smoothing:
        out.append(f"eps_ls={cfg.train.label_smoothing}")
    if cfg.train.max_updates != base.train.max_updates:
        out.append(f"{cfg.train.max_updates} updates")
    return " ".join(out) or "base"


def _result_path(out: Path, row: Row, seed: int) -> Path:
    return out / "results" / f"{row.name}-seed{seed}.json"


# Settings a table's results may differ in: those that never change a row's numbers (where and how fast it runs,
# what it logs and keeps, where its tokenized corpus lies: a store is keyed by its content), and the updates, which
# --updates may set per invocation (the big row's shorter run in docs/table3.md); each result keeps its own count
# and the table shows it. Every other setting of the base is part of every result.
UNSCORED = ("train.threads", "train.device", "train.log_every", "train.log_to", "train.save_every",
            "train.keep_last", "train.dist_timeout_s", "train.setup_timeout_s", "train.compile", "train.compile_mode",
            "data.prepared", "train.max_updates", *SPEED_KEYS)

# Every field a result holds, with its JSON type (float: any finite number).
RESULT_FIELDS: dict[str, type] = {
    "row": str, "group": str, "change": str, "seed": int, "here": str, "updates": int, "parameters": int,
    "valid_nll": float, "ppl": float, "bleu": float, "chrf": float, "bleu_signature": str, "beam": int,
    "wall_s": float}


def base_settings(cfg: Config) -> dict[str, Any]:
    """The settings of a table's base that all its results share, ``key.sub: value`` (JSON values): the base
    config without :data:`UNSCORED`."""
    return settings_of(cfg, UNSCORED)


def read_result(path: Path) -> dict[str, Any]:
    """One ``OUT/results/ROW-seedS.json``, checked whole: UTF-8 JSON, an object with every field of
    :data:`RESULT_FIELDS` of its type, a known row, and the row and seed its name says. Anything else is a
    one-line DataError naming the file (the one reader of every result: the runner and the table use it)."""
    fix = "delete it to train and evaluate that row again"
    try:
        rec = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a Table 3 result (not UTF-8 text: byte {e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not a Table 3 result (not JSON: {e.msg} at line {e.lineno}); {fix}") from None
    except (RecursionError, ValueError):
        raise DataError(f"{path}: not a Table 3 result (not JSON this reader takes); {fix}") from None
    if not isinstance(rec, dict):
        raise DataError(f"{path}: not a Table 3 result (a JSON {type(rec).__name__}, not an object); {fix}")
    for name, kind in RESULT_FIELDS.items():
        value = rec.get(name)
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else:
            ok = isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            what = "is missing" if name not in rec else f"is not {'a number' if kind is float else kind.__name__}"
            raise DataError(f"{path}: not a complete Table 3 result (its field {name!r} {what}); {fix}")
    if rec["row"] not in BY_NAME or path.name != f"{rec['row']}-seed{rec['seed']}.json":
        raise DataError(f"{path}: holds row {rec['row']!r} seed {rec['seed']}, not the row and seed its name says; "
                        f"{fix}")
    if not isinstance(rec.get("base_settings", {}), dict):
        raise DataError(f"{path}: its field 'base_settings' is not an object; {fix}")
    return rec


def check_result(path: Path, rec: dict[str, Any], settings: dict[str, Any]) -> None:
    """A one-line DataError naming ``path`` and the first setting where the result ``rec`` was made under other
    ``settings`` (:func:`base_settings`) than this table's: one table is one base. (A result written before results
    recorded their settings is taken as it is.)"""
    theirs = rec.get("base_settings")
    if theirs is None:
        return
    for key in sorted(set(theirs) | set(settings)):
        if theirs.get(key) != settings.get(key):
            raise DataError(f"{path}: made with {key}={json.dumps(theirs.get(key))}, this table has "
                            f"{key}={json.dumps(settings.get(key))}: one table needs one set of settings (use "
                            "another --out for other settings, or delete the file to train that row again)")


def check_results(out: Path, settings: dict[str, Any]) -> None:
    """Every result in ``out``/results, read (:func:`read_result`) and checked against this table's ``settings``."""
    for p in sorted((out / "results").glob("*.json")):
        check_result(p, read_result(p), settings)


@dataclass(frozen=True)
class _Rows:
    """What scoring a trained row needs (sent to worker processes): the table's directory and base settings,
    and which (row, seed) each job is."""

    out: Path
    settings: dict[str, Any]
    who: dict[str, tuple[str, int, str]]  # job name -> (row, seed, what the row sets on this base)


def _finish_row(ctx: _Rows, job: Job, trained: Trained) -> None:
    """A trained row scored as the paper's Table 3 scores it (validation perplexity and BLEU); its result written."""
    from aiayn.eval.evaluate import EvalData, evaluate_translation
    from aiayn.train.report import run_report
    from aiayn.train.resume import CheckpointMeta

    name, seed, here = ctx.who[job.name]
    row, run_dir = BY_NAME[name], job.run_dir
    nll = run_report(run_dir)["valid_nll"]
    if nll is None or nll["last_step"] != trained.step:
        raise RuntimeError(f"{run_dir}: no validation after the last update")  # the trainer always evaluates
    ev = evaluate_translation(run_dir, EvalData(split="valid", name="table3_valid"))
    record = {
        "row": row.name, "group": row.group, "change": row.change, "seed": seed, "here": here,
        "updates": trained.step, "parameters": parameters_at(load_config(run_dir / "config.yaml")),
        "valid_nll": nll["last"], "ppl": math.exp(nll["last"]),
        "bleu": ev["scores"]["bleu"], "chrf": ev["scores"]["chrf"], "bleu_signature": ev["signatures"]["bleu"],
        "beam": ev["decode"]["beam"], "train_s": round(trained.elapsed_s, 1), "eval_s": ev["wall_s"],
        "wall_s": round(trained.elapsed_s + ev["wall_s"], 1),  # training (from its first start) and evaluation
        "threads": CheckpointMeta.newest(run_dir).cpu_threads,
        "base_settings": ctx.settings,
    }
    check_results(ctx.out, ctx.settings)  # another runner on this --out may have written others meanwhile
    atomic_write_json(job.done, record)
    log.info("table3 %s seed %d: PPL %.2f, BLEU %.2f (%.0f s)", row.name, seed, record["ppl"], record["bleu"],
             record["wall_s"])


def run_table(base: str | Path, out: str | Path, rows: str | Sequence[str] = "all", seeds: Sequence[int] = (1,),
              updates: int | None = None, extra: Sequence[str] = (), progress: bool = False,
              parallel: int = 1) -> dict[str, Any]:
    """Train and evaluate every (row, seed) not done yet into ``out``, ``parallel`` at a time (:mod:`aiayn.runner`:
    processes sharing one GPU), then write ``out``/table3.{md,json,png}.

    Everything that can be refused is refused before the first update: the base (a translation recipe), the
    rows, the seeds, every row's config (a change the base cannot take, e.g. more heads than its width), and a
    writable ``out``. Returns the table (:func:`collect`)."""
    out = guard_output_dir(out, [base] if Path(base).exists() else [], "--out")
    chosen = select_rows(rows)
    seeds = list(dict.fromkeys(seeds))
    if not seeds or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise ConfigError(f"--seeds: give one or more non-negative integers, got {seeds}")
    if updates is not None and updates < 1:
        raise ConfigError(f"--updates must be at least 1, got {updates}")
    if parallel < 1:
        raise ConfigError(f"--parallel must be at least 1, got {parallel}")
    base_cfg = load_config(base, list(extra))
    base_cfg.kind.check_does("table3", base)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    # One tokenizer and one encoding for every row of a seed (the seed draws the tokenizer's sample, so it is part of
    # a store's key, and a named store is never rebuilt for another key); a store holds corpus files and Multi30k,
    # any other dataset trains the same tokenizer again per row, from the same text with the same settings.
    from aiayn.data.registry import dataset_of

    own_store = base_cfg.data.prepared is None and dataset_of(base_cfg).shared_store

    def store(seed: int) -> list[str]:
        return [f"data.prepared={out / 'prepared' / f'seed{seed}'}"] if own_store else []

    plans = [(row, seed, row_config(base, row, seed, updates, [*extra, *store(seed)]))
             for row in chosen for seed in seeds]
    settings = base_settings(base_cfg)
    if out.is_dir():  # results of other settings (another --set, a broken file): refused before any work
        check_results(out, settings)
    out.mkdir(parents=True, exist_ok=True)
    check_writable(out)
    atomic_write_json(out / "table3_base.json", {"base": str(base), "overrides": list(extra), "updates": updates})

    jobs, who = [], {}
    for row, seed, cfg in plans:
        name = f"{row.name}-seed{seed}"
        jobs.append(Job(name, share_cpu(cfg, parallel), out / "runs" / name, _result_path(out, row, seed)))
        who[name] = (row.name, seed, _row_label(row, cfg, base_cfg))
        log.info("table3 %s (%s) seed %d: %s, %d updates", row.name, row.change, seed, who[name][2],
                 cfg.train.max_updates)
    run_jobs(jobs, partial(_finish_row, _Rows(out, settings, who)), out / "runs" / ".claims", parallel, progress)
    table = collect(out, settings)
    write_table(table, out)
    return table


def collect(out: str | Path, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every result in ``out``/results (each read by :func:`read_result`; with ``settings``, each checked to be of
    them), grouped by row in the paper's order: per row the seeds' values, their mean, and the paper's numbers
    (parameters at the paper's sizes computed here)."""
    out = Path(out)
    by_row: dict[str, list[dict[str, Any]]] = {}
    for p in sorted((out / "results").glob("*.json")):
        rec = read_result(p)
        if settings is not None:
            check_result(p, rec, settings)
        by_row.setdefault(rec["row"], []).append(rec)
    rows = []
    for row in ROWS:
        recs = sorted(by_row.get(row.name, []), key=lambda r: r["seed"])
        if not recs:
            continue
        mean = {k: sum(r[k] for r in recs) / len(recs) for k in ("ppl", "bleu", "chrf", "wall_s")}
        rows.append({
            "row": row.name, "group": row.group, "change": row.change, "here": recs[0]["here"],
            "updates": recs[0]["updates"], "parameters": recs[0]["parameters"],
            "seeds": [r["seed"] for r in recs], "ppl": [r["ppl"] for r in recs], "bleu": [r["bleu"] for r in recs],
            "chrf": [r["chrf"] for r in recs], "mean": mean,
            "paper": {"ppl": row.paper.ppl, "bleu": row.paper.bleu, "params_m": row.paper.params_m},
            "paper_size_parameters": paper_parameters(row),
        })
    meta = json.loads((out / "table3_base.json").read_text(encoding="utf-8")) if (
        out / "table3_base.json").exists() else {}
    wall = sum(sum(r["wall_s"] for r in recs) for recs in by_row.values())
    return {"base": meta, "rows": rows, "wall_s": round(wall, 1),
            "signature": next((r["bleu_signature"] for recs in by_row.values() for r in recs), None)}


def _cell(values: list[float], digits: int) -> str:
    """One seed: the value; several: their mean and, in brackets, each seed's value."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({' / '.join(f'{v:.{digits}f}' for v in values)})"


def to_markdown(table: dict[str, Any]) -> str:
    """The table as markdown: ours (this base) beside the paper's, and each row's BLEU change from its base."""
    rows = table["rows"]
    base = next((r for r in rows if r["row"] == "base"), None)
    lines = ["| row | the paper's change | here | params here | params at paper size | paper | PPL here | paper "
             "| BLEU here | paper | ΔBLEU here | paper | minutes |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r["paper"]
        paper_params = f"{p['params_m']:.0f}M" if p["params_m"] is not None else "="
        if base is None or r is base:
            d_ours = d_paper = ""
        else:
            d_ours = f"{r['mean']['bleu'] - base['mean']['bleu']:+.2f}"
            d_paper = f"{p['bleu'] - base['paper']['bleu']:+.1f}"
        lines.append(
            f"| {r['row']} | {r['change']} | {r['here']} | {r['parameters'] / 1e6:.2f}M | "
            f"{r['paper_size_parameters'] / 1e6:.1f}M | {paper_params} | {_cell(r['ppl'], 2)} | {p['ppl']:.2f} | "
            f"{_cell(r['bleu'], 2)} | {p['bleu']:.1f} | {d_ours} | {d_paper} | {r['mean']['wall_s'] / 60:.1f} |")
    return "\n".join(lines) + "\n"


def write_table(table: dict[str, Any], out: str | Path) -> None:
    """``out``/table3.md, table3.json and table3.png (the figure), each written atomically."""
    out = Path(out)
    atomic_write_json(out / "table3.json", table)
    note = (f"\nBLEU: {table['signature']}; PPL: per subword token of the validation set. "
            f"Total wall time {table['wall_s'] / 60:.0f} minutes.\n") if table["rows"] else ""
    atomic_write_text(out / "table3.md", to_markdown(table) + note)
    if any(r["row"] == "base" for r in table["rows"]) and len(table["rows"]) > 1:
        figure(table, out / "table3.png")


# Ticks of the perplexity ratio's log axis: the ones inside the data's range are labelled (matplotlib's own
# log ticks label only the powers of ten, which a ratio near 1 never reaches).
RATIO_TICKS = (0.25, 0.33, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def _spread(values: list[float], centre: float) -> tuple[float, float]:
    """How far below and above ``centre`` the seeds' values reach."""
    return centre - min(values), max(values) - centre


def _panel_values(rows: list[dict[str, Any]], base: dict[str, Any], key: str
                  ) -> tuple[list[float], list[float], list[tuple[float, float]], list[float]]:
    """One panel's numbers against base (``key`` bleu: differences; ppl: ratios): ours and the paper's per row,
    the whiskers of our seeds per row (below, above), and base's seeds (the band)."""
    bm = base["mean"]
    if key == "bleu":
        ours = [r["mean"]["bleu"] - bm["bleu"] for r in rows]
        paper = [r["paper"]["bleu"] - base["paper"]["bleu"] for r in rows]
        whiskers = [_spread([v - bm["bleu"] for v in r["bleu"]], o) for r, o in zip(rows, ours)]
        return ours, paper, whiskers, [v - bm["bleu"] for v in base["bleu"]]
    ours = [r["mean"]["ppl"] / bm["ppl"] for r in rows]
    paper = [r["paper"]["ppl"] / base["paper"]["ppl"] for r in rows]
    whiskers = [_spread([v / bm["ppl"] for v in r["ppl"]], o) for r, o in zip(rows, ours)]
    return ours, paper, whiskers, [v / bm["ppl"] for v in base["ppl"]]


def _ratio_axis(ax: Any, values: list[float]) -> None:
    """A log x axis spanning ``values`` (perplexity ratios), ticked at the :data:`RATIO_TICKS` inside it."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log")
    lo, hi = min(values) / 1.15, max(values) * 1.15
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(FixedLocator([t for t in RATIO_TICKS if lo <= t <= hi]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_locator(NullLocator())


def _panel(ax: Any, key: str, label: str, rows: list[dict[str, Any]], base: dict[str, Any], y: list[int]) -> None:
    """Draw one panel on ``ax``: ours beside the paper's bar per row (at heights ``y``), our seeds' whiskers,
    base's seeds as a grey band, and the no-change line (``key`` bleu: 0; ppl: 1 on a log axis)."""
    ours, paper, whiskers, band = _panel_values(rows, base, key)
    if len(band) > 1:
        what = (f"{max(band) - min(band):.1f} BLEU" if key == "bleu"
                else f"{min(band):.2f}-{max(band):.2f}x")
        ax.axvspan(min(band), max(band), color="#999999", alpha=0.3, linewidth=0,
                   label=f"base's {len(band)} seeds: {what}")
    several = [i for i, r in enumerate(rows) if len(r["seeds"]) > 1]
    ax.barh([v + 0.2 for v in y], ours, height=0.4, color="#3a6ea5",
            label="here" + (" (whiskers: its seeds)" if several else ""))
    if several:
        ax.errorbar([ours[i] for i in several], [y[i] + 0.2 for i in several], fmt="none", ecolor="black",
                    elinewidth=1, capsize=2, xerr=[[whiskers[i][0] for i in several],
                                                   [whiskers[i][1] for i in several]])
    ax.barh([v - 0.2 for v in y], paper, height=0.4, label="paper", color="#c8a24a")
    ax.axvline(0 if key == "bleu" else 1, color="black", linewidth=0.8)
    if key == "ppl":
        _ratio_axis(ax, [*ours, *paper, *band])
    ax.set_xlabel(label)
    ax.grid(axis="x", alpha=0.3)


def figure(table: dict[str, Any], path: str | Path) -> Path:
    """Each row's BLEU and perplexity against its base row, ours beside the paper's (two panels). With several
    seeds, a bar's whiskers span its seeds and a grey band spans base's: a change inside the band is within
    what the seed alone moves."""
    import textwrap

    from aiayn.files import atomic_write_bytes
    from aiayn.viz.common import new_figure, use_backend

    use_backend(False)
    import io

    import matplotlib.pyplot as plt

    rows = [r for r in table["rows"] if r["row"] != "base"]
    base = next(r for r in table["rows"] if r["row"] == "base")
    labels = [textwrap.fill(f"{r['row']}: {r['change']}", 30) for r in rows]
    lines = sum(label.count("\n") + 1 for label in labels)
    fig = new_figure(1200, 150 + 17 * lines + 14 * len(rows), (1200, 600))
    axes = fig.subplots(1, 2, sharey=True)
    y = list(range(len(rows)))[::-1]  # the first row at the top
    _panel(axes[0], "bleu", "Δ BLEU vs base (higher is better)", rows, base, y)
    _panel(axes[1], "ppl", "PPL / base PPL (lower is better)", rows, base, y)
    axes[0].set_yticks(y, labels, fontsize=9)
    axes[0].set_ylim(-0.7, len(rows) - 0.3)
    axes[0].legend(loc="upper right", fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
