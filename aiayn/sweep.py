"""``aiayn sweep``: a recipe's seeds and variants trained side by side, chosen on validation, tested once.

Every (variant, seed) is one training of the base recipe with the variant's settings and ``train.seed``; the
trainings share the machine (:mod:`aiayn.runner`: several processes on one GPU, one after the other on a CPU).
Each trained run is scored on the validation split under every decoding choice (the run's own weights and
decoding, or the average of its last K checkpoints, another beam or length penalty: no training). Then, and only
once every run has its validation scores, the (variant, decoding) with the best mean validation score over the
seeds is chosen (``choice.json``, written once and kept), and only its runs are scored on the test splits: the
test sets never take part in a choice.

OUT holds what the sweep found and nothing it cannot lose::

    OUT/sweep.json                  what was asked: each job's settings, the decodings, splits, metric
    OUT/results/VARIANT-seedS.json  one per run: updates, time, speed, validation (and test) scores
    OUT/runs/VARIANT-seedS/         the run's config.yaml and metrics.jsonl (``aiayn report`` reads them)
    OUT/choice.json                 the variant and decoding chosen on validation
    OUT/table.md, table.json        mean and standard deviation over seeds per split and metric
    OUT/curves.png                  validation BLEU against updates, one line per run

The runs themselves (checkpoints) go to WORK (default ``runs/sweeps/<OUT's name>``), so OUT stays small enough
to commit. Every file is written atomically; a rerun of the same command goes on where the last one stopped
(finished runs are kept, a killed one resumes) and an OUT made by another sweep is refused, never written over.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from aiayn.config import Config, ConfigError, load_config, load_yaml
from aiayn.files import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_writable,
    guard_output_dir,
    staged_directory,
)
from aiayn.runner import Job, Trained, default_parallel, run_jobs, settings_of, share_cpu

log = logging.getLogger("aiayn.sweep")

METRICS = ("bleu", "chrf", "bleu_lc_tok")  # sacreBLEU, chrF, and the Multi30k literature's lowercased Moses BLEU
METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "bleu_lc_tok": "lc-tok BLEU"}
VALID = "valid"
# Settings a sweep's runs may differ in between two invocations of one sweep: where and how fast they run and what
# they log. Every other setting is part of the sweep (another value is another sweep: another --out).
UNSCORED = ("train.threads", "train.device", "train.log_every", "train.log_to", "train.dist_timeout_s",
            "train.setup_timeout_s", "train.compile", "train.compile_mode", "data.prepared", "data.loader_workers")
# Every run logs its greedy validation BLEU (the figure's lines); a --set or variant may switch it off.
SWEEP_DEFAULTS = ("train.eval_bleu=true",)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+]*$")


def dataset_test_splits(cfg: Config) -> tuple[str, ...]:
    """The test splits of the recipe's dataset (none for corpus files: name them with --splits)."""
    from aiayn.data.registry import dataset_of

    return dataset_of(cfg).test_splits


def setting(key: str, value: Any) -> str:
    """A ``--set`` item for ``key`` = ``value`` (a YAML value: JSON is YAML)."""
    return f"{key}={json.dumps(value)}"


@dataclass(frozen=True)
class Variant:
    """A named change of the base recipe: ``--set`` items applied to it."""

    name: str
    settings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decoding:
    """A named way to translate with a trained run, scored on validation without training: the average of its last
    ``average_last`` checkpoints (None: the run's own inference weights) and decoding options (beam, alpha, ...)."""

    name: str
    average_last: int | None = None
    options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """What ``aiayn sweep`` runs: the ``config`` (a recipe) with ``overrides`` on every run, each variant x seed
    trained into ``work``; every decoding scored on validation; the best mean of ``select`` chosen; the chosen
    scored on ``splits`` (unless not ``test``); results in ``out``."""

    config: str
    out: Path
    work: Path | None = None
    common: tuple[str, ...] = ()  # --set items on every run, under the variants' own (a grid file's ``set``)
    overrides: tuple[str, ...] = ()  # --set items on every run, over the variants' own (the command line's)
    variants: tuple[Variant, ...] = (Variant("recipe"),)
    decodings: tuple[Decoding, ...] = (Decoding("run"),)
    seeds: tuple[int, ...] = (1,)
    splits: tuple[str, ...] | None = None  # None: the dataset's test splits
    select: str = "bleu_lc_tok"
    test: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # kept in sweep.json as given (e.g. the grid file's name)


def _name(what: str, name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(f"{what} {name!r}: a name of letters, digits and _ . + (it names files)")
    return name


def parse_items(what: str, items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` items as a dict (values as written); one line for an item without ``=``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def decoding_from(name: str, values: dict[str, Any]) -> Decoding:
    """A :class:`Decoding` from ``average_last`` and decoding options (their values as YAML or strings)."""
    import yaml

    values = {k: yaml.safe_load(v) if isinstance(v, str) else v for k, v in values.items()}
    avg = values.pop("average_last", None)
    if avg is not None and (not isinstance(avg, int) or isinstance(avg, bool) or avg < 1):
        raise ConfigError(f"decoding {name!r}: average_last must be a whole number >= 1, got {avg!r}")
    return Decoding(_name("decoding", name), avg, tuple(sorted(values.items())))


def grid_path(name: str | Path) -> Path:
    """A grid file as given, or one shipped in ``configs/sweeps/`` by name (``multi30k_search``)."""
    from aiayn.config.loading import CONFIG_DIR

    p = Path(name)
    if p.exists():
        return p
    shipped = CONFIG_DIR / "sweeps" / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(q.stem for q in (CONFIG_DIR / "sweeps").glob("*.yaml")))
    raise ConfigError(f"--variants {name}: no such file or shipped grid (shipped: {known or 'none'})")


def read_grid(path: str | Path) -> tuple[list[str], list[Variant], list[Decoding]]:
    """A sweep's grid file: ``set`` (items on every run), ``variants`` (name -> {key: value}) and ``decode``
    (name -> {average_last, beam, alpha, ...}); every other key is refused."""
    data = load_yaml(grid_path(path))
    unknown = sorted(set(data) - {"set", "variants", "decode"})
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (a grid has set, variants and decode)")
    if not any(data.values()) or ("variants" in data and not data["variants"]):  # not the recipe without a word
        raise ConfigError(f"{path}: the grid names no variants; give it some (or leave --variants out to sweep the "
                          "recipe as it is)")
    sets = data.get("set") or []
    if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets):
        raise ConfigError(f"{path}: set: expected a list of KEY=VALUE strings")
    variants, decodings = [], []
    for kind, into in (("variants", variants), ("decode", decodings)):
        section = data.get(kind) or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: {kind}: expected names, each with its settings")
        for name, values in section.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: {kind}: {name}: expected KEY: VALUE settings ({{}} for none)")
            if kind == "variants":
                into.append(Variant(_name("variant", name), tuple(setting(k, v) for k, v in values.items())))
            else:
                into.append(decoding_from(str(name), dict(values)))
    return sets, variants, decodings


# --- planning: everything checked before the first update -------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A checked sweep: its jobs, which (variant, seed) each is, its test splits and the key of sweep.json."""

    sweep: Sweep
    jobs: tuple[Job, ...]
    who: dict[str, tuple[str, int]]
    splits: tuple[str, ...]
    key: dict[str, Any]
    parallel: int  # trainings at a time


def job_config(sweep: Sweep, variant: Variant, seed: int) -> Config:
    """The config of ``variant`` x ``seed``: the base, the sweep's defaults, the grid's common settings, the
    variant's, the command line's ``--set`` (which wins: a time cap or a smoke test's sizes hold for every
    variant), the seed."""
    return load_config(sweep.config, [*SWEEP_DEFAULTS, *sweep.common, *variant.settings, *sweep.overrides,
                                      f"train.seed={seed}"])


def plan_sweep(sweep: Sweep, parallel: int | None) -> Plan:
    """Every check that can refuse the sweep, before any work: names, seeds, metric, each run's config (a
    translation recipe), each decoding's options, each split's data. ``parallel`` (None: as
    :func:`~aiayn.runner.default_parallel` decides) shares the CPU's cores between the trainings."""
    from aiayn.eval.evaluate import split_pairs

    if not sweep.seeds or any(not isinstance(s, int) or s < 0 for s in sweep.seeds):
        raise ConfigError(f"--seeds: give one or more non-negative integers, got {list(sweep.seeds)}")
    for what, names in (("variant", [v.name for v in sweep.variants]), ("decoding", [d.name for d in sweep.decodings])):
        for n in names:
            _name(what, n)
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"each {what} needs a name of its own (got {names})")
    if sweep.select not in METRICS:
        raise ConfigError(f"--select {sweep.select!r}: one of {', '.join(METRICS)}")
    work = sweep.work or Path("runs") / "sweeps" / sweep.out.name
    configs = {}
    for variant in sweep.variants:
        for seed in dict.fromkeys(sweep.seeds):
            cfg = job_config(sweep, variant, seed)
            cfg.kind.check_does("sweep", sweep.config)
            for d in sweep.decodings:
                cfg.decode.replace(**dict(d.options))  # a bad option fails here
            configs[f"{variant.name}-seed{seed}"] = (variant.name, seed, cfg)
    n = parallel if parallel is not None else default_parallel(next(iter(configs.values()))[2], len(configs))
    jobs = tuple(Job(name, share_cpu(cfg, n), work / "runs" / name, sweep.out / "results" / f"{name}.json")
                 for name, (_, _, cfg) in configs.items())
    who = {name: (v, seed) for name, (v, seed, _) in configs.items()}
    key_jobs = {name: settings_of(cfg, UNSCORED) for name, (_, _, cfg) in configs.items()}
    splits = tuple(sweep.splits) if sweep.splits is not None else dataset_test_splits(jobs[0].cfg)
    for split in (VALID, *(splits if sweep.test else ())):
        split_pairs(jobs[0].cfg, split)  # an unknown split or missing data: one line now
    key = {"jobs": key_jobs, "decodings": [[d.name, d.average_last, dict(d.options)] for d in sweep.decodings],
           "select": sweep.select, "splits": list(splits) if sweep.test else [], "valid": VALID}
    return Plan(sweep, jobs, who, splits, json.loads(json.dumps(key)), n)


def _first_difference(theirs: Any, ours: Any, path: str = "") -> str | None:
    if isinstance(theirs, dict) and isinstance(ours, dict):
        for k in sorted(set(theirs) | set(ours), key=str):
            found = _first_difference(theirs.get(k), ours.get(k), f"{path}.{k}" if path else str(k))
            if found:
                return found
        return None
    return None if theirs == ours else f"{path}: {json.dumps(theirs)} there, {json.dumps(ours)} here"


def open_out(plan: Plan) -> None:
    """OUT new, empty, or this very sweep's (its sweep.json has the same key): anything else is refused with one
    line; then OUT is made and proved writable and sweep.json written."""
    out = plan.sweep.out
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    spec = out / "sweep.json"
    if spec.is_file():
        try:
            theirs = json.loads(spec.read_text(encoding="utf-8"))["key"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{spec}: not a sweep's record; choose another --out") from None
        diff = _first_difference(theirs, plan.key)
        if diff is not None:
            raise ConfigError(f"--out {out} holds another sweep ({diff}); choose another --out (a sweep's results "
                              "are never written over)")
    elif out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty and not a sweep's output; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    check_writable(out)
    if not spec.is_file():
        s = plan.sweep
        atomic_write_json(spec, {"config": str(s.config), "common": list(s.common), "overrides": list(s.overrides),
                                 "seeds": list(s.seeds),
                                 "variants": {v.name: list(v.settings) for v in s.variants}, **s.extra,
                                 "key": plan.key})


# --- one run: validation under every decoding ---------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """What finishing a run needs (sent to worker processes): the sweep, who each job is, where the views go."""

    sweep: Sweep
    who: dict[str, tuple[str, int]]
    views: Path


def weights_view(run_dir: Path, last: int, views: Path) -> Path:
    """A run directory that translates with the average of ``run_dir``'s last ``last`` checkpoints: its config,
    tokenizer and those weights (built once, whole, beside the other views; the trained run is not touched)."""
    from aiayn.run.weights import FINAL_WEIGHTS, average_weights, checkpoint_paths, list_checkpoints, save_weights

    steps = list_checkpoints(run_dir)[-last:]
    if not steps:
        raise ConfigError(f"{run_dir}: no checkpoints to average")
    view = views / f"{run_dir.name}-avg{last}-step{steps[-1]}"
    if not (view / FINAL_WEIGHTS).is_file():
        with staged_directory(view) as tmp:
            shutil.copy2(run_dir / "config.yaml", tmp / "config.yaml")
            shutil.copytree(run_dir / "tokenizer", tmp / "tokenizer")
            avg = average_weights([checkpoint_paths(run_dir, s)[0] for s in steps])
            save_weights(avg, tmp / FINAL_WEIGHTS, {"source": f"average of steps {steps}"})
    return view


def score(ctx: Context, run_dir: Path, decoding: Decoding, split: str) -> dict[str, Any]:
    """``split`` translated by ``run_dir`` under ``decoding``: the scores, the lc-tok BLEU's breakdown (n-gram
    precisions, brevity), the weights used, the signatures."""
    from aiayn.eval.evaluate import EvalData, evaluate_translation

    target = run_dir if decoding.average_last is None else weights_view(run_dir, decoding.average_last, ctx.views)
    ev = evaluate_translation(target, EvalData(split=split, name=f"{split}-{decoding.name}"), **dict(decoding.options))
    return {**{m: ev["scores"][m] for m in METRICS}, "n": ev["n_sentences"], "lc_tok_detail": ev["bleu_lc_tok_detail"],
            "weights": ev["run"].get("weights_source", ev["run"]["weights"]), "decode": {
                k: ev["decode"][k] for k in ("beam", "alpha", "length_penalty")},
            "signatures": ev["signatures"]}


def finish_run(ctx: Context, job: Job, trained: Trained) -> None:
    """A trained run scored on validation under every decoding; its record, config and log copied into OUT."""
    from aiayn.device import resolve_device
    from aiayn.train.report import run_report

    variant, seed = ctx.who[job.name]
    rep = run_report(job.run_dir)
    valid = {d.name: score(ctx, job.run_dir, d, VALID) for d in ctx.sweep.decodings}
    tc = job.cfg.train
    record = {
        "variant": variant, "seed": seed, "run": job.name, "updates": trained.step,
        "train_s": round(trained.elapsed_s, 1),
        "stopped_by": "max_updates" if trained.step >= tc.max_updates else (
            "max_minutes" if tc.max_minutes and trained.elapsed_s >= tc.max_minutes * 60 else "other"),
        "tokens_per_s": round(rep["tokens_per_s"]["median"]) if rep["tokens_per_s"] else None,
        "valid_nll": rep["valid_nll"]["last"] if rep["valid_nll"] else None,
        "device": str(resolve_device(tc.device)), "work": str(job.run_dir), VALID: valid, "test": {},
    }
    copies = ctx.sweep.out / "runs" / job.name
    for name in ("config.yaml", "metrics.jsonl"):
        atomic_write_bytes(copies / name, (job.run_dir / name).read_bytes())
    atomic_write_json(job.done, record)
    best = max(valid.values(), key=lambda s: s[ctx.sweep.select])
    log.info("%s: %d updates in %.1f min; validation %s %.2f (best decoding)", job.name, trained.step,
             trained.elapsed_s / 60, METRIC_NAMES[ctx.sweep.select], best[ctx.sweep.select])


# --- the choice on validation, then the test splits once ------------------------------------------------------


def read_records(plan: Plan) -> dict[str, dict[str, Any]]:
    """The results written so far, by job name (a file that is not a result of this sweep: one line naming it)."""
    out = {}
    for job in plan.jobs:
        if job.done.is_file():
            try:
                rec = json.loads(job.done.read_text(encoding="utf-8"))
                ok = isinstance(rec, dict) and (rec.get("variant"), rec.get("seed")) == plan.who[job.name] \
                    and isinstance(rec.get(VALID), dict)
            except (ValueError, UnicodeDecodeError):
                ok = False
            if not ok:
                raise ConfigError(f"{job.done}: not this sweep's result for {job.name}; delete it to score the run "
                                  "again")
            out[job.name] = rec
    return out


def stats(values: list[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (n - 1; None for one value) of ``values``, and the values."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "values": values, "n": len(values)}


def choose(plan: Plan, records: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The (variant, decoding) of the best mean validation score over its seeds (the first on a tie), with every
    candidate's mean; None until every run has been scored."""
    if len(records) < len(plan.jobs):
        return None
    select, candidates = plan.sweep.select, []
    for v in plan.sweep.variants:
        recs = [r for r in records.values() if r["variant"] == v.name]
        for d in plan.sweep.decodings:
            candidates.append([v.name, d.name, statistics.fmean(r[VALID][d.name][select] for r in recs)])
    best = max(candidates, key=lambda c: c[2])  # max keeps the first of equals: the grid's order decides a tie
    return {"variant": best[0], "decoding": best[1], "select": select, "valid_mean": best[2], "candidates": candidates}


def choice_of(plan: Plan, records: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The choice made on validation: the one recorded in OUT/choice.json when there is one (the test splits were
    scored for it: it is never made again), else made now and recorded before any test split is read."""
    path = plan.sweep.out / "choice.json"
    fresh = choose(plan, records)
    if path.is_file():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            kept["variant"], kept["decoding"]  # noqa: B018 - the fields the test splits are scored for
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            raise ConfigError(f"{path}: not a sweep's choice; if no test split was scored yet, delete it to "
                              "choose again") from None
        if fresh is not None and (fresh["variant"], fresh["decoding"]) != (kept["variant"], kept["decoding"]):
            log.warning("the validation scores now favour %s / %s; the choice made before (%s / %s) stays, since "
                        "its test scores were read", fresh["variant"], fresh["decoding"], kept["variant"],
                        kept["decoding"])
        return kept
    if fresh is not None:
        atomic_write_json(path, fresh)
    return fresh


def test_chosen(plan: Plan, ctx: Context, chosen: dict[str, Any]) -> None:
    """The chosen variant's runs scored on every test split under the chosen decoding, each result file updated
    split by split (a kill loses at most the split being scored)."""
    decoding = next(d for d in plan.sweep.decodings if d.name == chosen["decoding"])
    for job in plan.jobs:
        if plan.who[job.name][0] != chosen["variant"]:
            continue
        rec = json.loads(job.done.read_text(encoding="utf-8"))
        for split in plan.splits:
            if split in rec["test"]:
                continue
            if not job.run_dir.is_dir():
                raise ConfigError(f"{job.run_dir}: the run is gone (WORK was deleted?), so {split} cannot be scored; "
                                  f"run the sweep again with the same --work")
            rec["test"][split] = score(ctx, job.run_dir, decoding, split)
            rec["test_decoding"] = decoding.name
            atomic_write_json(job.done, rec)
            log.info("%s %s (%s): %s %.2f", job.name, split, decoding.name, METRIC_NAMES[plan.sweep.select],
                     rec["test"][split][plan.sweep.select])


# --- the table and the figure ---------------------------------------------------------------------------------


def collect(plan: Plan, records: dict[str, dict[str, Any]], chosen: dict[str, Any] | None) -> dict[str, Any]:
    """The table: per (variant, decoding), each metric's mean and standard deviation over seeds on validation,
    and on each test split for the chosen one; per run its updates, time and speed."""
    rows = []
    for v in plan.sweep.variants:
        recs = sorted((r for r in records.values() if r["variant"] == v.name), key=lambda r: r["seed"])
        if not recs:
            continue
        for d in plan.sweep.decodings:
            row = {"variant": v.name, "decoding": d.name, "seeds": [r["seed"] for r in recs],
                   "updates": [r["updates"] for r in recs], "train_min": stats([r["train_s"] / 60 for r in recs]),
                   VALID: {m: stats([r[VALID][d.name][m] for r in recs]) for m in METRICS}, "test": {}}
            if chosen is not None and (v.name, d.name) == (chosen["variant"], chosen["decoding"]):
                row["chosen"] = True
                for split in plan.splits:
                    tested = [r for r in recs if split in r["test"]]
                    if tested:
                        row["test"][split] = {"seeds": [r["seed"] for r in tested], "n_sentences": tested[0]["test"][
                            split]["n"], **{m: stats([r["test"][split][m] for r in tested]) for m in METRICS}}
            rows.append(row)
    runs = [{k: r.get(k) for k in ("run", "variant", "seed", "updates", "train_s", "stopped_by", "tokens_per_s",
                                   "valid_nll", "device")} for r in sorted(records.values(), key=lambda r: r["run"])]
    any_rec = next(iter(records.values()), None)
    signatures = next(iter(any_rec[VALID].values()))["signatures"] if any_rec else None
    return {"config": plan.sweep.config, "overrides": list(plan.sweep.overrides), "select": plan.sweep.select,
            "chosen": chosen, "rows": rows, "runs": runs, "planned_runs": len(plan.jobs), "splits": list(plan.splits),
            "signatures": signatures}


def _cell(s: dict[str, Any]) -> str:
    """mean ± sd (n seeds); one seed: the value alone."""
    return f"{s['mean']:.2f}" if s["std"] is None else f"{s['mean']:.2f} ± {s['std']:.2f}"


def _span(values: list[int]) -> str:
    return f"{min(values):,}" if min(values) == max(values) else f"{min(values):,}-{max(values):,}"


def to_markdown(table: dict[str, Any]) -> str:
    """The table as markdown: the search on validation, the chosen one on the test splits, the runs."""
    chosen, select = table["chosen"], METRIC_NAMES[table["select"]]
    sets = " ".join(f"--set {s}" for s in table["overrides"])
    lines = [f"# Sweep of {table['config']}{' ' + sets if sets else ''}", ""]
    if chosen is None:
        lines += [f"No choice yet: {len(table['runs'])} of {table['planned_runs']} runs scored on validation.", ""]
    else:
        lines += [f"Chosen on validation by mean {select}: **{chosen['variant']}** with decoding "
                  f"**{chosen['decoding']}** ({chosen['valid_mean']:.2f}); the test splits were scored for it alone.",
                  ""]
    lines += ["Cells: mean ± sample standard deviation over the seeds (n - 1); a cell without ± is one seed.", "",
              "## Validation: every variant and decoding", "",
              "| variant | decoding | seeds | updates | train min | BLEU | chrF | lc-tok BLEU |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in table["rows"]:
        mark = " (chosen)" if r.get("chosen") else ""
        lines.append(f"| {r['variant']}{mark} | {r['decoding']} | {len(r['seeds'])} | {_span(r['updates'])} | "
                     f"{r['train_min']['mean']:.1f} | " + " | ".join(_cell(r[VALID][m]) for m in METRICS) + " |")
    tested = [r for r in table["rows"] if r["test"]]
    for r in tested:
        lines += ["", f"## Test: {r['variant']}, decoding {r['decoding']}", "",
                  "| split | sentences | seeds | BLEU | chrF | lc-tok BLEU | lc-tok per seed |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for split, t in r["test"].items():
            per_seed = " / ".join(f"{v:.2f}" for v in t["bleu_lc_tok"]["values"])
            lines.append(f"| {split} | {t['n_sentences']:,} | {len(t['seeds'])} | "
                         + " | ".join(_cell(t[m]) for m in METRICS) + f" | {per_seed} |")
    lines += ["", "## Runs", "",
              "| run | updates | stopped by | train min | target tok/s (median) | valid NLL | device |",
              "|---|---:|---|---:|---:|---:|---|"]
    for r in table["runs"]:
        tps = f"{r['tokens_per_s']:,}" if r["tokens_per_s"] else ""
        nll = f"{r['valid_nll']:.3f}" if r["valid_nll"] is not None else ""
        lines.append(f"| {r['run']} | {r['updates']:,} | {r['stopped_by']} | {r['train_s'] / 60:.1f} | {tps} | {nll} | "
                     f"{r['device']} |")
    if table["signatures"]:
        sig = table["signatures"]
        lines += ["", f"BLEU: sacreBLEU `{sig['bleu']}`; chrF `{sig['chrf']}`; lc-tok BLEU: lowercased, "
                  "Moses-tokenized text scored with tokenize=none, as the Multi30k literature scores (not sacreBLEU)."]
    return "\n".join(lines) + "\n"


def write_outputs(plan: Plan, records: dict[str, dict[str, Any]], chosen: dict[str, Any] | None) -> dict[str, Any]:
    """OUT/table.json, table.md and curves.png from the results so far (each written atomically)."""
    from aiayn.train.metrics_log import curves_data
    from aiayn.viz.common import use_backend
    from aiayn.viz.curves import plot_seed_curves

    out = plan.sweep.out
    table = collect(plan, records, chosen)
    atomic_write_json(out / "table.json", table)
    atomic_write_text(out / "table.md", to_markdown(table))
    curves = {}
    for name in sorted(records, key=lambda n: plan.who[n]):
        metrics = out / "runs" / name / "metrics.jsonl"
        if metrics.is_file():
            curves[f"{plan.who[name][0]} seed {plan.who[name][1]}"] = curves_data(metrics)
    if curves:
        use_backend(False)
        plot_seed_curves(curves, out / "curves.png", title=Path(plan.sweep.config).stem)
    return table


def run_sweep(sweep: Sweep, parallel: int | None = None, progress: bool = False) -> dict[str, Any]:
    """Run ``sweep`` (module docstring) with ``parallel`` trainings at a time (None: 3 on a GPU, 1 on a CPU);
    returns the table. Everything that can be refused is refused before the first update. A run that fails
    leaves the others to finish and the table of what is done; its error is raised at the end."""
    if parallel is not None and parallel < 1:
        raise ConfigError(f"--parallel must be at least 1, got {parallel}")
    plan = plan_sweep(sweep, parallel)
    open_out(plan)
    work = plan.jobs[0].run_dir.parent.parent
    ctx = Context(sweep, plan.who, work / "views")
    failure: Exception | None = None
    try:
        run_jobs(plan.jobs, partial(finish_run, ctx), work / "claims", parallel=plan.parallel, progress=progress)
    except Exception as e:  # noqa: BLE001 - the table of what is done is written first, then it is raised
        failure = e
    records = read_records(plan)
    chosen = choice_of(plan, records) if failure is None else None
    if chosen is not None and sweep.test:
        try:
            test_chosen(plan, ctx, chosen)
        except Exception as e:  # noqa: BLE001 - as above: the table of what is scored, then the error
            failure = e
        records = read_records(plan)
    table = write_outputs(plan, records, chosen)
    if failure is not None:
        raise failure
    return table


def sweep_cli(args) -> int:
    """``aiayn sweep``: the command line's options as a :class:`Sweep`, run; the table's place printed."""
    common, variants, decodings = read_grid(args.variants) if args.variants else ([], [], [])
    if args.only:
        unknown = sorted(set(args.only) - {v.name for v in variants})
        if unknown:
            raise ConfigError(f"--only {unknown[0]}: no such variant in {args.variants or 'the sweep'} (variants: "
                              f"{', '.join(v.name for v in variants) or 'none'})")
        variants = [v for v in variants if v.name in args.only]
    for name, *items in args.variant:
        parse_items(f"--variant {name}", items)  # each item KEY=VALUE
        variants.append(Variant(_name("variant", name), tuple(items)))
    for name, *items in args.decode:
        decodings.append(decoding_from(name, parse_items(f"--decode {name}", items)))
    given = [p for p in (args.config, args.variants) if p is not None and Path(p).exists()]
    guard_output_dir(args.out, given, "--out")
    if args.work is not None:
        guard_output_dir(args.work, given, "--work")
    sets = [*args.set, *([f"train.threads={args.threads}"] if args.threads is not None else [])]
    sweep = Sweep(config=args.config, out=Path(args.out), work=Path(args.work) if args.work else None,
                  common=tuple(common), overrides=tuple(sets), variants=tuple(variants) or (Variant("recipe"),),
                  decodings=tuple(decodings) or (Decoding("run"),), seeds=tuple(args.seeds),
                  splits=tuple(args.splits) if args.splits is not None else None, select=args.select,
                  test=not args.no_test, extra={"grid": args.variants} if args.variants else {})
    table = run_sweep(sweep, parallel=args.parallel, progress=not args.no_progress)
    what = f"{len(table['runs'])} runs"
    if table["chosen"]:
        what += f", chosen on validation: {table['chosen']['variant']} / {table['chosen']['decoding']}"
    print(f"{what}; {args.out}/table.md (JSON: table.json, figure: curves.png)")
    return 0
