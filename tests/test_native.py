"""The native beam search (aiayn.search.native) computes what the Python search computes.

Each comparison runs :func:`aiayn.search.beam.beam_search`'s Python loop (``AIAYN_NATIVE``-free: the search called
with the native module switched off for the call) against the native loop on the same random model and sources:
the same hypotheses, scores within float rounding (sums in another order can swap near-ties, which random models
with spread-out logits do not have). Products: fp32 and bf16 (rows and weights) against a float64 reference; int8
against :class:`aiayn.linear.Int8Linear`, whose integer arithmetic the VNNI kernel repeats (elsewhere: int8 weights,
fp32 rows).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.engine import set_cpu_threads
from aiayn.linear import Int8Linear, quantize_rows, use_linear
from aiayn.model.transformer import Transformer
from aiayn.search import beam, native
from aiayn.search.spec import SearchSpec, SearchStopped

# skipped where the module cannot be built (no compiler, no ninja, AIAYN_NATIVE=off); a build that fails runs (and
# fails) every test: a compile error in native.cpp must not pass as a skip
_WHY = None if native.module() is not None else native.why_not() or ""
pytestmark = pytest.mark.skipif(_WHY is not None and not _WHY.startswith("the native search did not build"),
                                reason=f"no native search here: {_WHY}")


def model_of(**overrides) -> Transformer:
    torch.manual_seed(0)
    base = dict(vocab_size=61, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                max_positions=64)
    model = Transformer(ModelConfig(**{**base, **overrides})).eval()
    with torch.no_grad():  # spread the logits out: no near-ties for the two sums' orders to break differently
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def sources(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (n,), generator=g)
    src = torch.zeros(n, int(lengths.max()), dtype=torch.long)
    for i, k in enumerate(lengths.tolist()):
        src[i, :k] = torch.randint(4, 61, (k,), generator=g)
        src[i, k - 1] = 3  # EOS
    return src, src != 0


def python_search(model, src, mask, spec, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(native, "chosen", lambda *a: False)
        return beam.beam_search(model, src, mask, spec)


def same(a, b, tol=1e-4) -> None:
    assert len(a) == len(b)
    for ha, hb in zip(a, b):
        assert [h.tokens for h in ha] == [h.tokens for h in hb]
        for x, y in zip(ha, hb):
            assert x.score == pytest.approx(y.score, rel=tol, abs=tol)
            assert x.logprob == pytest.approx(y.logprob, rel=tol, abs=tol)


@pytest.mark.parametrize("model_kw, options", [
    ({}, dict(beam=4)),
    ({"norm_first": True, "activation": "gelu"}, dict(beam=3, nbest=3, length_penalty="power", alpha=1.0)),
    ({"positional": "learned", "activation": "swish", "d_k": 4, "d_v": 12}, dict(beam=4, stop="hf", min_len=3)),
    ({"tie_output": False, "output_bias": True}, dict(beam=2, stop="first", length_penalty="none", ban_pad=True)),
    ({}, dict(beam=5, nbest=2, max_len_a=0.0, max_len_b=4)),  # every sentence at its limit
    ({"share_embeddings": False, "tie_output": False, "tgt_vocab_size": 47}, dict(beam=3)),  # a target vocabulary
    # over 100 steps: every step's keys and values read through the beams' ancestors
    ({"max_positions": 200}, dict(beam=3, max_len_a=0.0, max_len_b=150, min_len=100)),
    # heads of 32 and 16 dimensions: 16 keys' dot products summed at once (on AVX-512)
    ({"d_model": 64, "n_heads": 2, "d_ff": 96}, dict(beam=4, max_len_a=0.0, max_len_b=40, min_len=20)),
    ({"d_model": 64, "n_heads": 4, "d_ff": 96}, dict(beam=3)),
])
def test_native_search_equals_python(model_kw, options, monkeypatch):
    model = model_of(**model_kw)
    spec = SearchSpec.of(**options)
    for n in (1, 3):
        src, mask = sources(n, seed=n)
        assert native.chosen(model, src, mask, spec)
        same(native.beam_search(model, src, mask, spec), python_search(model, src, mask, spec, monkeypatch))


def test_batch_of_one_equals_batch(monkeypatch):
    """Each sentence alone gives what it gives among others (the rows of a batch never meet)."""
    model, spec = model_of(), SearchSpec.of(beam=4, nbest=2)
    src, mask = sources(4, seed=7)
    together = native.beam_search(model, src, mask, spec)
    for i in range(4):
        k = int(mask[i].sum())
        same(native.beam_search(model, src[i: i + 1, :k], mask[i: i + 1, :k], spec), [together[i]], tol=1e-5)


def test_exact_ties_put_the_lower_id_first(monkeypatch):
    """Output rows 10, 11 and 12 the same (weights and bias) and among the best: their logits are equal at every step,
    and the native search ranks hypotheses that differ only there lower id first (the vectorized top-k looks at a
    vector only where a lane beats the k-th so far; the pools keep an equal score after those already there). The
    Python search's scores, rank for rank, are the same up to float rounding (which of the tied hypotheses it keeps
    can differ: their sums are equal only in exact arithmetic)."""
    model, spec = model_of(tie_output=False, output_bias=True), SearchSpec.of(beam=4, nbest=4)
    with torch.no_grad():
        weight, bias = model.decoder.output_projection()
        weight[11:13] = weight[10]
        bias[10:13] = bias[10] + 4.0
    src, mask = sources(4, seed=5)
    got, ref = native.beam_search(model, src, mask, spec), python_search(model, src, mask, spec, monkeypatch)
    tied = 0
    for hyps, theirs in zip(got, ref):
        assert [h.score for h in hyps] == pytest.approx([h.score for h in theirs], rel=1e-4)
        for a, b in zip(hyps, hyps[1:]):
            if a.score == b.score and a.tokens[:-1] == b.tokens[:-1]:
                assert a.tokens[-1] < b.tokens[-1]
                tied += 1
    assert tied  # the construction does make ties


def test_many_sentences_on_one_or_two_threads(monkeypatch):
    """A batch of 40 sentences (160 rows: the products' rows in many groups, the columns split between threads) finds
    the Python search's hypotheses, and the same bits on one thread as on two (each value summed by one thread)."""
    model, spec = model_of(d_model=64, n_heads=2, d_ff=96), SearchSpec.of(beam=4, nbest=2)
    src, mask = sources(40, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.beam_search(model, src, mask, spec)
        torch.set_num_threads(2)
        two = native.beam_search(model, src, mask, spec)
    finally:
        torch.set_num_threads(threads)
    same(one, two, tol=0)
    same(one, python_search(model, src, mask, spec, monkeypatch))


def test_groups_of_sentences_find_the_same_bits(monkeypatch):
    """Sentences split into groups, each searched by one thread: the same hypotheses and scores, to the bit, as one
    group on one or two threads, for any split (more groups than threads or sentences too); and the Python search's."""
    model, spec = model_of(d_model=64, n_heads=2, d_ff=96), SearchSpec.of(beam=4, nbest=2)
    src, mask = sources(9, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        one = native.beam_search(model, src, mask, spec, groups=1)
        for groups in (0, 2, 3, 9, 20):
            same(native.beam_search(model, src, mask, spec, groups=groups), one, tol=0)
        torch.set_num_threads(1)
        same(native.beam_search(model, src, mask, spec, groups=2), one, tol=0)
    finally:
        torch.set_num_threads(threads)
    same(one, python_search(model, src, mask, spec, monkeypatch))


def test_an_empty_batch_finds_nothing():
    results, stopped = native.decoder(model_of()).search([], [], [], [4, 1, 0, 0, 1, 2, 0], 0.6, [], None)
    assert results == [] and stopped is False


def test_group_count():
    """T groups where each of T threads gets two sentences and 8 rows (sentences x beam), else one."""
    count = native.module().group_count
    assert count(8, 4, 2) == 2 and count(4, 4, 2) == 2 and count(3, 4, 2) == 1 and count(1, 4, 2) == 1
    assert count(8, 1, 2) == 1 and count(16, 1, 2) == 2  # beam 1: a sentence is one row
    assert count(100, 4, 1) == 1 and count(64, 4, 16) == 16 and count(16, 4, 16) == 1


def test_stop_callback_in_groups_runs_on_the_callers_thread():
    """In groups, ``stop`` is asked on the caller's thread only (a server's cancel check reads that thread's call) and
    ends every group; an exception it raises reaches the caller."""
    model = model_of()
    src, mask = sources(6)
    asked = []

    def stop() -> bool:
        asked.append(threading.get_ident())
        return len(asked) > 2

    def fails() -> bool:
        raise ValueError("the stop check failed")

    spec = SearchSpec.of(beam=4, max_len_a=0.0, max_len_b=30)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(SearchStopped):
            native.beam_search(model, src, mask, dataclasses.replace(spec, stop=stop), groups=2)
        with pytest.raises(ValueError, match="the stop check failed"):
            native.beam_search(model, src, mask, dataclasses.replace(spec, stop=fails), groups=2)
    finally:
        torch.set_num_threads(threads)
    assert len(asked) >= 3 and set(asked) == {threading.get_ident()}


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_native_precisions_equal_python(kind, monkeypatch):
    """The model's products in bf16 or int8 (``use_linear``): the native search finds the Python search's hypotheses.
    int8 on a VNNI CPU does the same integer sums (scores within float rounding; elsewhere int8 weights and fp32 rows);
    bf16 rounds rows and weights as the Python kernel, which also rounds its sums (scores within bf16's rounding)."""
    model, spec = model_of(), SearchSpec.of(beam=4)
    src, mask = sources(3, seed=3)
    use_linear(model, kind)
    got, ref = native.beam_search(model, src, mask, spec), python_search(model, src, mask, spec, monkeypatch)
    assert [s[0].tokens for s in got] == [s[0].tokens for s in ref]
    for a, b in zip(got, ref):
        # int8: a last-bit change upstream (another CPU's rounding) can move a row across a quantization step
        assert a[0].score == pytest.approx(b[0].score, rel=3e-2 if kind == "bf16" else 1e-2, abs=1e-3)


@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("rows, n, k", [(1, 37, 50), (4, 96, 64), (3, 16, 1024), (6, 130, 33), (37, 200, 256)])
def test_native_products(kind, rows, n, k):
    torch.manual_seed(rows + n)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    got = native.module().Linear(w, b, kind)(x)
    if kind == 2 and native.module().vnni:  # dynamic int8: Int8Linear's integer sums
        torch.testing.assert_close(got, Int8Linear()(x, w, b), rtol=1e-5, atol=1e-4)
        return
    if kind == 2:  # int8 weights, fp32 rows
        q, scale = quantize_rows(w)
        w = q.double() * scale.double()[:, None]
    if kind == 1:  # bf16 weights and rows, fp32 sums
        w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    ref = (x.double() @ w.double().t() + b.double()).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


def test_stop_callback_ends_the_search():
    model = model_of()
    src, mask = sources(1)
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 2

    spec = dataclasses.replace(SearchSpec.of(beam=4, max_len_a=0.0, max_len_b=30), stop=stop)
    with pytest.raises(SearchStopped):
        beam.beam_search(model, src, mask, spec)
    assert len(calls) == 3


def test_what_the_native_search_leaves_to_python():
    spec = SearchSpec.of(beam=4)
    src, mask = sources(2)
    assert native.unsupported(model_of(positional="rotary"), spec, torch.device("cpu")) is not None
    assert native.unsupported(model_of(), SearchSpec.of(beam=4, no_repeat_ngram=2), torch.device("cpu")) is not None
    assert native.unsupported(model_of().train(), spec, torch.device("cpu")) == "the model is in training mode"
    many = torch.full((300, 3), 5)  # any number of sentences
    assert native.chosen(model_of(), many, many != 0, spec)
    left_padded = torch.tensor([[0, 5, 6], [4, 5, 6]])
    assert not native.chosen(model_of(), left_padded, left_padded != 0, spec)
    assert native.chosen(model_of(), src, mask, spec)
    # ids the model cannot read: the PyTorch search, whose error says so (the native loop checks no index)
    for bad in (torch.tensor([[5, 61, 3]]), torch.tensor([[5, -1, 3]]), torch.full((1, 65), 5)):
        assert not native.chosen(model_of(), bad, bad != 0, spec)
        with pytest.raises((IndexError, ValueError, RuntimeError)):
            beam.beam_search(model_of(), bad, bad != 0, spec)


@pytest.fixture(scope="module")
def narrow():
    """The module built for AVX2 without AVX-512 (x86-64-v3: 8-float vectors, no VNNI, no bf16 unit), whose paths a
    CPU with AVX-512 never takes; skipped off x86-64."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the narrower build is x86-64's")
    return native.build("x86-64-v3")


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_narrow_build_products(narrow, kind):
    """fp32, bf16 rows and weights, int8 weights with fp32 rows (no VNNI here) against float64."""
    assert not narrow.vnni and not narrow.dpbf16
    torch.manual_seed(kind)
    w, b, x = torch.randn(70, 36), torch.randn(70), torch.randn(5, 36)
    if kind == 1:
        ref = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().t()
    elif kind == 2:
        q, scale = quantize_rows(w)
        ref = x.double() @ (q.double() * scale.double()[:, None]).t()
    else:
        ref = x.double() @ w.double().t()
    torch.testing.assert_close(narrow.Linear(w, b, kind)(x), (ref + b.double()).float(), rtol=1e-5, atol=1e-4)


def test_narrow_build_search_equals_python(narrow, monkeypatch):
    model, spec = model_of(norm_first=True), SearchSpec.of(beam=4, nbest=2)
    src, mask = sources(3, seed=5)
    ref = python_search(model, src, mask, spec, monkeypatch)
    monkeypatch.setattr(native, "_module", narrow)
    monkeypatch.setattr(native, "_decoders", weakref.WeakKeyDictionary())
    same(native.beam_search(model, src, mask, spec), ref)


_HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)")
_LOAD = "from aiayn.search import native; m = native.build(); print('loaded', m.vnni in (True, False))"


def _hold(lock: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def _load_in_child(native_dir: Path) -> str:
    env = {**os.environ, native.DIR_ENV: str(native_dir), "PYTHONPATH": str(Path(native.__file__).parents[2])}
    done = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_no_lock_left_by_a_killed_process_stalls_a_load(tmp_path):
    """A process killed while it held the build lock, and torch's own lock file left behind (every loading process
    took it before, and a server killed as it loaded the module hung every later one): the next process builds or
    loads at once. A finished build is loaded without any lock: a live process holding the build lock stalls no
    load."""
    key = native.build_key()
    built = Path(os.environ[native.DIR_ENV]) / key
    shutil.copytree(built, tmp_path / key, ignore=shutil.ignore_patterns("built", "build.lock", "lock"))
    (tmp_path / key / "lock").write_text("")  # torch's build lock, as a killed process left it
    holder = _hold(tmp_path / key / "build.lock")
    holder.kill()
    holder.wait()
    assert _load_in_child(tmp_path) == "loaded True\n"
    assert (tmp_path / key / "built").exists() and not (tmp_path / key / "lock").exists()
    holder = _hold(tmp_path / key / "build.lock")  # alive this time: a finished build does not wait on it
    try:
        assert _load_in_child(tmp_path) == "loaded True\n"
    finally:
        holder.kill()
        holder.wait()
    (tmp_path / key / "aiayn_native_beam.so").unlink()  # the marker stays, the library is gone: built again
    assert _load_in_child(tmp_path) == "loaded True\n" and (tmp_path / key / "aiayn_native_beam.so").exists()


def test_a_search_runs_on_its_threads_count_when_another_thread_set_another():
    """A thread that set one CPU thread runs its first native search on one, though another thread set two since:
    at::parallel_for's first call on a thread (the module's own copy of ATen's lazy init) had set the thread's count
    to the one last set anywhere (a server's one-thread worker grew an OpenMP team, and GNU OpenMP's waiting threads
    then slept at every parallel operation of every multi-threaded search); the module's loops are its own now."""
    model, spec = model_of(), SearchSpec.of(beam=4)
    src, mask = sources(2)
    ready, set_two = threading.Event(), threading.Event()
    seen = []

    def worker():
        set_cpu_threads(1)  # asked, then set: PyTorch's own first question is behind it
        ready.set()
        set_two.wait(60)
        native.beam_search(model, src, mask, dataclasses.replace(
            spec, stop=lambda: seen.append(torch.get_num_threads()) and False))
        return torch.get_num_threads()

    threads = torch.get_num_threads()
    try:
        t = threading.Thread(target=lambda: seen.append(("after", worker())))
        t.start()
        ready.wait(60)
        torch.set_num_threads(2)  # the count last set anywhere
        set_two.set()
        t.join(120)
    finally:
        torch.set_num_threads(threads)
    assert seen[-1] == ("after", 1) and set(seen[:-1]) == {1}

