"""The linear layers' kernels (aiayn.linear): oneDNN's prepacked fp32 equals PyTorch's, int8 stays close to fp32
and independent of the batch, each falls back to PyTorch's where it must, and int8 is refused where it cannot run.

The search's own contracts (batched = alone, cached = uncached) run under every kernel in tests/test_search.py
(its ``tiny_mt`` fixture)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_at_scale, spec_of  # tests/ is on sys.path under pytest
from torch import nn

from aiayn import build_model, model_config
from aiayn.device import resolve_precision
from aiayn.engine import prepare_model
from aiayn.errors import DeviceError
from aiayn.linear import (
    INT8_MAX_WIDTH,
    Int8Linear,
    PackedLinear,
    check_int8,
    linear_kind,
    packed_available,
    quantize_rows,
    row_bucket,
    use_linear,
)
from aiayn.search import beam_search

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(model_config("tiny", vocab_size=50, dropout=0.0, output_bias=True)).eval()


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 50, (6, 9), generator=g), torch.randint(4, 50, (6, 7), generator=g)


def logits(model: nn.Module, kind: str, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    use_linear(model, kind)
    with torch.no_grad():
        return model(src, tgt)


def test_inference_on_a_cpu_takes_onednn_and_int8_where_asked():
    assert linear_kind(tiny()) == "plain"  # a model as built: PyTorch's own
    expected = "packed" if packed_available() else "plain"
    assert linear_kind(prepare_model(tiny(), "cpu", training=False)) == expected
    assert linear_kind(prepare_model(tiny(), "cpu", training=False, precision="int8")) == "int8"
    assert linear_kind(prepare_model(tiny(), "cpu", training=True)) == "plain"


@pytest.mark.skipif(not packed_available(), reason="this PyTorch has no oneDNN")
def test_packed_equals_plain_and_rows_do_not_depend_on_the_batch():
    model, (src, tgt) = tiny(), batch()
    plain, packed = logits(model, "plain", src, tgt), logits(model, "packed", src, tgt)
    assert_close_at_scale(packed, plain, 1e-5, "oneDNN vs PyTorch")  # the same fp32 math, summed in another order
    with torch.no_grad():
        alone = torch.cat([model(src[i: i + 1], tgt[i: i + 1]) for i in range(len(src))])
    assert_close_at_scale(alone, packed, 1e-5, "alone vs batched")


def test_int8_is_close_to_fp32():
    """Dynamic int8 moves a logit by ~2% of the logits' scale on these random models (seeds 0-4: 1.6% to 2.0%);
    a wrong scale, transposed weight or lost bias moves them by the whole scale."""
    for seed in range(3):
        model, (src, tgt) = tiny(seed), batch(seed)
        fp32, int8 = logits(model, "plain", src, tgt), logits(model, "int8", src, tgt)
        assert_close_at_scale(int8, fp32, 0.06, f"int8 vs fp32 (seed {seed})")
        assert (int8.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8


def test_int8_rows_are_exactly_independent_of_the_batch():
    """Each row is quantized with its own scale and the products are integer sums: a row's result is the same
    bits alone as in any batch (which fp32's kernels do not promise)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(7, 3, 40), torch.randn(24, 40), torch.randn(24)
    x[2, 1] = 0.0  # a row of zeros: scale tiny, no division by zero
    kernel = Int8Linear()
    with torch.no_grad():
        whole = kernel(x, w, b)
        rows = torch.stack([kernel(x[i], w, b) for i in range(len(x))])
    assert torch.equal(whole, rows)
    assert torch.equal(whole[2, 1], b)
    q, scale = quantize_rows(w)
    # The result is fixed bit for bit by its definition (so it is the same on every CPU): exact integer sums (int64
    # here), each converted to fp32, times the row's scale, times the weight row's scale, plus the bias.
    x2 = x.reshape(-1, 40)
    x_scale = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127.0
    xq = torch.div(x2, x_scale).round().to(torch.int8)
    sums = (xq.long() @ q.long().t()).to(torch.float32)
    assert torch.equal(whole.reshape(-1, 24), sums * x_scale * scale + b)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert_close_at_scale(q.float() * scale[:, None], w, 0.5 / 127, "w ~ q * scale")


def test_kernels_fall_back_where_autograd_records_and_off_fp32():
    """Training (or any gradient through the model) takes F.linear, so gradients equal PyTorch's exactly."""
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True), torch.randn(8)
    for kernel in (PackedLinear(), Int8Linear()):
        out = kernel(x, w, b)
        assert torch.equal(out, F.linear(x, w, b))
        (gx,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(gx, torch.autograd.grad(F.linear(x, w, b).sum(), x)[0])
        with torch.no_grad():
            assert torch.equal(kernel(x.double(), w.double(), b.double()), F.linear(x.double(), w.double(),
                                                                                    b.double()))
        assert len(kernel.prepared) == 0  # nothing was prepared for these calls


def test_prepared_weights_follow_in_place_changes_and_copies():
    model, (src, tgt) = tiny(), batch()
    before = logits(model, "int8", src, tgt)
    with torch.no_grad():
        model.decoder.layers[0].ffn.fc1.weight.mul_(2.0)  # as load_weights would: in place
        after = model(src, tgt)
    assert not torch.equal(before, after)
    use_linear(model, "plain")
    fp32 = logits(model, "plain", src, tgt)
    use_linear(model, "int8")
    with torch.no_grad():
        assert_close_at_scale(model(src, tgt), fp32, 0.06, "int8 after the change")
        twin = copy.deepcopy(model)  # its own weights: prepared anew
        assert len(twin.decoder.linear.prepared) == 0
        assert torch.equal(twin(src, tgt), model(src, tgt))


def test_int8_is_refused_where_it_cannot_run():
    with pytest.raises(DeviceError, match="CPU only"):
        resolve_precision("int8", torch.device("cuda"), training=False)
    with pytest.raises(DeviceError, match="CPU only"):
        resolve_precision("int8", torch.device("mps"), training=False)
    with pytest.raises(DeviceError, match="inference"):
        resolve_precision("int8", torch.device("cpu"), training=True)
    assert resolve_precision("int8", torch.device("cpu"), training=False) == "int8"
    assert resolve_precision("auto", torch.device("cpu"), training=False) == "fp32"  # never chosen for you
    wide = nn.Sequential(nn.Linear(INT8_MAX_WIDTH + 1, 1))
    with pytest.raises(DeviceError, match="overflow"):
        check_int8(wide)
    check_int8(nn.Sequential(nn.Linear(INT8_MAX_WIDTH, 1)))  # the widest that int32 sums hold


def test_cli_translates_in_int8(tiny_run):
    run = [sys.executable, "-m", "aiayn", "translate", str(tiny_run), "--precision", "int8", "--device", "cpu"]
    done = subprocess.run(run, input="a b c\n\nd e\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split("\n")) == 4 and done.stdout.split("\n")[1] == ""  # 3 lines, the empty one kept


def test_a_run_is_refused_int8_on_a_gpu_before_anything_is_read(tiny_run, monkeypatch):
    from aiayn.run.directory import load_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as far as the checks can tell
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceError, match="precision int8 runs on the CPU only"):
        load_run(tiny_run, "cuda", precision="int8")


def test_int8_beam_search_batched_equals_alone_up_to_quantization():
    """int8's products are exact and row by row, but the fp32 parts between them (attention over padded keys)
    sum in another order batched than alone, and a last-bit change can move an activation across an int8
    rounding boundary: a logit then moves by ~1e-3 of its scale, not 1e-6. So batched and alone agree here on
    the best hypothesis of most sentences (all of them on this machine's kernels), with scores within 1e-2,
    not fp32's 1e-4 (tests/test_search.py holds fp32's kernels to that)."""
    model = tiny(1)
    with torch.no_grad():
        model.decoder.output_bias[3] = 3.0  # a random model rarely ends; this one ends at varied lengths
    use_linear(model, "int8")
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 16, (16,), generator=g)
    src = torch.zeros(16, int(lengths.max()), dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        src[i, :n] = torch.randint(4, 50, (n,), generator=g)
    spec = spec_of(beam=4, alpha=0.6, length_penalty="power", max_len_a=1.0, max_len_b=5)
    batched = beam_search(model, src, spec=spec)
    assert len({len(h[0].tokens) for h in batched}) > 3  # varied lengths: some end early
    same = 0
    for i, n in enumerate(lengths.tolist()):
        alone = beam_search(model, src[i: i + 1, :n], spec=spec)[0][0]
        if alone.tokens == batched[i][0].tokens:
            same += 1
            assert alone.score == pytest.approx(batched[i][0].score, rel=1e-2)
    assert same >= 0.75 * len(batched)


def test_row_buckets_are_few_and_tight():
    """oneDNN keeps a kernel per row count: padding to row_bucket bounds their number, at little cost."""
    buckets = [row_bucket(m) for m in range(1, 4097)]
    assert all(b >= m for m, b in zip(range(1, 4097), buckets))
    assert all(b - m < 8 or (b - m) * 16 <= m for m, b in zip(range(1, 4097), buckets))  # <= 1/16 from 128 on
    assert len(set(buckets)) <= 128 and buckets == sorted(buckets)
    assert row_bucket(4) == 4 and row_bucket(64) == 64 and row_bucket(65) == 72 and row_bucket(257) == 272


@pytest.mark.skipif(not packed_available(), reason="this PyTorch has no oneDNN")
def test_packed_pads_rows_without_changing_them():
    torch.manual_seed(0)
    w, b = torch.randn(40, 24), torch.randn(40)
    kernel = PackedLinear()
    with torch.no_grad():
        for rows in (1, 7, 8, 9, 130):  # F.linear below 8 rows for a small weight, padded to 16 and 136 after
            x = torch.randn(rows, 2, 24)
            assert_close_at_scale(kernel(x, w, b), F.linear(x, w, b), 1e-5, rows)
            assert kernel(x, w, b).shape == (rows, 2, 40)
