"""The GPU check: every CUDA path aiayn has, run for real in one command, item by item, within a time budget.

    python -m benchmarks.gpu_check                       # on a GPU machine: 8 minutes at most (--budget-s 480)
    python -m benchmarks.gpu_check --continue --budget-s 560  # the items the first call had no time for
    python -m benchmarks.gpu_check --device cpu --smoke  # tiny sizes, on a CPU (CI): results in --work
    python -m benchmarks.gpu_check --items env train_bf16 translate   # a subset, e.g. to rerun failures
    python -m benchmarks.gpu_check --report --json F     # rewrite BENCHMARKS.md's section from a run's JSON

Each item runs in its own process (a crash, an out-of-memory or a hang fails that item only) with its own time
limit, inside one overall budget (``--budget-s``): an item that would not fit is reported as not run. The
check goes on past failures and writes, for every item, pass / fail / not run, its numbers and the error
(after every item, so a call cut short keeps what it measured):
JSON (``--json``, default ``benchmarks/results/gpu_check.json``) and the section ``gpu_check`` of
BENCHMARKS.md (``--md``); a ``--smoke`` run writes both into ``--work`` unless told otherwise, and ``--device cpu``
without ``--smoke`` is refused, so that no CPU run replaces the GPU results the repository keeps. Items, in the
order they run (on one H100 the first nine took 374 s; the CUDA tests and the two compiled items did not fit in
what was left and need the ``--continue`` call; BENCHMARKS.md estimates the calls with the paper-big items from the
measured H200 times). Every item's process shares one inductor cache in ``--work`` (``$TORCHINDUCTOR_CACHE_DIR``),
so a compile is paid once per machine and a ``--continue`` call reuses it.

- ``env``            torch, CUDA, driver, GPU name, SMs, memory, clocks; measured matmul peaks (bf16, fp32 with and
                     without TF32): the denominators of MFU.
- ``cuda_tests``     ``pytest -m cuda tests/test_cuda.py``: every CUDA path at toy size, for correctness.
- ``train_*``        paper-base (65M parameters, 37k shared BPE) on a token store prepared from a synthetic WMT-like
                     corpus (generated here: 100k pairs), 25,000-token updates, through ``aiayn train``'s own code:
                     bf16 eager, bf16 compiled (token-budget shapes, ``dynamic``), bf16 compiled with
                     ``data.length_buckets`` (static shapes), fp16 with its GradScaler, tf32, strict fp32; and
                     paper-big (213M) in bf16, eager, compiled, and compiled with every lever (``train_big_*``: 10
                     warm-up + 60 timed updates, each logged). Target tokens/s and MFU (model FLOPs of the batches
                     actually trained, over the measured peak) after warm-up updates, the slowest update against the
                     median, peak memory, graphs compiled, recompiles after the first update and graph breaks, the
                     last loss (``benchmarks/gpu_training.py``).
- ``train_speed_big``, ``train_speed_base``: issue 59's loader-free comparison with Hugging Face Marian (eager and
                     compiled) and torch.nn.Transformer, lever by lever, per preset; ``compile_restart``: a second
                     start of a compiled training against its compile cache; ``levers_match``: 200 updates with every
                     lever against eager bf16 and the run-to-run noise (``benchmarks/gpu_training.py`` says how).
- ``multi30k``       the quick Multi30k recipe end to end as the README runs it: wall time, test_2016_flickr BLEU;
                     then the validation BLEU the training logged against ``aiayn evaluate`` of the same weights
                     (the last checkpoint, greedy): the one precision rule.
- ``translate``      that run on CUDA in fp32 / tf32 / bf16 against the CPU (fp32): sentences/s, identical lines,
                     BLEU; and beam 4 batched against Hugging Face ``generate()`` on the same GPU
                     (``benchmarks.translate_speed``).
- ``serve``          ``aiayn serve`` on the GPU: native and LibreTranslate requests, concurrent, equal to translate.
- ``torchrun``       ``torchrun --nproc-per-node <GPUs>`` (NCCL) from the same store: a checkpoint, a kill -9 of
                     the whole job, ``--resume``, and the run reaching its last update.
- ``cpu_isa``        not a GPU path: ``make test-isa``'s decoding comparisons under the machine's widest PyTorch CPU
                     kernels (AVX-512 on the GPU machines lent so far, which CI's machine may lack), the GPU hidden.

Data: the synthetic corpus is generated (no registry is needed); Multi30k comes from ``$AIAYN_DATA_DIR/multi30k``
(carry ``shared/data/multi30k`` to a GPU machine that cannot download it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import child_env
from benchmarks.gpu_training import (
    SPEED_PRESETS,
    TRAIN_ITEMS,
    UPDATES,
    compile_restart_item,
    levers_match_item,
    loop_against_benchmark,
    merged_speed_results,
    paper_base_overrides,
    read_metrics,
    train_item,
    train_speed_item,
)

REPO = Path(__file__).resolve().parent.parent
NAME = "gpu_check"

# (item, time limit in seconds on a GPU); the smoke limits are each CPU run's, generous for a busy 2-core CI.
ITEMS: dict[str, int] = {
    "env": 60,
    "train_bf16": 75,
    "train_big_bf16": 120,
    "train_big_bf16_compile": 300,
    "multi30k": 240,
    "translate": 120,
    "serve": 60,
    "torchrun": 120,
    "train_fp16": 60,
    "train_tf32": 60,
    "train_fp32": 75,
    "cuda_tests": 240,
    "train_bf16_compile": 300,
    "train_bf16_compile_buckets": 300,
    "train_speed_big": 300,
    "train_big_bf16_levers": 240,
    "train_speed_base": 300,
    "compile_restart": 150,
    "levers_match": 300,
    "cpu_isa": 180,
}
# On a CPU: no compiled item (an inductor build takes minutes on 2 cores; tests/test_engine.py compiles once);
# train_speed_base traces its compiled rows without inductor, levers_match trains its eager levers.
SMOKE_ITEMS = ("env", "cuda_tests", "train_fp32", "train_big_bf16", "train_speed_base", "levers_match", "multi30k",
               "translate", "serve", "torchrun", "cpu_isa")
MULTI30K_SMOKE = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
                  "model.n_decoder_layers=1", "data.vocab_size=600", "train.max_updates=40", "train.eval_every=20",
                  "train.save_every=20", "train.warmup=10", "train.max_minutes=5", "decode.max_len_b=5"]
TRANSLATE_LINES = {"full": 500, "smoke": 24}


# --- the parent: items in processes, a budget, the report ----------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU version CI runs)")
    p.add_argument("--items", nargs="+", choices=list(ITEMS), help="run only these (default: all; smoke: a subset)")
    p.add_argument("--budget-s", type=float, default=480.0, help="overall time budget (default 480 s = 8 min)")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "aiayn-gpu-check"),
                   help="working directory, kept for --continue (default: /tmp/aiayn-gpu-check)")
    p.add_argument("--json", default=None, help=f"the results (default benchmarks/results/{NAME}.json on a GPU; "
                                                "a --smoke run's go to --work: they never replace a GPU's)")
    p.add_argument("--md", default=None, help="markdown file whose section is rewritten (default BENCHMARKS.md on a "
                                              "GPU; --work/BENCHMARKS.md for a --smoke run)")
    p.add_argument("--report", action="store_true", help="only rewrite the --md section from --json (no run)")
    p.add_argument("--continue", dest="cont", action="store_true",
                   help="keep the items --json already holds as run (pass or fail); run the rest (same --work)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(list(argv))
    if not args.device.startswith("cuda") and not args.smoke and not args.report and args.child is None:
        p.error(f"--device {args.device} runs the GPU's sizes off a GPU, where every item times out (and its table "
                "would replace the GPU's measured one): add --smoke for the tiny sizes, or run it on a GPU")
    # A smoke run (CI, a CPU) writes beside its work, never over the measured GPU results the repository keeps.
    local = args.smoke and not args.report
    args.json = args.json or str(Path(args.work) / f"{NAME}.json" if local else
                                 REPO / "benchmarks" / "results" / f"{NAME}.json")
    args.md = args.md or str(Path(args.work) / "BENCHMARKS.md" if local else REPO / "BENCHMARKS.md")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report:
        common.update_section(args.md, NAME, markdown(json.loads(Path(args.json).read_text(encoding="utf-8"))))
        return {}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.child:
        return run_child(args.child, work, args.device, args.smoke)
    items = args.items or (list(SMOKE_ITEMS) if args.smoke else list(ITEMS))
    started = time.monotonic()
    result: dict[str, Any] = {"check": NAME, "date": common.utc_now(), "device": args.device, "smoke": args.smoke,
                              "command": "python -m benchmarks." + NAME + (" " + " ".join(argv) if argv else ""),
                              "budget_s": args.budget_s, "work": str(work), "items": {}}
    if args.cont and Path(args.json).exists():
        before = json.loads(Path(args.json).read_text(encoding="utf-8"))
        done = {k: v for k, v in before.get("items", {}).items() if v["status"] in ("pass", "fail")}
        result["items"].update(done)
        result["command"] = before.get("command", result["command"]) + "; then " + result["command"]
        items = [i for i in items if i not in done]
    for item in items:
        left = args.budget_s - (time.monotonic() - started)
        limit = ITEMS[item] * (3 if args.smoke else 1)
        if left < min(limit, 30):
            result["items"][item] = {"status": "not run", "error": f"{left:.0f} s of the budget left"}
        else:
            result["items"][item] = run_item(item, work, args.device, args.smoke, min(limit, left))
        r = result["items"][item]
        if item in SPEED_PRESETS and r["status"] == "pass" and not args.smoke:
            _publish_train_speed(result["items"], args)
        print(f"[{NAME}] {item}: {r['status']} ({r.get('seconds', 0):.0f} s) {_brief(r)}", file=sys.stderr, flush=True)
        _write(result, args)  # after every item: a run cut short still leaves what it measured
    result["seconds"] = round(sum(r.get("seconds", 0) for r in result["items"].values()), 1)  # every call's
    _write(result, args)
    return result


def _publish_train_speed(items: dict[str, Any], args: argparse.Namespace) -> None:
    """The train_speed_* items' train_throughput results beside the check's JSON (``train_throughput_cuda.json``)
    and as their section in ``--md``."""
    from benchmarks.train_throughput import markdown_accelerator

    result = merged_speed_results(items)
    common.write_json(Path(args.json).parent / "train_throughput_cuda.json", result)
    common.update_section(args.md, "train_throughput_cuda", markdown_accelerator(result))


def _write(result: dict[str, Any], args: argparse.Namespace) -> None:
    common.write_json(args.json, result)
    common.update_section(args.md, NAME, markdown(result))


def run_item(item: str, work: Path, device: str, smoke: bool, limit: float) -> dict[str, Any]:
    """Run ``item`` in a child process with ``limit`` seconds; its result dict, with status and seconds."""
    out = work / "items" / f"{item}.json"
    out.unlink(missing_ok=True)
    log = work / "items" / f"{item}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", f"benchmarks.{NAME}", "--child", item, "--work", str(work), "--device", device]
    env = child_env()
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor-cache"))  # one compile cache for every item
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd + (["--smoke"] if smoke else []), stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
    seconds = round(time.monotonic() - t0, 1)
    tail = _tail(log)
    if out.exists():
        res = json.loads(out.read_text(encoding="utf-8"))
    else:
        res = {"status": "fail"}
    if rc is None:
        res.update(status="fail", error=f"timed out after {limit:.0f} s" + _progress_note(item, work))
    elif rc != 0 and res.get("status") != "fail":
        res.update(status="fail", error=f"exit status {rc}")
    if res["status"] == "fail" and "error" not in res:
        res["error"] = "no result written"
    if res["status"] == "fail":
        res.setdefault("log_tail", tail)
    res["seconds"] = seconds
    return res


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process, its process group and every descendant (torchrun's workers start their own process
    groups, so killing the launcher's group alone leaves them training)."""
    victims = [proc.pid, *_descendants(proc.pid)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = entry.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


_WORKER_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?(aiayn: .*)$")
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)\b.*)$")
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def job_error(log: str) -> str:
    """What a ``torchrun`` job's log says went wrong, in a line: each worker's ``aiayn: ...`` error (else the last
    exception line a worker printed) and torchrun's root cause (which rank, its exit code). The log's tail is
    only the launcher's own traceback, which names no cause."""
    lines = [ln.strip() for ln in log.splitlines()]
    found = list(dict.fromkeys(m.group(1) for ln in lines if (m := _WORKER_LINE.match(ln))))
    if not found:
        raised = [m.group(1) for ln in lines if (m := _EXCEPTION_LINE.match(ln)) and "ChildFailedError" not in ln]
        found = raised[-1:]
    root = _ROOT_CAUSE.search(log)
    if root:
        code = int(root.group(2))
        found.append(f"torchrun: rank {root.group(1)} exited with "
                     + (f"signal {-code}" if code < 0 else f"status {code}"))
    return "; ".join(found) or "the log names no cause"


def _progress_note(item: str, work: Path) -> str:
    """Where a timed-out training item got to (its metrics.jsonl)."""
    records = read_metrics(work / "runs" / item)
    steps = [r for r in records if "tokens_per_s" in r]
    if not steps:
        return ""
    return f" (reached update {steps[-1]['step']} at {steps[-1].get('elapsed_s', 0):.0f} s of training)"


def _brief(r: dict[str, Any]) -> str:
    if r["status"] != "pass":
        return str(r.get("error", ""))[:300]
    keys = ("tokens_per_s", "mfu", "test_bleu", "bleu_gap", "passed", "gpu")
    return ", ".join(f"{k}={r[k]}" for k in keys if k in r)


# --- the children ----------------------------------------------------------------------------------------------


def run_child(item: str, work: Path, device: str, smoke: bool) -> dict[str, Any]:
    """Run one item in this process and write ``work/items/ITEM.json`` (status pass / fail and the numbers)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    out = work / "items" / f"{item}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    size = "smoke" if smoke else "full"
    try:
        fn = CHILDREN.get(item) or (lambda w, d, s: train_item(item, w, d, s))
        res = fn(work, device, size)
        res.setdefault("status", "pass")
    except Exception as e:  # every failure is a result of the check
        res = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:2000],
               "traceback": traceback.format_exc()[-3000:]}
        print(res["traceback"], file=sys.stderr)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, out)
    return res


def _aiayn(*args: str, timeout: float | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m aiayn ARGS`` with this repository first on the path; output captured."""
    proc = subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True, text=True, env=child_env(),
                          cwd=REPO, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"aiayn {' '.join(args[:2])} exited {proc.returncode}: {proc.stderr[-1500:]}")
    return proc


def env_item(work: Path, device: str, size: str) -> dict[str, Any]:
    import platform

    import torch

    from benchmarks.flops import matmul_peak

    res: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cpu_cores": os.cpu_count()}
    with contextlib.suppress(ImportError):
        import transformers

        res["transformers"] = transformers.__version__
    if device == "cpu":
        res["peak_fp32_tflops"] = round(matmul_peak([256], reps=2)["flops_per_s"] / 1e12, 4)
        peak = res["peak_fp32_tflops"] * 1e12
        common.write_json(work / "peaks.json", {"bf16": peak, "fp32": peak})
        return res
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    res.update(gpu=props.name, gpus=torch.cuda.device_count(), sms=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
               cudnn=torch.backends.cudnn.version(), nccl=_nccl_version())
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        q = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip().splitlines()
        res["nvidia_smi"] = dict(zip(q.split(","), (x.strip() for x in smi[0].split(",")))) if smi else None
    peaks = {}
    sizes = [4096, 8192]
    peaks["bf16"] = matmul_peak(sizes, reps=5, device=dev, dtype=torch.bfloat16)["flops_per_s"]
    peaks["fp16"] = matmul_peak(sizes, reps=5, device=dev, dtype=torch.float16)["flops_per_s"]
    peaks["fp32"] = matmul_peak(sizes, reps=3, device=dev, dtype=torch.float32)["flops_per_s"]  # IEEE: TF32 off
    from aiayn.engine import kernels

    with kernels(dev, "tf32"):
        peaks["tf32"] = matmul_peak(sizes, reps=3, device=dev, dtype=torch.float32)["flops_per_s"]
    res["matmul_peak_tflops"] = {k: round(v / 1e12, 1) for k, v in peaks.items()}
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # clocks right after the matmuls
        smi = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
        res["sm_clock_after_matmuls"] = smi
    common.write_json(work / "peaks.json", peaks)
    return res


def _nccl_version() -> str | None:
    try:
        v = __import__("torch").cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a PyTorch without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def cuda_tests_item(work: Path, device: str, size: str) -> dict[str, Any]:
    res = _pytest(["tests/test_cuda.py", "-m", "cuda", "--durations=0"], work / "items" / "cuda_tests.pytest.log")
    if device != "cpu" and res["skipped"]:
        res["skip_reasons"] = res.pop("skip_lines")[:10]
    res.pop("skip_lines", None)
    return res


def cpu_isa_item(work: Path, device: str, size: str) -> dict[str, Any]:
    """The suite's decoding comparisons (the Makefile's ISA_TESTS, as ``make test-isa``) under this CPU's widest
    PyTorch kernels: AVX-512 on the GPU machines lent so far (some sessions' CPU machines have it too, CI's may
    not), where a test that holds only by one CPU's rounding would fail (issue 47). The CPU suite's conftest hides
    the GPU from these tests. Smoke: one quick test."""
    model, flags = _cpuinfo()
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "default"
    tests = isa_tests()
    if size == "smoke":
        tests = ["tests/test_head_widths.py", "-k", "refuse"]
    workers = str(max(1, min(8, (os.cpu_count() or 2) // 2)))
    env = child_env(ATEN_CPU_CAPABILITY=isa)
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           capture_output=True, text=True, env=env, cwd=REPO)
    res = {"isa": isa, "torch_cpu_capability": probe.stdout.strip(), "cpu": model, "workers": int(workers)}
    res.update(_pytest([*tests, "-n", workers, "--dist", "worksteal"], work / "items" / "cpu_isa.pytest.log", env))
    res.pop("skip_lines", None)
    return res


def isa_tests() -> list[str]:
    """The Makefile's ISA_TESTS (one list for ``make test-isa`` and this check)."""
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    body = re.search(r"^ISA_TESTS\s*:=\s*((?:.*\\\n)*.*)$", text, flags=re.M)
    if body is None:
        raise RuntimeError("no ISA_TESTS in the Makefile")
    return body.group(1).replace("\\\n", " ").split()


def _cpuinfo() -> tuple[str | None, set[str]]:
    """This CPU's model name and flags (Linux /proc/cpuinfo; none elsewhere)."""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        names = [x.split(":", 1)[1].strip() for x in text.splitlines() if x.startswith("model name")]
        return (names[0] if names else None), set(text.split())
    return None, set()


def _pytest(args: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``pytest ARGS -v`` in this repository, its output streamed to ``log`` (a run cut at its time limit still
    says how far it got); counts, the failed tests by name and the SKIPPED lines."""
    cmd = [sys.executable, "-m", "pytest", *args, "-v", "-p", "no:cacheprovider", "-o", "addopts=", "-rfEs"]
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env or child_env())
    out = log.read_text(encoding="utf-8", errors="replace")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", out)}
    # each failure by name, from the -v lines ("tests/x.py::t FAILED"; with xdist "[gw0] [ 5%] FAILED tests/...")
    failed = list(dict.fromkeys(a or b for a, b in re.findall(
        r"^(\S+::\S+) (?:FAILED|ERROR)|\] (?:FAILED|ERROR) (\S+::\S+)", out, flags=re.M)))
    res = {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0) + counts.get("error", 0)
           + counts.get("errors", 0), "skipped": counts.get("skipped", 0), "failed_tests": failed,
           "skip_lines": re.findall(r"^SKIPPED .*$", out, flags=re.M)}
    if proc.returncode != 0:
        res.update(status="fail", error=f"pytest exit {proc.returncode}: {', '.join(failed) or out[-800:]}")
    return res


# Multi30k, translation, serving, torchrun.


def _multi30k_run(work: Path) -> Path:
    run = work / "runs" / "multi30k"
    if not (run / "model.safetensors").exists():
        raise RuntimeError("the multi30k item did not leave a trained run")
    return run


def multi30k_item(work: Path, device: str, size: str) -> dict[str, Any]:
    """The quick recipe as the README runs it (plus the validation BLEU it logs); test BLEU; then validation BLEU
    = ``aiayn evaluate --beam 1`` of the last checkpoint."""
    if not os.environ.get("AIAYN_DATA_DIR") or not (Path(os.environ["AIAYN_DATA_DIR"]) / "multi30k").is_dir():
        return {"status": "not run", "error": "no $AIAYN_DATA_DIR/multi30k (carry shared/data/multi30k)"}
    run = work / "runs" / "multi30k"
    shutil.rmtree(run, ignore_errors=True)
    over = ["train.eval_bleu=true", f"train.device={device}"] + (MULTI30K_SMOKE if size == "smoke" else [])
    sets = [x for o in over for x in ("--set", o)]
    t0 = time.perf_counter()
    _aiayn("train", "multi30k_en_de_quick", "--run-dir", str(run), "--no-progress", *sets)
    wall = time.perf_counter() - t0
    records = read_metrics(run)
    steps = [r for r in records if "tokens_per_s" in r]
    evals = [r for r in records if "valid_bleu" in r]
    t0 = time.perf_counter()
    test = _evaluate(run, "test_2016_flickr", device)
    eval_s = time.perf_counter() - t0
    res = {"updates": steps[-1]["step"], "train_wall_s": round(wall, 1), "training_s": steps[-1]["elapsed_s"],
           "median_tokens_per_s": sorted(r["tokens_per_s"] for r in steps)[len(steps) // 2],
           "test_bleu": round(test["bleu"], 2), "evaluate_s": round(eval_s, 1),
           "inference_weights": "average of the last 3 checkpoints (the recipe's)"}
    # The one precision rule: the last logged validation BLEU is the BLEU of the weights it was computed with.
    last = run.parent / "multi30k_last"
    shutil.rmtree(last, ignore_errors=True)
    shutil.copytree(run, last)
    _aiayn("average", str(last), "--last", "1", "--replace")
    valid = _evaluate(last, "valid", device, "--beam", "1")
    res.update(logged_valid_bleu=evals[-1]["valid_bleu"], logged_at=evals[-1]["step"],
               evaluate_valid_bleu=round(valid["bleu"], 4))
    res["bleu_gap"] = round(abs(res["evaluate_valid_bleu"] - res["logged_valid_bleu"]), 4)
    if res["bleu_gap"] > 0.05:
        res.update(status="fail", error=f"validation BLEU {res['logged_valid_bleu']} logged by the training, "
                                        f"{res['evaluate_valid_bleu']} from aiayn evaluate of the same weights")
    return res


def _evaluate(run: Path, split: str, device: str, *extra: str) -> dict[str, Any]:
    """``aiayn evaluate RUN --split SPLIT`` on ``device``; the scores it writes to RUN/eval/gpu_check_SPLIT.json."""
    name = f"gpu_check_{split}"
    _aiayn("evaluate", str(run), "--split", split, "--device", device, "--name", name, *extra)
    return json.loads((run / "eval" / f"{name}.json").read_text(encoding="utf-8"))["scores"]


def translate_item(work: Path, device: str, size: str) -> dict[str, Any]:
    """The multi30k run translating test_2016_flickr on the device in each precision against the CPU's fp32."""
    import torch
    from sacrebleu.metrics import BLEU

    from aiayn import load
    from aiayn.eval.evaluate import split_pairs

    run = _multi30k_run(work)
    tr = load(run, "cpu", "fp32")
    pairs = split_pairs(tr.cfg, "test_2016_flickr")[: TRANSLATE_LINES[size]]
    src, refs = [s for s, _ in pairs], [t for _, t in pairs]

    def timed(translator) -> tuple[list[str], float]:
        translator.translate(src[:16])  # warm-up: kernels, allocator
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = translator.translate(src)
        if device != "cpu":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    cpu_out, cpu_s = timed(tr)
    bleu = lambda hyps: round(BLEU().corpus_score(hyps, [refs]).score, 2)  # noqa: E731
    res: dict[str, Any] = {"sentences": len(src), "beam": tr.cfg.decode.beam,
                           "cpu_fp32": {"sentences_per_s": round(len(src) / cpu_s, 1), "bleu": bleu(cpu_out),
                                        "threads": torch.get_num_threads()}}
    precisions = ["fp32"] if device == "cpu" else ["fp32", "tf32", "bf16"]
    for q in precisions:
        out, s = timed(load(run, device, q))
        same = sum(a == b for a, b in zip(out, cpu_out))
        res[f"{device}_{q}"] = {"sentences_per_s": round(len(src) / s, 1), "bleu": bleu(out),
                                "bleu_minus_cpu": round(bleu(out) - bleu(cpu_out), 2),
                                "identical_to_cpu": round(same / len(src), 3)}
    if device != "cpu" and res[f"{device}_fp32"]["identical_to_cpu"] < 0.95:
        same = res[f"{device}_fp32"]["identical_to_cpu"]
        res.update(status="fail", error=f"CUDA fp32 gives the CPU's line on {same:.1%} of the sentences")
    # beam 4 batched against Hugging Face generate() on the same device (benchmarks.translate_speed)
    ts_json, ts_md = work / "translate_speed.json", work / "translate_speed.md"
    cmd = [sys.executable, "-m", "benchmarks.translate_speed", "--run-dir", str(run), "--device", device,
           "--precision", *(["fp32"] if device == "cpu" else ["fp32", "bf16"]), "--modes", "batched",
           "--engines", "aiayn", "aiayn-exact", "aiayn-graphs", "hf", "--limit", str(TRANSLATE_LINES[size]),
           "--md", str(ts_md),
           *(["--max-len", "8", "--threads", "1"] if size == "smoke" else []),
           "--out-json", str(ts_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env())
    if proc.returncode != 0:
        res["hf_comparison_error"] = proc.stderr[-1500:]
        res.setdefault("status", "fail")
        res.setdefault("error", "benchmarks.translate_speed failed")
        return res
    res["hf_comparison"] = hf_comparison(json.loads(ts_json.read_text(encoding="utf-8")))
    return res


def hf_comparison(speed: dict[str, Any]) -> dict[str, Any]:
    """translate_speed's result, per mode and engine: sentences/s, BLEU, outputs equal to aiayn's; and aiayn's and
    aiayn-graphs' speed over HF generate()'s."""
    out = {mode: {e: {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()
                      if k in ("sentences_per_s", "bleu", "same_as_aiayn")}
                  for e, r in engines.items()} for mode, engines in speed["modes"].items()}
    for engines in out.values():
        for ours in ("aiayn", "aiayn-graphs"):
            if "hf" in engines and ours in engines:
                engines[f"{ours.replace('-', '_')}_over_hf"] = round(
                    engines[ours]["sentences_per_s"] / engines["hf"]["sentences_per_s"], 2)
    return out


def serve_item(work: Path, device: str, size: str) -> dict[str, Any]:
    """``aiayn serve`` on the device: 8 concurrent native requests and a LibreTranslate one, equal to translate (the
    LibreTranslate one as LibreTranslate formats a translation: a model's output need not end or start as its source
    does, a small model's least of all)."""
    import html
    from concurrent.futures import ThreadPoolExecutor

    from aiayn import load
    from aiayn.eval.evaluate import split_pairs
    from aiayn.serve.libretranslate import libre_format
    from benchmarks.serve_load import connect, request, start_server, stop_server

    run = _multi30k_run(work)
    tr = load(run, device, "auto")
    src = [s for s, _ in split_pairs(tr.cfg, "test_2016_flickr")[:16]]
    expected = tr.translate(src)
    del tr
    proc, url, lines = start_server(run, "--device", device)
    try:
        def one(i: int) -> tuple[int, Any, float]:
            conn = connect(url)
            t0 = time.perf_counter()
            status, body = request(conn, "POST", "/v1/translate", {"text": src[2 * i: 2 * i + 2]})
            return status, body, time.perf_counter() - t0

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(8)))
        wall = time.perf_counter() - t0
        got = [t["text"] for status, body, _ in answers if status == 200 for t in body["translations"]]
        status, lt = request(connect(url), "POST", "/translate", {"q": src[0], "source": "en", "target": "de"})
        _, info = request(connect(url), "GET", "/v1/model")
    finally:
        code = stop_server(proc)
    res = {"requests": 8, "sentences": len(src), "wall_s": round(wall, 2),
           "statuses": sorted({s for s, _, _ in answers}),
           "identical_to_translate": sum(a == b for a, b in zip(got, expected)),
           "libretranslate_status": status,  # formatted as LibreTranslate formats it (its case, its final mark)
           "libretranslate_same": (lt or {}).get("translatedText") == html.unescape(libre_format(src[0], expected[0])),
           "server_device": (info or {}).get("device"), "server_exit": code}
    if res["statuses"] != [200] or res["identical_to_translate"] != len(src) or not res["libretranslate_same"]:
        res.update(status="fail", error=f"served answers differ from translate: {res}", log=lines[-10:])
    return res


def torchrun_item(work: Path, device: str, size: str) -> dict[str, Any]:
    """``torchrun`` on every GPU (NCCL; on a CPU two processes with gloo) from the store: a checkpoint at update
    10, kill -9 of the job, ``--resume``, the run reaching update 30 (smoke: 4, 8)."""
    import torch

    from aiayn.train.checkpoint import list_checkpoints

    save, total = (10, 30) if size == "full" else (4, 8)
    procs = torch.cuda.device_count() if device != "cpu" else 2
    run = work / "runs" / "torchrun"
    shutil.rmtree(run, ignore_errors=True)
    over = paper_base_overrides(work, size) + [f"train.save_every={save}", f"train.max_updates={total}",
                                               f"train.device={device}", "train.keep_last=3"]
    sets = [x for o in over for x in ("--set", o)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)]
    env = child_env(OMP_NUM_THREADS="1")
    log1 = work / "items" / "torchrun-1.log"
    t0 = time.perf_counter()
    with open(log1, "w", encoding="utf-8") as f:
        job = subprocess.Popen([*launcher, "-m", "aiayn", "train", "paper-base", "--run-dir", str(run),
                                "--no-progress", *sets], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                               start_new_session=True)
        while job.poll() is None and not any(s >= save for s in list_checkpoints(run)):
            time.sleep(0.2)
        logged = [r["step"] for r in read_metrics(run) if "tokens_per_s" in r][-1:] or [None]
        _kill_group(job)
    first = log1.read_text(encoding="utf-8", errors="replace")
    before = list_checkpoints(run)
    if not before:
        return {"status": "fail", "processes": procs, "error": f"no checkpoint before the job ended (exit "
                f"{job.returncode}): {job_error(first)}", "log_tail": first[-3000:]}
    log2 = work / "items" / "torchrun-2.log"
    with open(log2, "w", encoding="utf-8") as f:
        rc = subprocess.run([*launcher, "-m", "aiayn", "train", "--resume", str(run), "--no-progress"],
                            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    second = log2.read_text(encoding="utf-8", errors="replace")
    steps = [r["step"] for r in read_metrics(run) if "tokens_per_s" in r]
    resumed = re.search(r"resumed from step (\d+)", second)
    backend = "nccl" if device != "cpu" else "gloo"
    res = {"processes": procs, "backend": backend, "last_logged_before_kill": logged[0],
           "checkpoints_before_kill": before, "resumed_from": int(resumed.group(1)) if resumed else None,
           "last_update": steps[-1] if steps else None, "resume_exit": rc, "job_s": round(time.perf_counter() - t0, 1)}
    if before[-1] >= total:  # the kill came too late to test anything
        res.update(status="fail", error=f"the job had reached update {before[-1]} of {total} before the kill")
    elif rc != 0 or res["last_update"] != total or res["resumed_from"] != before[-1]:
        res.update(status="fail", error=f"resume exit {rc}, resumed from {res['resumed_from']} (newest checkpoint "
                                        f"{before[-1]}), last update {res['last_update']}"
                                        + (f": {job_error(second)}" if rc != 0 else ""), log_tail=second[-3000:])
    return res


CHILDREN: dict[str, Callable[[Path, str, str], dict[str, Any]]] = {
    "env": env_item, "cuda_tests": cuda_tests_item, "multi30k": multi30k_item, "translate": translate_item,
    "serve": serve_item, "torchrun": torchrun_item, "cpu_isa": cpu_isa_item,
    "compile_restart": compile_restart_item, "levers_match": levers_match_item,
    **{item: (lambda w, d, s, item=item: train_speed_item(item, w, d, s)) for item in SPEED_PRESETS},
}


# --- the report ------------------------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    items = result["items"]
    env = items.get("env", {})
    head = (f"### The GPU check (`{result['command']}`)\n\n"
            f"{result['date']}; {env.get('gpu', result['device'])}, torch {env.get('torch', '?')}, "
            f"CUDA {env.get('cuda', '-')}{' (smoke sizes)' if result['smoke'] else ''}; "
            f"{result.get('seconds', '…')} s of item time in all. JSON: "
            "`benchmarks/results/gpu_check.json`.\n")
    rows = ["| item | status | s | numbers / error |", "|---|---|---|---|"]
    for name, r in items.items():
        if r["status"] == "pass":
            text = _numbers(name, r)
        else:
            text = str(r.get("error", "")).replace("|", "/").replace("\n", " ")[:400]
        rows.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {text} |")
    loop = loop_against_benchmark(items)
    tail = ("\n`aiayn train`'s loop against the loader-free benchmark (train_speed_*):\n\n" + "\n".join(loop) + "\n"
            if loop else "")
    return head + "\n" + "\n".join(rows) + "\n" + tail


def _training_numbers(name: str, r: dict[str, Any]) -> str:
    """The numbers of a training item (benchmarks/gpu_training.py)."""
    if name in SPEED_PRESETS:
        return "; ".join(
            f"{preset}: best {c['best']} MFU {c['best_mfu']:.1%}, "
            + ", ".join(f"{c['best_over'][p]}x {p}" for p in c["best_over"])
            + f"; slowest update {c['slowest_over_median']:.2f}x the median, recompiles {c['recompiles'] or 0}"
            for preset, c in r["configs"].items())
    if name == "compile_restart":
        return f"second start to its first update {r['second_start_s']} s (first start: {r['first_start']})"
    if name == "levers_match":
        return (f"{r['updates']} updates: loss with every lever within {r['levers_difference']} of eager's, seeds "
                f"1 and 2 {r['seed_noise']} apart; last loss {r['last_loss']}; tok/s {r['tokens_per_s']}; levers: "
                f"recompiles {r.get('levers_recompiles')}, slowest update "
                f"{(r.get('slowest_over_median') or {}).get('levers')}x the median")
    mem = f", peak {r['peak_memory_gib']} GiB" if "peak_memory_gib" in r else ""
    mfu = f", MFU {r['mfu']:.1%} of {r.get('peak_tflops')} TFLOP/s" if r.get("mfu") else ""
    every = UPDATES[TRAIN_ITEMS[name].updates]["full"][2] if name in TRAIN_ITEMS else 5
    windows = (f", windows of {every}: median {r['median_window_tokens_per_s']:,}, slowest "
               f"{r['slowest_window_tokens_per_s']:,}" if r.get("median_window_tokens_per_s") else "")
    slowest = (f"; slowest update {r['slowest_over_median']}x the median" if r.get("slowest_over_median") else "")
    recompiles = f", recompiles {r['recompiles']}" if r.get("recompiles") is not None else ""
    return (f"{r['tokens_per_s']:,} tgt tok/s ({r['tokens_per_update']:,} per update, {r['timed_updates']} timed"
            f"{windows}){mfu}{mem}{slowest}; {_first(r)}graphs {r['graphs']}{recompiles}, breaks "
            f"{r['graph_breaks']}; loss {r['last_loss']}")


def _first(r: dict[str, Any]) -> str:
    """"first update 0.69 s; " (older results) or "first 5 updates 1.2 s; " (the first logged line)."""
    if r.get("first_update_s") is not None:
        return f"first update {r['first_update_s']} s; "
    if r.get("first_logged"):
        n, s = r["first_logged"]
        return f"first {n} update{'s' if n > 1 else ''} {s} s; "
    return ""


def _numbers(name: str, r: dict[str, Any]) -> str:
    if name == "env":
        peaks = r.get("matmul_peak_tflops") or {"fp32": r.get("peak_fp32_tflops")}
        return (f"{r.get('gpu', 'CPU')}, {r.get('sms', '-')} SMs, {r.get('memory_gib', '-')} GiB; matmul peak TFLOP/s "
                + ", ".join(f"{k} {v}" for k, v in peaks.items()))
    if name == "cuda_tests":
        return f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
    if name == "cpu_isa":
        return (f"ATEN_CPU_CAPABILITY={r['isa']} (PyTorch: {r['torch_cpu_capability']}), {r['cpu']}, "
                f"{r['workers']} workers: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
                + (f"; failed: {', '.join(r['failed_tests'])}" if r.get("failed_tests") else ""))
    if name in TRAIN_ITEMS or name in SPEED_PRESETS or name in ("compile_restart", "levers_match"):
        return _training_numbers(name, r)
    if name == "multi30k":
        return (f"{r['updates']} updates in {r['train_wall_s']} s (training {r['training_s']} s), test BLEU "
                f"{r['test_bleu']}; validation BLEU logged {r['logged_valid_bleu']:.2f} = evaluate "
                f"{r['evaluate_valid_bleu']:.2f}")
    if name == "translate":
        parts = [f"{k}: {v['sentences_per_s']} sent/s, BLEU {v['bleu']}"
                 + (f", same as CPU {v['identical_to_cpu']:.1%}" if "identical_to_cpu" in v else "")
                 for k, v in r.items() if isinstance(v, dict) and "sentences_per_s" in v]
        for mode, engines in (r.get("hf_comparison") or {}).items():
            for ours in ("aiayn", "aiayn_graphs"):
                if f"{ours}_over_hf" in engines:
                    parts.append(f"{mode}: {ours.replace('_', ' ')} {engines[f'{ours}_over_hf']}x HF generate()")
        return "; ".join(parts)
    if name == "serve":
        return (f"{r['requests']} concurrent requests in {r['wall_s']} s, {r['identical_to_translate']}/"
                f"{r['sentences']} equal to translate, LibreTranslate equal: {r['libretranslate_same']}")
    if name == "torchrun":
        return (f"{r['processes']} process(es), {r['backend']}: killed -9 after the checkpoint of update "
                f"{r['checkpoints_before_kill'][-1]}, resumed from {r['resumed_from']}, reached {r['last_update']}")
    return ""


if __name__ == "__main__":
    main()
