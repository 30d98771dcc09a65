"""Whether this CPU runs bf16 natively, correctly and faster than fp32: the one place that decides, by looking and by
trying, never by the CPU's name alone.

Three steps, the first that fails deciding fp32:

1. **Flags.** The CPU must have bf16 instructions of its own: ``avx512_bf16`` (Intel Cooper Lake and Sapphire Rapids
   on, AMD Zen 4 on) or ``amx_bf16`` (Intel's matrix units, Sapphire Rapids on), read from ``/proc/cpuinfo`` and from
   PyTorch's own checks (``torch.cpu``), which also ask the OS whether it lets a process use them. Elsewhere bf16 is
   emulated and slower than fp32.
2. **A child process** runs bf16 once: a linear layer (PyTorch's and oneDNN's prepacked one), a matrix product,
   scaled dot-product attention, a layer norm, a backward pass under autocast and a product of int8 weights with bf16
   rows, each compared with fp32. oneDNN
   picks its instructions at run time from what the CPU reports, and a hypervisor may report what it does not let a
   guest run: the result is "Illegal instruction" (SIGILL), which kills a process. So it is tried in a child: a child
   killed by a signal, a wrong result, or no answer within :data:`PROBE_TIMEOUT_S` means fp32, with one line that
   says which. The child also times a product in both precisions at 4 rows (one sentence, beam 4) and at 256 rows
   (a batch): inference takes bf16 only where it measured faster at both, training where it measured faster on a
   batch (:meth:`CpuBf16.precision`); and the two int8 kinds at the same rows, so that ``--precision int8`` takes
   bf16 rows only where they measured faster (:meth:`CpuBf16.int8_kind`).
3. **The cache.** The answer is kept in ``cache_dir()/cpu_probe.json`` (:func:`aiayn.files.cache_dir`) per CPU model,
   flags, PyTorch version, probe (its code) and the environment variables that change PyTorch's or oneDNN's choice of
   instructions, so the child runs once per machine, not per command.

``AIAYN_CPU_BF16=off`` keeps ``--precision auto`` at fp32 on such a CPU (an explicit ``--precision bf16`` still runs,
if the probe passes); the test suite sets it, so that its comparisons with fp32 references stay fp32 on every
machine, and its bf16 tests ask for bf16 by name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import torch

from aiayn.files import atomic_write_json, cache_dir, read_json

log = logging.getLogger("aiayn")

CACHE_FILE = "cpu_probe.json"
ENV = "AIAYN_CPU_BF16"  # "off": --precision auto stays fp32 on the CPU (aiayn.device)
PROBE_TIMEOUT_S = 120.0
NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile",
               "avx512_fp16")
# Environment variables that change which instructions PyTorch or oneDNN run: part of the cache key.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_CBWR", "ONEDNN_DEFAULT_FPMATH_MODE")
# Inference takes bf16 where its products measured at least this much faster than fp32 at 256 rows, and not slower
# than this fraction at 4 rows; training where they measured this much faster at 256 rows.
MIN_BATCH_SPEEDUP = 1.1
MIN_ROW_SPEEDUP = 0.9

# What the child runs: bf16 beside fp32 on the operations a Transformer runs, then timings. It prints one JSON
# object: {"checks": {name: max relative error}, "ms": {"fp32 4": ..., "bf16 4": ..., "fp32 256": ..., ...}}.
CHILD_CODE = r"""
import json, time
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_num_threads(1)
bf = torch.bfloat16


def err(a, ref):
    a = a.float()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


checks = {}
x, w, b = torch.randn(64, 256), torch.randn(512, 256) / 16, torch.randn(512)
ref = F.linear(x, w, b)
checks["linear"] = err(F.linear(x.to(bf), w.to(bf), b.to(bf)), ref)
mkldnn = getattr(torch.ops, "mkldnn", None)
packed = torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
if packed:
    wp = mkldnn._reorder_linear_weight(w.to(bf), 64)
    checks["packed linear"] = err(mkldnn._linear_pointwise(x.to(bf), wp, b.to(bf), "none", [], ""), ref)
a, c = torch.randn(8, 64, 64), torch.randn(8, 64, 64)
checks["matmul"] = err(torch.matmul(a.to(bf), c.to(bf)), torch.matmul(a, c))
q, k, v = (torch.randn(2, 4, 16, 64) for _ in range(3))
checks["attention"] = err(F.scaled_dot_product_attention(q.to(bf), k.to(bf), v.to(bf)),
                          F.scaled_dot_product_attention(q, k, v))
h = torch.randn(64, 256)
checks["layer norm"] = err(F.layer_norm(h.to(bf), (256,)), F.layer_norm(h, (256,)))
lin = torch.nn.Linear(256, 512)
with torch.autocast("cpu", dtype=bf):
    lin(x).float().square().mean().backward()
g = lin.weight.grad.clone()
lin.zero_grad()
lin(x).square().mean().backward()
checks["autocast backward"] = err(g, lin.weight.grad)
# int8 weights with bf16 rows (aiayn.linear's int8_bf16): PyTorch's weight-only int8 kernel
wi = torch.randn(512, 256) / 16
wscale = (wi.abs().amax(dim=1) / 127).to(bf)
wq = torch.div(wi, wscale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
wref = F.linear(x.to(bf).float(), wq.float() * wscale.float()[:, None])
checks["int8 weights"] = err(torch._weight_int8pack_mm(x.to(bf), wq, wscale), wref)
if packed:
    wqp = mkldnn._reorder_linear_weight(wq.to(bf), 64)
    checks["int8 weights, packed"] = err(mkldnn._linear_pointwise(x.to(bf), wqp, None, "none", [], "").float()
                                         * wscale.float(), wref)

def best_ms(run, warm, inner, calls=1):  # the best of 5 timings of inner runs, in ms per product
    for _ in range(warm):
        run()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(inner):
            run()
        best = min(best, (time.perf_counter() - t) / inner / calls * 1e3)
    return best


ms = {}
w = torch.randn(1024, 256) / 16
for dtype, name in ((torch.float32, "fp32"), (bf, "bf16")):
    wp = mkldnn._reorder_linear_weight(w.to(dtype), 64) if packed else w.to(dtype)
    for rows in (4, 256):
        x = torch.randn(rows, 256)
        if packed:
            run = lambda: mkldnn._linear_pointwise(x.to(dtype), wp, None, "none", [], "").float()
        else:
            run = lambda: F.linear(x.to(dtype), wp).float()
        ms[f"{name} {rows}"] = best_ms(run, 10, 20)
# the int8 kinds at the same rows: dynamic int8 (int8 rows, int32 sums) and int8 weights with bf16 rows (the
# weight-only kernel at 4 rows, oneDNN's bf16 product on the int8 values at 256), each over 8 weights of 1024 x 256 in
# turn (8 MiB in fp32: a decoder step streams its weights from memory, it does not find them in a core's cache)
layers = []
for _ in range(8):
    wl = torch.randn(1024, 256) / 16
    sl = (wl.abs().amax(dim=1) / 127).to(bf)
    ql = torch.div(wl, sl.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    layers.append((ql, sl.float(), ql.t().contiguous(),
                   mkldnn._reorder_linear_weight(ql.to(bf), 64) if packed else ql.to(bf)))
ones = torch.ones(1024, dtype=bf)
for rows in (4, 256):
    x = torch.randn(rows, 256)

    def dynamic():
        for _, sl, qt, _ in layers:
            s = x.abs().amax(dim=1, keepdim=True).div_(127.0)
            torch._int_mm(torch.div(x, s).round_().to(torch.int8), qt).float().mul_(s).mul_(sl)

    def weights_only():
        for ql, sl, _, qb in layers:
            if rows <= 4:
                y = torch._weight_int8pack_mm(x.to(bf), ql, ones)
            elif packed:
                y = mkldnn._linear_pointwise(x.to(bf), qb, None, "none", [], "")
            else:
                y = F.linear(x.to(bf), qb)
            y.float().mul_(sl)

    for name, run in (("int8", dynamic), ("int8_bf16", weights_only)):
        ms[f"{name} {rows}"] = best_ms(run, 3, 5, len(layers))
print(json.dumps({"checks": checks, "ms": ms}))
"""
# The largest relative error (to the largest magnitude of the fp32 result) a check may show: bf16 keeps 8 bits of
# mantissa (about 0.4% a rounding); a broken kernel is off by far more.
MAX_ERROR = 0.05


@dataclass(frozen=True)
class CpuBf16:
    """What this machine's CPU does with bf16: ``native`` (steps 1-2 passed), ``why`` (one line), the CPU, its flags,
    and the probe's timings (ms of one product of a 1024 x 256 weight at 4 and 256 rows)."""

    native: bool
    why: str
    cpu: str
    flags: tuple[str, ...]
    ms: dict[str, float] = field(default_factory=dict)

    def speedup(self, rows: int) -> float | None:
        """bf16's measured speed over fp32's for a product of ``rows`` rows (None where not measured)."""
        fp32, bf16 = self.ms.get(f"fp32 {rows}"), self.ms.get(f"bf16 {rows}")
        return fp32 / bf16 if fp32 and bf16 else None

    def precision(self, training: bool) -> tuple[str, str]:
        """``("bf16" | "fp32", why)``: what ``--precision auto`` runs on this CPU, for training or for inference."""
        if not self.native:
            return "fp32", self.why
        batch, row = self.speedup(256), self.speedup(4)
        timing = f"bf16 products measured {batch or 0:.2f}x fp32 at 256 rows, {row or 0:.2f}x at 4"
        if batch is None or batch < MIN_BATCH_SPEEDUP:
            return "fp32", f"{self.why}, but {timing}"
        if not training and (row is None or row < MIN_ROW_SPEEDUP):
            return "fp32", f"{self.why}, but {timing} (one sentence's beam)"
        return "bf16", f"{self.why}; {timing}"

    def int8_kind(self) -> tuple[str, str]:
        """``("int8_bf16" | "int8", why)``: the linear layers' kind (:mod:`aiayn.linear`) that ``--precision int8``
        runs on this CPU: int8 weights with bf16 rows where bf16 is native and the probe measured them at least as
        fast as dynamic int8 at 4 rows (one sentence's beam) and at 256 (a batch), else dynamic int8."""
        if not self.native:
            return "int8", f"int8 weights and rows ({self.why})"
        ratios = []
        for rows in (4, 256):
            dynamic, weights = self.ms.get(f"int8 {rows}"), self.ms.get(f"int8_bf16 {rows}")
            ratios.append(dynamic / weights if dynamic and weights else None)
        timing = ", ".join(f"{r or 0:.2f}x at {rows} rows" for r, rows in zip(ratios, (4, 256)))
        if any(r is None or r < 1.0 for r in ratios):
            return "int8", f"int8 weights and rows (int8 weights with bf16 rows measured {timing})"
        return "int8_bf16", f"int8 weights with bf16 rows (measured {timing} dynamic int8's speed)"

    def describe(self) -> str:
        """The CPU and its flags, for benchmark reports and logs."""
        return f"{self.cpu} ({', '.join(self.flags) or 'none of ' + ', '.join(SHOWN_FLAGS)})"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def all_flags() -> str:
    """Every feature flag ``/proc/cpuinfo`` gives this CPU, as written there ("" where there is none)."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            return line.split(":", 1)[1].strip()
    return ""


def cpu_flags() -> tuple[str, ...]:
    """Of :data:`SHOWN_FLAGS`, those this CPU has: ``/proc/cpuinfo``'s flags, or PyTorch's checks where it has none."""
    have = set(all_flags().split())
    if have:
        return tuple(f for f in SHOWN_FLAGS if f in have)
    checks = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported", "avx512_vnni": "_is_vnni_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported"}
    return tuple(f for f, name in checks.items() if getattr(torch.cpu, name, lambda: False)())


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20)  # the first CPU's lines are at the top; a bounded read
    except OSError:
        return ""


def torch_has_native_bf16() -> bool:
    """PyTorch's own view: the CPU has AVX512-BF16 or AMX and the OS lets this process use it."""
    return any(getattr(torch.cpu, name, lambda: False)()
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def cache_key(cpu: str, flags: tuple[str, ...]) -> str:
    """The key of a probe's answer: the CPU, its flags, PyTorch, the ISA environment and the probe itself (a changed
    child asks a new question)."""
    parts = [cpu, " ".join(flags), torch.__version__, *(f"{k}={os.environ.get(k, '')}" for k in ISA_ENV),
             hashlib.sha256(CHILD_CODE.encode()).hexdigest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def run_child(code: str | None = None, timeout_s: float | None = None) -> tuple[dict | None, str]:
    """Run the probe's child (:data:`CHILD_CODE`); returns (its JSON, "") or (None, why it failed: a signal, an
    exit status, a timeout, no JSON)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    env["OMP_NUM_THREADS"] = "1"
    try:
        done = subprocess.run([sys.executable, "-c", code or CHILD_CODE], capture_output=True, text=True, env=env,
                              timeout=timeout_s or PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"did not answer within {timeout_s or PROBE_TIMEOUT_S:.0f} s"
    except OSError as e:
        return None, f"could not start ({e.strerror or e})"
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        what = " (Illegal instruction: the CPU or its hypervisor refused a bf16 instruction)" \
            if name == "SIGILL" else ""
        return None, f"died of {name}{what}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"failed with exit status {done.returncode}: {last[:200]}"
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["checks"], result["ms"]  # noqa: B018 - the two parts it must have
    except (ValueError, IndexError, KeyError, TypeError):
        return None, "printed no result"
    return result, ""


def probe(code: str | None = None) -> CpuBf16:
    """Steps 1 and 2 of the module docstring, always run (no cache): what :func:`cpu_bf16` caches."""
    cpu, flags = cpu_model(), cpu_flags()
    native_flags = [f for f in NATIVE_FLAGS if f in flags]
    if not native_flags or not torch_has_native_bf16():
        why = ("this CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)" if not native_flags else
               f"PyTorch cannot use this CPU's {', '.join(native_flags)} (the OS does not enable it)")
        return CpuBf16(False, why, cpu, flags)
    result, failure = run_child(code)
    if result is None:
        return CpuBf16(False, f"the bf16 probe's child process {failure}", cpu, flags)
    bad = {name: e for name, e in result["checks"].items() if not (isinstance(e, (int, float)) and e <= MAX_ERROR)}
    if bad:
        name, e = next(iter(bad.items()))
        return CpuBf16(False, f"bf16 gave a wrong result in the probe ({name}: relative error {e})", cpu, flags)
    ms = {k: float(v) for k, v in result["ms"].items()}
    return CpuBf16(True, f"this CPU has {', '.join(native_flags)} and passed the bf16 probe", cpu, flags, ms)


@functools.lru_cache(maxsize=1)
def cpu_bf16() -> CpuBf16:
    """This machine's :class:`CpuBf16`, from the cache or probed now (once per process, once per machine)."""
    cpu, flags = cpu_model(), cpu_flags()
    path, key = cache_dir() / CACHE_FILE, cache_key(cpu, flags)
    book = _read_cache(path)
    hit = book.get(key)
    if isinstance(hit, dict):
        try:
            return CpuBf16(bool(hit["native"]), str(hit["why"]), cpu, flags,
                           {str(k): float(v) for k, v in dict(hit.get("ms") or {}).items()})
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry: probe again
    if any(f in flags for f in NATIVE_FLAGS):
        log.debug("checking this CPU's bf16 in a child process (once per machine; the answer is kept in %s)", path)
    found = probe()
    if not found.why.startswith("the bf16 probe's child process did not answer"):  # a busy machine: try next time
        book[key] = {**asdict(found), "flags": list(found.flags), "torch": torch.__version__}
        try:
            atomic_write_json(path, book)
        except OSError:
            pass  # a read-only home: the probe runs again next time
    return found


def _read_cache(path: os.PathLike) -> dict:
    try:
        book = read_json(path, 1 << 20)
    except (OSError, ValueError):
        return {}
    return book if isinstance(book, dict) else {}


__all__ = ["CACHE_FILE", "CHILD_CODE", "ENV", "CpuBf16", "cache_key", "cpu_bf16", "cpu_flags", "cpu_model", "probe",
           "run_child", "torch_has_native_bf16"]
