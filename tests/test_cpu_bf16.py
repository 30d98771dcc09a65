"""bf16 on a CPU: the probe (flags, a child process that may die of SIGILL or answer wrong, the cache), what
``--precision auto`` and ``--precision bf16`` then run, and bf16 inference and training where the CPU has it.

The probe's failures are made on any CPU (the flags and the child are stood in for); the tests that run bf16 for
real skip, with their reason, on a CPU without native bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import same_hypotheses

from aiayn import cpu_probe, device, files
from aiayn.cpu_probe import CpuBf16
from aiayn.errors import DeviceError
from aiayn.linear import Bf16Linear, Int8Bf16Linear, PackedLinear, linear_kind, quantize_rows
from aiayn.search import SearchSpec, greedy_search

CPU = torch.device("cpu")
SIGILL_CHILD = "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n"
WRONG_CHILD = ("import json\nprint(json.dumps({'checks': {'linear': 0.001, 'attention': 7.5}, "
               "'ms': {'fp32 4': 1, 'bf16 4': 1, 'fp32 256': 2, 'bf16 256': 1}}))\n")
FAST_CHILD = ("import json\nprint(json.dumps({'checks': {'linear': 0.004}, "
              "'ms': {'fp32 4': 1.0, 'bf16 4': 1.0, 'fp32 256': 3.0, 'bf16 256': 1.0, 'int8 4': 2.0, "
              "'int8_bf16 4': 1.0, 'int8 256': 3.0, 'int8_bf16 256': 1.0}}))\n")


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    """An empty probe cache of this test's own, ``AIAYN_CPU_BF16`` unset (the suite sets it off), and no answer
    remembered in this process; afterwards the process's answer is forgotten again."""
    monkeypatch.setenv(files.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_probe.ENV, raising=False)
    cpu_probe.cpu_bf16.cache_clear()
    yield tmp_path / "cache" / cpu_probe.CACHE_FILE
    cpu_probe.cpu_bf16.cache_clear()


def native_cpu(monkeypatch, child: str) -> None:
    """Make this CPU look like one with native bf16 (the flags and PyTorch's check) whose probe runs ``child``."""
    monkeypatch.setattr(cpu_probe, "cpu_flags", lambda: ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    monkeypatch.setattr(cpu_probe, "torch_has_native_bf16", lambda: True)
    monkeypatch.setattr(cpu_probe, "CHILD_CODE", child)


def test_a_probe_child_that_dies_of_sigill_means_fp32_with_one_line(fresh_probe, monkeypatch):
    native_cpu(monkeypatch, SIGILL_CHILD)
    found = cpu_probe.cpu_bf16()
    assert not found.native
    assert "died of SIGILL" in found.why and "Illegal instruction" in found.why and "\n" not in found.why
    precision, why = device.choose_precision("auto", CPU, training=True)
    assert precision == "fp32" and "SIGILL" in why
    assert device.choose_precision("auto", CPU, training=False)[0] == "fp32"
    with pytest.raises(DeviceError, match="precision bf16 on this CPU .*SIGILL.*use fp32"):
        device.resolve_precision("bf16", CPU, training=True)
    # remembered for this machine: the next process does not run the child again
    assert json.loads(fresh_probe.read_text())[cpu_probe.cache_key(cpu_probe.cpu_model(), cpu_probe.cpu_flags())][
        "native"] is False


def test_a_wrong_result_in_the_probe_means_fp32(fresh_probe, monkeypatch):
    native_cpu(monkeypatch, WRONG_CHILD)
    found = cpu_probe.cpu_bf16()
    assert not found.native and "wrong result" in found.why and "attention" in found.why
    assert device.choose_precision("auto", CPU, training=True)[0] == "fp32"


def test_no_native_flags_means_fp32_without_a_child(fresh_probe, monkeypatch):
    monkeypatch.setattr(cpu_probe, "cpu_flags", lambda: ("avx2", "avx512f"))
    monkeypatch.setattr(cpu_probe, "run_child", lambda *a, **k: pytest.fail("no child on a CPU without bf16"))
    precision, why = device.choose_precision("auto", CPU, training=True)
    assert precision == "fp32" and "no native bf16" in why
    with pytest.raises(DeviceError, match="no native bf16"):
        device.resolve_precision("bf16", CPU, training=False)


def test_a_probe_that_passes_and_measures_faster_chooses_bf16_once_per_machine(fresh_probe, monkeypatch):
    native_cpu(monkeypatch, FAST_CHILD)
    assert device.choose_precision("auto", CPU, training=True)[0] == "bf16"
    precision, why = device.choose_precision("auto", CPU, training=False)
    assert precision == "bf16" and "3.00x fp32 at 256 rows" in why
    # the answer is cached: another process (here: this one, forgetting) reads it instead of probing
    cpu_probe.cpu_bf16.cache_clear()
    monkeypatch.setattr(cpu_probe, "run_child", lambda *a, **k: pytest.fail("probed twice"))
    assert cpu_probe.cpu_bf16().native
    monkeypatch.setenv(cpu_probe.ENV, "off")  # the user's switch
    assert device.choose_precision("auto", CPU, training=True) == ("fp32", "auto: AIAYN_CPU_BF16=off")


def test_the_rule_follows_the_measurement_not_the_name():
    flags = ("avx512_bf16",)
    slow_rows = CpuBf16(True, "ok", "cpu", flags, {"fp32 4": 1.0, "bf16 4": 2.0, "fp32 256": 4.0, "bf16 256": 1.0})
    assert slow_rows.precision(training=True)[0] == "bf16"  # a training's products are big
    precision, why = slow_rows.precision(training=False)  # one sentence's beam is 4 rows: slower there
    assert precision == "fp32" and "0.50x at 4" in why
    slow = CpuBf16(True, "ok", "cpu", flags, {"fp32 4": 1.0, "bf16 4": 1.0, "fp32 256": 1.0, "bf16 256": 1.0})
    assert slow.precision(training=True)[0] == "fp32"


def test_int8_takes_bf16_rows_only_where_measured_faster_at_both_row_counts():
    flags = ("avx512_bf16",)
    fast = {"int8 4": 2.0, "int8_bf16 4": 1.0, "int8 256": 4.0, "int8_bf16 256": 1.0}
    kind, why = CpuBf16(True, "ok", "cpu", flags, fast).int8_kind()
    assert kind == "int8_bf16" and "2.00x at 4 rows, 4.00x at 256 rows" in why
    slow_batch = {**fast, "int8_bf16 256": 8.0}
    kind, why = CpuBf16(True, "ok", "cpu", flags, slow_batch).int8_kind()
    assert kind == "int8" and "0.50x at 256 rows" in why
    assert CpuBf16(True, "ok", "cpu", flags, {"fp32 4": 1.0}).int8_kind()[0] == "int8"  # not measured: dynamic
    kind, why = CpuBf16(False, "this CPU has no native bf16", "cpu", ()).int8_kind()
    assert kind == "int8" and "no native bf16" in why


def test_int8_on_a_cpu_whose_probe_passed_runs_its_measured_kind_and_says_so(fresh_probe, monkeypatch):
    native_cpu(monkeypatch, FAST_CHILD)  # its int8 timings favour bf16 rows at both row counts
    from aiayn import build_model, model_config
    from aiayn.engine import prepare_model

    precision, why = device.choose_precision("int8", CPU, training=False)
    assert precision == "int8" and "int8 weights with bf16 rows" in why and "\n" not in why
    model = build_model(model_config("tiny", vocab_size=50, dropout=0.0)).eval()
    assert linear_kind(prepare_model(model, CPU, training=False, precision="int8")) == "int8_bf16"
    monkeypatch.setenv(cpu_probe.ENV, "off")  # the user's switch keeps dynamic int8
    assert linear_kind(prepare_model(model, CPU, training=False, precision="int8")) == "int8"
    assert "AIAYN_CPU_BF16=off" in device.choose_precision("int8", CPU, training=False)[1]


def test_a_child_that_hangs_is_fp32_and_not_remembered(fresh_probe, monkeypatch):
    native_cpu(monkeypatch, "import time\ntime.sleep(60)\n")
    monkeypatch.setattr(cpu_probe, "PROBE_TIMEOUT_S", 1.0)
    found = cpu_probe.cpu_bf16()
    assert not found.native and "did not answer" in found.why
    assert not fresh_probe.exists()  # a busy machine: probed again next time


def test_a_damaged_cache_is_probed_again(fresh_probe, monkeypatch):
    native_cpu(monkeypatch, FAST_CHILD)
    fresh_probe.parent.mkdir(parents=True)
    fresh_probe.write_text("[" * 100_000)  # not a dict, too deep for json: read as empty
    assert cpu_probe.cpu_bf16().native


def test_the_cli_refuses_bf16_on_a_cpu_whose_probe_failed_in_one_line(fresh_probe, tiny_run, tmp_path):
    key = cpu_probe.cache_key(cpu_probe.cpu_model(), cpu_probe.cpu_flags())
    fresh_probe.parent.mkdir(parents=True)
    fresh_probe.write_text(json.dumps({key: {"native": False, "why": "the bf16 probe's child process died of "
                                             "SIGILL (Illegal instruction)", "ms": {}}}))
    src = tmp_path / "in.txt"
    src.write_text("a b c\n")
    out = tmp_path / "out.txt"
    env = {**os.environ, files.CACHE_DIR_ENV: str(fresh_probe.parent)}
    done = subprocess.run([sys.executable, "-m", "aiayn", "translate", str(tiny_run), "--input", str(src),
                           "--output", str(out), "--precision", "bf16"], capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "SIGILL" in lines[0] and "use fp32" in lines[0], done.stderr
    assert not out.exists()


# --- bf16 for real: on a CPU with native bf16 only ----------------------------------------------------------------

def _native() -> CpuBf16:
    return cpu_probe.cpu_bf16()


needs_bf16 = pytest.mark.skipif("not _native().native", reason="this CPU has no native bf16 that passed the probe "
                                "(aiayn.cpu_probe): bf16 would be emulated or could die of SIGILL")


def padded_ids(loaded, sources: list[str]) -> tuple[torch.Tensor, SearchSpec]:
    """A loaded run's sources as padded ids (EOS appended) and its decoding spec."""
    specials = loaded.tokenizers.specials
    ids = [loaded.tokenizers.src.encode(s) + [specials.eos] for s in sources]
    width = max(map(len, ids))
    return (torch.tensor([i + [specials.pad] * (width - len(i)) for i in ids]),
            SearchSpec(loaded.cfg.decode, specials))


@needs_bf16
def test_bf16_products_are_fp32_products_of_bf16_rounded_operands():
    torch.manual_seed(0)
    kernel, packed = Bf16Linear(), PackedLinear()
    for rows in (1, 4, 13, 64, 300):
        x, w, b = torch.randn(rows, 256), torch.randn(512, 256) / 16, torch.randn(512)
        with torch.inference_mode():
            y = kernel(x, w, b)
            ref = F.linear(x.bfloat16().double(), w.bfloat16().double()).float() + b  # exact sums of rounded inputs
        assert y.dtype == torch.float32 and y.shape == (rows, 512)
        # the result is rounded through bf16 once (8 bits of mantissa), then the fp32 bias is added
        assert (y - ref).abs().max() <= 2 ** -7 * (ref - b).abs().max() + 1e-6, rows
        # each row alone equals the same row in the batch (a sentence's result does not depend on its batch)
        if rows > 1:
            with torch.inference_mode():
                alone = torch.cat([kernel(x[i : i + 1], w, b) for i in range(rows)])
            assert (alone - y).abs().max() <= 2 ** -7 * y.abs().max(), rows
        assert packed(x, w, b).dtype == torch.float32  # the fp32 path is untouched


@needs_bf16
def test_bf16_decoding_batched_equals_alone_and_stays_near_fp32(tiny_run):
    from aiayn import load
    from aiayn.data.synthetic import reverse_split

    sources = [s for s, _ in reverse_split("test")[:24]]
    bf16, fp32 = load(tiny_run, precision="bf16"), load(tiny_run, precision="fp32")
    assert bf16.run.precision == "bf16" and next(bf16.model.parameters()).dtype == torch.float32
    batched = bf16.translate_hypotheses(sources)
    swaps = 0
    for text, hyps in zip(sources, batched):
        [alone] = bf16.translate_hypotheses([text])
        swaps += same_hypotheses([(h.ids, h.score) for h in hyps[:1]], [(h.ids, h.score) for h in alone[:1]], text)
    assert swaps <= 1
    # cached = uncached in bf16 too
    src, spec = padded_ids(bf16, sources[:8])
    with torch.inference_mode():
        assert greedy_search(bf16.model, src, spec=spec) == greedy_search(bf16.model, src, spec=spec, use_cache=False)
    # not a copy of fp32 (the products really ran in bf16), yet close to it on most sentences
    scores = [(a[0].score, b[0].score) for a, b in zip(batched, fp32.translate_hypotheses(sources)) if a and b]
    assert any(x != y for x, y in scores)


@needs_bf16
def test_training_in_bf16_on_the_cpu_logs_its_precision_and_report_shows_it(tmp_path, monkeypatch):
    from tiny_recipe import TINY_RUN_OVERRIDES

    from aiayn.config import load_config
    from aiayn.train.report import format_report, run_report
    from aiayn.train.run import train

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(repo, "configs", "tiny_reverse.yaml"),
                      [*TINY_RUN_OVERRIDES, "train.max_updates=20", "train.eval_every=20", "train.save_every=20"])
    assert cfg.train.precision == "auto"
    monkeypatch.delenv(cpu_probe.ENV, raising=False)  # auto as a user's: the probe's answer decides
    train(cfg, tmp_path / "run", progress=False)
    rep = run_report(tmp_path / "run")
    assert rep["precision"]["precision"] == "bf16" and rep["precision"]["why"].startswith("auto: ")
    assert "precision    bf16 (auto: " in format_report(rep)


@needs_bf16
def test_int8_bf16_products_are_int8_weights_times_bf16_rows():
    """Up to SMALL_ROWS rows PyTorch's weight-only kernel, more rows oneDNN's bf16 product: both are the sums of
    bf16-rounded rows times the int8 weights (exact products, fp32 sums), rounded to bf16, then times the row scales
    plus the bias in fp32; a row alone and in a batch (another kernel) agree but where two sums added in another
    order round apart. A width that is not a multiple of 16 never takes the small kernel."""
    torch.manual_seed(0)
    kernel = Int8Bf16Linear()
    for width in (256, 48, 50):
        w, b = torch.randn(512, width) / 16, torch.randn(512)
        q, scale = quantize_rows(w)
        for rows in (1, 4, 5, 13, 300):
            x = torch.randn(rows, width)
            with torch.inference_mode():
                y = kernel(x, w, b)
            sums = x.bfloat16().double() @ q.double().t()  # exact
            ref = torch.addcmul(b, sums.float().bfloat16().float(), scale)  # the rounding the kernel documents
            assert y.dtype == torch.float32 and y.shape == (rows, 512)
            assert (y == ref).float().mean() >= 0.99, (width, rows)
            assert ((y - ref).abs() <= 2 ** -7 * (ref - b).abs() + 1e-6).all(), (width, rows)  # else one bf16 step
            if rows > 1:
                with torch.inference_mode():
                    alone = torch.cat([kernel(x[i: i + 1], w, b) for i in range(rows)])
                assert (alone == y).float().mean() >= 0.99, (width, rows)


@needs_bf16
def test_int8_bf16_decoding_batched_equals_alone_up_to_near_ties_and_stays_near_fp32(tiny_run, monkeypatch):
    from aiayn import load
    from aiayn.data.synthetic import reverse_split

    monkeypatch.delenv(cpu_probe.ENV, raising=False)  # int8's kind as a user's machine chooses it
    cpu_probe.cpu_bf16.cache_clear()
    if device.int8_kind()[0] != "int8_bf16":
        pytest.skip(f"this CPU's probe keeps dynamic int8: {device.int8_kind()[1]}")
    sources = [s for s, _ in reverse_split("test")[:24]]
    int8, fp32 = load(tiny_run, precision="int8"), load(tiny_run, precision="fp32")
    assert linear_kind(int8.model) == "int8_bf16"
    batched = int8.translate_hypotheses(sources)
    swaps = 0
    for text, hyps in zip(sources, batched):
        [alone] = int8.translate_hypotheses([text])
        # a sentence's logits alone and in the batch come from two kernels whose sums may round one bf16 step apart
        # (2^-8 of a value, where fp32 paths differ by 2^-23): its summed score moves by up to ~2^-8 of itself
        assert hyps[0].score == pytest.approx(alone[0].score, rel=2 ** -8), text
        swaps += list(hyps[0].ids) != list(alone[0].ids)
    assert swaps <= 1
    # cached (one row per sentence a step: the weight-only kernel) = uncached (every position at once: oneDNN's)
    src, spec = padded_ids(int8, sources[:8])
    with torch.inference_mode():
        assert greedy_search(int8.model, src[:1], spec=spec) == greedy_search(int8.model, src[:1], spec=spec,
                                                                              use_cache=False)
        assert greedy_search(int8.model, src, spec=spec) == greedy_search(int8.model, src, spec=spec, use_cache=False)
    scores = [(a[0].score, b[0].score) for a, b in zip(batched, fp32.translate_hypotheses(sources)) if a and b]
    assert any(x != y for x, y in scores)  # the products really ran in int8
