"""The GPU check's training items (``python -m benchmarks.gpu_check``): ``aiayn train``'s own code on a token store
prepared from a synthetic WMT-like corpus (generated on the machine: 100k pairs, 37k BPE), and the loader-free
comparison with the peers (``benchmarks.train_throughput``), for issue 59's rows:

- ``train_*``              paper-base or paper-big trained a few dozen updates through :func:`aiayn.train.run.train` in
                           one precision / compile / lever setting (:data:`TRAIN_ITEMS`): target tokens/s and MFU after
                           the warm-up updates, the slowest update against the median (paper-big: one logged line per
                           update), graphs and recompiles (metrics.jsonl's ``graphs`` / ``recompiles``), peak memory.
- ``train_speed_big``, ``train_speed_base``: ``benchmarks.train_throughput`` on paper-big / paper-base (WMT-like
                           lengths): aiayn eager, each lever alone, the eager levers together, compiled with levers,
                           Hugging Face Marian eager and compiled, torch.nn.Transformer; same batches, same update code
                           (:data:`SPEED_IMPLS`). One item per preset, so that a time limit costs one preset only.
- ``compile_restart``      a second start of the compiled paper-big with levers (the compile caches of the first, in
                           the check's ``--work``): seconds from the process's start to its first update (goal < 30 s).
- ``levers_match``         200 updates of paper-base in bf16: eager with seed 1 and seed 2 (the run-to-run noise), and
                           compiled with every lever, seed 1; the levers' largest loss difference from eager over the
                           last half of the logged updates must be within the seeds' (issue 59's "each lever leaves
                           the training unchanged").
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import child_env

REPO = Path(__file__).resolve().parent.parent

# The synthetic WMT-like corpus (benchmarks.data_scale.write_corpus) and its store.
CORPUS_PAIRS = {"full": 100_000, "smoke": 2_000}
PAPER_BASE = ["data.dataset=null", "data.vocab_size=37000", "data.update_tokens=25000",
              "train.eval_every=1000000", "train.save_every=1000000", "train.eval_bleu=false",
              "train.inference_weights=last", "train.keep_last=1"]
SMOKE_MODEL = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
               "model.n_decoder_layers=1", "model.max_positions=512", "data.vocab_size=600",
               "data.update_tokens=null", "data.max_tokens=512", "data.tokenizer_sample=20000"]
BUCKETS = [24, 40, 64, 128]  # target-length buckets of the static-shape item: WMT-like lengths, few shapes
# (warm-up updates, all updates, updates per logged line) of a throughput item, by its kind and size: the loop reads
# the device only at a logged update, so a line every update adds a synchronization to each (paper-big's items pay
# it, as train_throughput's timed updates do, to see every update's time: issue 59's "no update slower than 3x the
# median")
UPDATES = {"base": {"full": (10, 30, 5), "smoke": (1, 3, 1)}, "big": {"full": (10, 70, 1), "smoke": (1, 4, 1)}}
# aiayn's levers besides train.compile, as aiayn train's keys (the compiled items with levers)
LEVER_KEYS = ("train.cast_weights_once=true", "train.fused_output_loss=true")


@dataclass(frozen=True)
class TrainItem:
    """One training item: the preset, precision, compile, fixed length buckets, lever keys, and which UPDATES."""

    preset: str = "paper-base"
    precision: str = "bf16"
    compile: bool = False
    buckets: bool = False
    levers: tuple[str, ...] = ()
    updates: str = "base"


TRAIN_ITEMS = {
    "train_bf16": TrainItem(),
    "train_big_bf16": TrainItem("paper-big", updates="big"),
    "train_big_bf16_compile": TrainItem("paper-big", compile=True, updates="big"),
    "train_bf16_compile": TrainItem(compile=True),
    "train_bf16_compile_buckets": TrainItem(compile=True, buckets=True),
    "train_fp16": TrainItem(precision="fp16"),
    "train_tf32": TrainItem(precision="tf32"),
    "train_fp32": TrainItem(precision="fp32"),
    "train_big_bf16_levers": TrainItem("paper-big", compile=True, levers=LEVER_KEYS, updates="big"),
}
# The rows of train_speed_*: aiayn eager, each lever alone, the eager levers together, compiled with levers, and the
# peers (benchmarks/train_peers.py). Plain aiayn-compile is left out for time (each compiled row is a cold inductor
# compile): train_big_bf16_compile measures it through aiayn train.
SPEED_IMPLS = ["aiayn", "aiayn+cast", "aiayn+fused-loss", "aiayn+fuse-norms", "aiayn+cudnn", "aiayn+cast+fused-loss",
               "aiayn-compile+cast+fused-loss", "hf-marian", "hf-marian-compile", "torch-nn"]
# smoke (CI): one row of each kind, so the code paths stay run without minutes of CPU
SMOKE_SPEED_IMPLS = ["aiayn", "aiayn+cast+fused-loss+fuse-norms+cudnn", "aiayn-compile+cast+fused-loss",
                     "hf-marian-compile", "torch-nn"]
SPEED_PRESETS = {"train_speed_base": "paper-base", "train_speed_big": "paper-big"}
# aiayn train's items beside the train_speed rows of the same model and levers (issue 59: the loop keeps >= 0.95x)
LOOP_PEERS = {"train_big_bf16": ("paper-big", "aiayn"),
              "train_big_bf16_levers": ("paper-big", "aiayn-compile+cast+fused-loss"),
              "levers_match": ("paper-base", "aiayn-compile+cast+fused-loss")}


def corpus(work: Path, size: str) -> dict[str, str]:
    """The synthetic corpus' files (written once per work directory): train/valid source/target paths."""
    from benchmarks.data_scale import write_corpus

    folder = work / f"corpus-{size}"
    files = {k: folder / f"{k.replace('_', '.')}" for k in ("train_src", "train_tgt", "valid_src", "valid_tgt")}
    done = folder / "done"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_corpus(folder, CORPUS_PAIRS[size])
        done.write_text("ok")
    return {k: str(v) for k, v in files.items()}


def paper_base_overrides(work: Path, size: str) -> list[str]:
    """The data of every training item: the store of the synthetic corpus (prepared by the first training that
    asks); the smoke model on a CPU."""
    files = corpus(work, size)
    over = [*PAPER_BASE, *(f"data.{k}={v}" for k, v in files.items()), f"data.prepared={work / f'store-{size}'}"]
    return over + (SMOKE_MODEL if size == "smoke" else [])


def item_overrides(spec: TrainItem, work: Path, device: str, size: str) -> list[str]:
    """The ``--set`` overrides of a training item (its updates, precision, compile, levers) on the store."""
    warm, updates, every = UPDATES[spec.updates][size]
    precision = "fp32" if device == "cpu" else spec.precision
    over = paper_base_overrides(work, size) + [f"train.max_updates={updates}", f"train.log_every={every}",
                                               f"train.precision={precision}",
                                               f"train.compile={str(spec.compile).lower()}", f"train.device={device}",
                                               *spec.levers]
    return over + ([f"data.length_buckets={BUCKETS}"] if spec.buckets else [])


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def train_item(item: str, work: Path, device: str, size: str) -> dict[str, Any]:
    """A training item of :data:`TRAIN_ITEMS` through :func:`aiayn.train.run.train`; tokens/s and MFU over the
    updates after the warm-up ones, the slowest update, graphs and recompiles."""
    import torch
    from torch._dynamo.utils import counters

    from aiayn.config import load_config
    from aiayn.train.run import train

    spec = TRAIN_ITEMS[item]
    warm = UPDATES[spec.updates][size][0]
    cfg = load_config(spec.preset, item_overrides(spec, work, device, size))
    run_dir = work / "runs" / item
    shutil.rmtree(run_dir, ignore_errors=True)
    _prepare_store(cfg, work)  # outside the timed training (prepared once per work directory)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train(cfg, run_dir, progress=False)
    wall = time.perf_counter() - t0
    res = throughput(cfg, run_dir, warm, _peak(work, cfg.train.precision))
    res.update(preset=spec.preset, precision=cfg.train.precision, compile=spec.compile, levers=list(spec.levers),
               length_buckets=BUCKETS if spec.buckets else None, wall_s=round(wall, 1))
    if device != "cpu":
        res["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    res["graphs"] = int(counters["stats"].get("unique_graphs", 0))
    res["graph_breaks"] = int(sum(counters["graph_break"].values()))
    if counters["graph_break"]:
        res["graph_break_reasons"] = [str(k)[:200] for k in list(counters["graph_break"])[:5]]
    logged = [r for r in read_metrics(run_dir) if "recompiles" in r]
    res["recompiles"] = logged[-1]["recompiles"] if logged else None  # graphs built after the first update
    if not res["last_loss"] == res["last_loss"]:  # NaN
        res.update(status="fail", error=f"loss is {res['last_loss']} at update {res['updates']}")
    return res


def _prepare_store(cfg, work: Path) -> float:
    from aiayn.data.pipeline import prepare_corpus

    t0 = time.perf_counter()
    prepare_corpus(cfg, cfg.data.prepared)
    return time.perf_counter() - t0


def _peak(work: Path, precision: str) -> float | None:
    path = work / "peaks.json"
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get(precision)


def throughput(cfg, run_dir: Path, warm: int, peak: float | None) -> dict[str, Any]:
    """Target tokens/s and model TFLOP/s of the updates after ``warm``, from the logged lines (each covers the
    updates since the one before) and the FLOPs of the batches those updates trained on (the run's epoch plans,
    as the trainer dealt them to one process: :func:`trained_plan`)."""
    from aiayn.data.pipeline import build_translation_data
    from aiayn.run.directory import read_run_config
    from benchmarks.flops import batch_training_flops

    steps = [r for r in read_metrics(run_dir) if "tokens_per_s" in r]
    run_cfg = read_run_config(run_dir)
    data, _ = build_translation_data(run_cfg, run_dir)
    plan = trained_plan(data, steps[-1]["step"] if steps else 0)
    seconds = tokens = flops = timed = 0
    before = 0
    rates: list[float] = []  # each timed logged window's tokens/s
    for r in steps:
        n, first = r["step"] - before, before
        before = r["step"]
        if first < warm:
            continue
        window = r["tokens_per_update"] * n
        rates.append(r["tokens_per_s"])
        seconds += window / r["tokens_per_s"]
        tokens += window
        timed += n
        flops += sum(batch_training_flops(run_cfg.model, data.collate_plan(plan[i])) for i in range(first, before))
    res = {"updates": steps[-1]["step"] if steps else 0, "timed_updates": timed,
           "tokens_per_update": round(tokens / max(timed, 1)),
           "tokens_per_s": round(tokens / seconds) if seconds else None,
           # a window that compiled a new shape (length buckets meet a new pair of lengths) is far slower than the
           # rest: the median window is the speed once every shape is compiled, the slowest shows the stall
           "median_window_tokens_per_s": round(statistics.median(rates)) if rates else None,
           "slowest_window_tokens_per_s": round(min(rates)) if rates else None,
           "model_tflops": round(flops / seconds / 1e12, 2) if seconds else None,
           "first_logged": [steps[0]["step"], steps[0]["elapsed_s"]] if steps else None,  # (update, seconds)
           "last_loss": steps[-1]["train_loss"] if steps else float("nan"),
           **update_times(steps, warm)}
    if peak and seconds:
        res["mfu"] = round(flops / seconds / peak, 3)
        res["peak_tflops"] = round(peak / 1e12, 1)
    return res


def trained_plan(data: Any, updates: int) -> list[Any]:
    """The planned batches of ``updates`` updates of one process without accumulation, in training order: the
    epochs' plans one after the other (a run of 200 updates on a corpus of 158 batches trains into epoch 1)."""
    plan: list[Any] = []
    epoch = 0
    while len(plan) < updates:
        batches = list(data.epoch_plan(epoch))
        if not batches:
            raise ValueError(f"epoch {epoch} plans no batch")
        plan += batches
        epoch += 1
    return plan


def update_times(steps: list[dict[str, Any]], warm: int) -> dict[str, Any]:
    """With one logged line per update: the median and slowest update after ``warm`` in seconds (each line's
    tokens over its tokens/s, timed by the loop between its reads of the device) and their ratio; nothing
    otherwise."""
    if any(b["step"] - a["step"] != 1 for a, b in zip(steps, steps[1:])):
        return {}
    times = [r["tokens_per_update"] / r["tokens_per_s"] for r in steps if r["step"] > warm and r["tokens_per_s"]]
    if len(times) < 2:
        return {}
    median = statistics.median(times)
    return {"median_update_s": round(median, 4), "slowest_update_s": round(max(times), 4),
            "slowest_over_median": round(max(times) / median, 2)}


# --- the loader-free comparison with the peers ------------------------------------------------------------------


def train_speed_item(item: str, work: Path, device: str, size: str) -> dict[str, Any]:
    """``benchmarks.train_throughput`` with :data:`SPEED_IMPLS` in one process (on a GPU, memory is measured per
    implementation by ``torch.cuda.max_memory_allocated``): the item's preset (:data:`SPEED_PRESETS`) on WMT-like
    lengths, bf16, 3 warm-up + 15 timed updates each; smoke: the tiny model on a CPU, compiled variants traced
    without inductor. Its JSON and markdown are in ``--work`` (the check merges them into ``train_throughput_cuda``)."""
    out = work / f"{item}.json"
    impls = SMOKE_SPEED_IMPLS if size == "smoke" else SPEED_IMPLS
    cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--device", device, "--no-isolate",
           "--impls", *impls, "--out-json", str(out), "--md", str(work / f"{item}.md")]
    if size == "smoke":
        cmd += ["--smoke", "--threads", "1", "--compile-backend", "eager"]
    else:
        cmd += ["--precision", "bf16", "--configs", SPEED_PRESETS[item], "--lengths", "wmt", "--warmup", "3",
                "--steps", "15"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        return {"status": "fail", "error": f"train_throughput exited {proc.returncode}",
                "log_tail": proc.stderr[-3000:]}
    result = json.loads(out.read_text(encoding="utf-8"))
    res: dict[str, Any] = {"json": str(out), "configs": {}}
    for c in result["configs"]:
        rows = c["results"]
        best = max((i for i in rows if i.startswith("aiayn")), key=lambda i: rows[i]["tokens_per_s"])
        res["configs"][c["config"]] = {
            "best": best, "best_mfu": round(rows[best].get("mfu_datasheet") or 0, 3),
            "tokens_per_s": {i: round(r["tokens_per_s"]) for i, r in rows.items()},
            "recompiles": {i: r["recompiles"] for i, r in rows.items() if r["recompiles"]},
            "slowest_over_median": max(r["slowest_over_median"] for r in rows.values()),
            "attention": rows[best].get("attention"),
            "best_over": {i: round(rows[best]["tokens_per_s"] / rows[i]["tokens_per_s"], 2) for i in rows
                          if not i.startswith("aiayn")}}
    return res


def merged_speed_results(items: dict[str, Any]) -> dict[str, Any] | None:
    """The train_throughput results of the passed train_speed_* items as one (their configs together)."""
    results = [json.loads(Path(items[i]["json"]).read_text(encoding="utf-8")) for i in SPEED_PRESETS
               if items.get(i, {}).get("status") == "pass" and Path(items[i].get("json", "")).is_file()]
    if not results:
        return None
    merged = dict(results[0])
    merged["configs"] = [c for r in results for c in r["configs"]]
    merged["command"] = "; ".join(dict.fromkeys(r["command"] for r in results))
    return merged


# --- compile cache: a second start ------------------------------------------------------------------------------


def compile_restart_item(work: Path, device: str, size: str) -> dict[str, Any]:
    """Seconds from ``aiayn train``'s process start to its first update (its first metrics line) for the compiled
    paper-big with levers, started after ``train_big_bf16_levers`` compiled the same graphs into the check's
    inductor cache (``$TORCHINDUCTOR_CACHE_DIR`` in ``--work``); started twice when that item did not run here."""
    from aiayn.config import load_config

    spec = TRAIN_ITEMS["train_big_bf16_levers"]
    over = item_overrides(spec, work, device, size)
    _prepare_store(load_config(spec.preset, over), work)  # the store is the first start's only other cost
    over += ["train.max_updates=2", "train.log_every=1"]
    earlier = (work / "runs" / "train_big_bf16_levers" / "metrics.jsonl").exists()
    starts = [_time_to_first_update(work, f"compile_restart_{i}", spec.preset, over)
              for i in range(1 if earlier else 2)]
    res = {"starts_s": starts, "second_start_s": starts[-1],
           "first_start": "train_big_bf16_levers (the item before)" if earlier else f"{starts[0]} s (this item)"}
    if size == "full" and starts[-1] >= 30:
        res.update(status="fail", error=f"the second start reached its first update in {starts[-1]} s (goal < 30 s)")
    return res


def _time_to_first_update(work: Path, name: str, preset: str, over: list[str]) -> float:
    """Seconds from the start of ``aiayn train PRESET`` (a new process) to its first metrics line; the run goes on
    to its end (2 updates) before the next start."""
    run = work / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    sets = [x for o in over for x in ("--set", o)]
    log = work / "items" / f"{name}.log"
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen([sys.executable, "-m", "aiayn", "train", preset, "--run-dir", str(run),
                                 "--no-progress", *sets], stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                cwd=REPO)
        first = None
        while proc.poll() is None and first is None:
            if any("train_loss" in r for r in read_metrics(run)):
                first = time.monotonic() - t0
            time.sleep(0.1)
        rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"aiayn train exited {rc}: {log.read_text(encoding='utf-8')[-1500:]}")
    return round(first if first is not None else time.monotonic() - t0, 1)


# --- the levers leave the training unchanged ---------------------------------------------------------------------


def levers_match_item(work: Path, device: str, size: str) -> dict[str, Any]:
    """paper-base, 200 updates (smoke: 4) in bf16 through ``aiayn train``, each update logged: eager with seed 1 and
    seed 2, and compiled with every lever (seed 1; smoke: the eager levers, an inductor build on a CPU takes minutes).
    The levers' largest |train_loss - eager's| over the updates of the second half is compared with the seeds' (the
    run-to-run noise): it must not exceed it. Also each run's tokens/s, and the levers run's recompiles after its
    first update and slowest update against the median (issue 59: none, and < 3x, over >= 200 updates)."""
    from aiayn.config import load_config
    from aiayn.train.run import train

    updates, every = (200, 1) if size == "full" else (4, 1)  # every update logged: its time and the recompiles
    runs = {"eager": [], "eager_seed2": ["train.seed=2"],
            "levers": [*LEVER_KEYS, f"train.compile={str(size == 'full').lower()}"]}
    losses, speed = {}, {}
    for name, sets in runs.items():
        over = paper_base_overrides(work, size) + [
            f"train.max_updates={updates}", f"train.log_every={every}", f"train.device={device}",
            f"train.precision={'fp32' if device == 'cpu' else 'bf16'}", *sets]
        cfg = load_config("paper-base", over)
        _prepare_store(cfg, work)
        run = work / "runs" / f"levers_match_{name}"
        shutil.rmtree(run, ignore_errors=True)
        train(cfg, run, progress=False)
        records = [r for r in read_metrics(run) if "train_loss" in r]
        losses[name] = {r["step"]: r["train_loss"] for r in records}
        speed[name] = throughput(cfg, run, UPDATES["base"][size][0], _peak(work, cfg.train.precision))
    late = [s for s in losses["eager"] if s > updates // 2]
    noise = max(abs(losses["eager_seed2"][s] - losses["eager"][s]) for s in late)
    moved = max(abs(losses["levers"][s] - losses["eager"][s]) for s in late)
    mean = {k: statistics.mean(v[s] for s in late) for k, v in losses.items()}  # the second half's mean loss
    res = {"updates": updates, "compared_steps": [late[0], late[-1]], "seed_noise": round(noise, 4),
           "levers_difference": round(moved, 4), "second_half_mean_loss": {k: round(v, 4) for k, v in mean.items()},
           "last_loss": {k: v[updates] for k, v in losses.items()}, "levers": runs["levers"],
           "tokens_per_s": {k: v["tokens_per_s"] for k, v in speed.items()},
           "model_tflops": {k: v["model_tflops"] for k, v in speed.items()},
           "slowest_over_median": {k: v.get("slowest_over_median") for k, v in speed.items()},
           "levers_recompiles": ([r.get("recompiles") for r in read_metrics(work / "runs" / "levers_match_levers")
                                  if "recompiles" in r] or [None])[-1]}
    if not moved <= noise:
        res.update(status="fail",
                   error=f"the levers moved the loss by {moved:.4f}, more than another seed does ({noise:.4f})")
    return res


def loop_against_benchmark(items: dict[str, Any]) -> list[str]:
    """Lines of the report: each ``aiayn train`` item against the loader-free row (train_speed_*) of the same model
    and levers, in model TFLOP/s (the two train on other batches of WMT-like lengths; goal >= 0.95x)."""
    bench = merged_speed_results(items)
    if bench is None:
        return []
    rows = {(c["config"], i): r for c in bench["configs"] for i, r in c["results"].items()}
    lines = []
    for item, (preset, impl) in LOOP_PEERS.items():
        r, b = items.get(item, {}), rows.get((preset, impl))
        tflops = (r.get("model_tflops") or {}).get("levers") if item == "levers_match" else r.get("model_tflops")
        if r.get("status") != "pass" or not b or not tflops:
            continue
        ratio = tflops * 1e12 / (b["mfu_datasheet"] * 989e12)
        lines.append(f"- {item} ({preset}, {impl}): aiayn train {tflops} model TFLOP/s = {ratio:.2f}x the loader-free "
                     f"benchmark's (goal >= 0.95x)")
    return lines
