"""Proofs for the GPU training engine (issue 20), on CPU: every fast path equals the plain one.

Bounded batch shapes leave loss and gradients unchanged; the one-pass loss equals the plain formula and
PyTorch's cross entropy; an update reads the device once; the model has no torch.compile graph break and
the compiled model computes what the eager one does; the CUDA choices (SDPA backends, fused Adam, NCCL
device placement, precision, GradScaler) are made where they should be. CUDA-only paths are skipped here
and measured by the GPU benchmarks (BENCHMARKS.md, "GPU (not measured yet)").
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_at_scale, side_of  # tests/ is on sys.path under pytest
from torch.utils._python_dispatch import TorchDispatchMode

from aiayn import build_model, model_config
from aiayn.config import ConfigError, load_config
from aiayn.data.batching import batch_shape, collate, padded_length, token_batches
from aiayn.data.pipeline import TranslationData
from aiayn.device import resolve_precision
from aiayn.engine import CompileCounter, attention_path, kernels, use_fused_optimizer
from aiayn.errors import DeviceError
from aiayn.train import loss as loss_module
from aiayn.train.loss import compiled_kernels, label_smoothed_cross_entropy, projected_cross_entropy
from aiayn.train.parallel import check_rank_device
from aiayn.train.plan import update_token_totals
from aiayn.train.schedule import build_optimizer
from aiayn.train.update import Update, batch_logits, compile_for_training

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(**over):
    values = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=2,
                  dropout=0.0, max_positions=64)
    values.update(over)
    return build_model(model_config("tiny", **values))


def pairs(n: int, seed: int = 0, low: int = 1, high: int = 12) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def seq() -> list[int]:
        return torch.randint(4, 40, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()

    return [seq() for _ in range(n)], [seq() for _ in range(n)]


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _ = label_smoothed_cross_entropy(batch_logits(model, batch), batch.tgt_out, 0.1, 0)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


# --- bounded shapes: padding changes nothing ---------------------------------------------------------


@pytest.mark.parametrize("path", ["explicit", "fused"])
def test_extra_padding_leaves_loss_and_gradients_unchanged(path):
    torch.manual_seed(0)
    model = tiny_model().train()
    src, tgt = pairs(6)
    plain = collate(src, tgt, list(range(6)))
    B, S = plain.src.shape
    # 3 more columns on both sides and 2 all-padding rows (their attention rows have no key at all).
    padded = collate(src, tgt, list(range(6)), shape=(B + 2, S + 3, plain.tgt_in.size(1) + 5))
    assert padded.ntokens == plain.ntokens and padded.src[B:].eq(0).all()
    with attention_path(model, path):
        l0, g0 = loss_and_grads(model, plain)
        l1, g1 = loss_and_grads(model, padded)
    assert torch.isfinite(l1) and abs(l1.item() - l0.item()) <= 1e-6 * abs(l0.item())
    for k in g0:  # padding changes the shapes, so the order of the sums
        assert_close_at_scale(g1[k], g0[k], 1e-5, k)
    assert max(g.abs().max().item() for g in g0.values()) > 1e-3  # the gradients are not all zero


def test_padded_batches_respect_the_budget_and_bound_the_shapes():
    # Lengths of at most 62 (+1 for EOS: 63), so that every example fits the largest bucket below (64); both
    # draws from one seeded generator (the target lengths once came from the global one, and the test failed alone).
    g = torch.Generator().manual_seed(1)
    src_lens = [int(x) for x in torch.randint(1, 58, (500,), generator=g)]
    tgt_lens = [max(1, s + int(d)) for s, d in zip(src_lens, torch.randint(-5, 6, (500,), generator=g))]
    assert token_batches(src_lens, tgt_lens, 512, pad_to_multiple=1) == token_batches(src_lens, tgt_lens, 512)
    # pad_to_multiple: S and T are multiples of 8 and the padded batch stays within the budget
    groups = token_batches(src_lens, tgt_lens, 512, pad_to_multiple=8)
    assert sorted(i for g in groups for i in g) == list(range(500))
    for g in groups:
        rows, S, T = batch_shape([src_lens[i] + 1 for i in g], [tgt_lens[i] + 1 for i in g], 512, 8)
        assert rows is None and S % 8 == 0 and T % 8 == 0 and len(g) * max(S, T) <= 512
    # buckets: one shape per bucket, rows = budget // L, every example fits its batch
    buckets = (16, 32, 64)
    shapes = set()
    for g in token_batches(src_lens, tgt_lens, 512, pad_to_multiple=8, buckets=buckets):
        shape = batch_shape([src_lens[i] + 1 for i in g], [tgt_lens[i] + 1 for i in g], 512, 8, buckets)
        rows, S, T = shape
        assert S == T in buckets and rows == 512 // S and len(g) <= rows
        shapes.add(shape)
    assert len(shapes) == len(buckets)
    assert [padded_length(n, 8, buckets) for n in (1, 16, 17, 64, 65, 71)] == [16, 16, 32, 64, 72, 72]


def test_translation_data_pads_as_configured(tmp_path):
    src, tgt = pairs(200, seed=2, high=40)
    sides = [side_of(tmp_path, name, seqs) for name, seqs in (("src", src), ("tgt", tgt), ("vsrc", src[:20]),
                                                               ("vtgt", tgt[:20]))]
    data = TranslationData(src=sides[0], tgt=sides[1], valid_src=sides[2], valid_tgt=sides[3], max_tokens=256, seed=1,
                           pad_to_multiple=8, buckets=(16, 32, 48))
    batches = data.epoch_batches(0)
    assert sorted(i for b in batches for i in b.indices) == list(range(200))
    assert {tuple(b.src.shape) for b in batches} <= {(16, 16), (8, 32), (5, 48)}
    for b in batches:
        assert b.src.shape == b.tgt_in.shape == b.tgt_out.shape
        assert b.ntokens == sum(len(tgt[i]) + 1 for i in b.indices) == data.plan_tokens(b.indices)
    assert {tuple(b.src.shape) for b in data.valid_batches} <= {(16, 16), (8, 32), (5, 48)}
    # the default keeps the batches every run so far was trained on (no padding beyond the longest)
    plain = TranslationData(src=sides[0], tgt=sides[1], valid_src=sides[0], valid_tgt=sides[1], max_tokens=256,
                            seed=1).epoch_batches(0)
    assert all(b.src.size(1) == max(len(src[i]) + 1 for i in b.indices) for b in plain)


def test_shape_config_keys_are_checked():
    cfg = load_config("tiny_reverse", ["data.pad_to_multiple=8", "data.length_buckets=[16, 32]",
                                       "train.compile_mode=reduce-overhead"])
    assert (cfg.data.pad_to_multiple, cfg.data.length_buckets, cfg.train.compile_mode) == (8, [16, 32],
                                                                                            "reduce-overhead")
    assert load_config("tiny_reverse", ["data.length_buckets=16"]).data.length_buckets == [16]  # one item
    for bad in ("data.pad_to_multiple=0", "data.length_buckets=[32, 16]", "data.length_buckets=[0, 16]",
                "train.compile_mode=fast"):
        with pytest.raises(ConfigError):
            load_config("tiny_reverse", [bad])


# --- the loss ------------------------------------------------------------------------------------------


def plain_label_smoothed_cross_entropy(logits, target, epsilon, ignore_index=0):
    """The formula aiayn used before the one-pass loss: full fp32 log-probabilities, gather, mean."""
    lprobs = F.log_softmax(logits.float(), dim=-1).reshape(-1, logits.size(-1))
    target = target.reshape(-1)
    keep = target != ignore_index
    nll = -lprobs.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1)
    loss = (1.0 - epsilon) * nll - epsilon * lprobs.mean(dim=-1)
    return loss[keep].sum(), nll[keep].sum().detach()


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("chunk_rows", [None, 3])  # None: one chunk; 3: several, the last one short
def test_one_pass_loss_equals_the_plain_formula_and_torch(monkeypatch, epsilon, chunk_rows):
    V = 37
    if chunk_rows:
        monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", chunk_rows * V)
    torch.manual_seed(1)
    logits = (3 * torch.randn(4, 5, V)).requires_grad_()
    target = torch.randint(1, V, (4, 5))
    target[1, 2:] = 0
    loss, nll = label_smoothed_cross_entropy(logits, target, epsilon, 0)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_loss, ref_nll = plain_label_smoothed_cross_entropy(logits, target, epsilon, 0)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    torch_loss = F.cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=0, label_smoothing=epsilon,
                                 reduction="sum")
    assert not nll.requires_grad and loss.dtype == nll.dtype == torch.float32
    for value, ref in ((loss, ref_loss), (nll, ref_nll), (loss, torch_loss)):
        assert abs(value.item() - ref.item()) <= 1e-5 * abs(ref.item())
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert grad[1, 2:].abs().max().item() == 0.0  # padding positions get no gradient


def test_loss_keeps_no_fp32_vocabulary_sized_tensor_for_backward():
    logits = torch.randn(6, 50, requires_grad=True)
    loss, _ = label_smoothed_cross_entropy(logits, torch.randint(1, 50, (6,)), 0.1)
    saved = [t for t in loss.grad_fn.saved_tensors if t.numel() >= logits.numel()]
    assert len(saved) == 1 and saved[0].data_ptr() == logits.data_ptr()  # only the logits themselves


# --- an asynchronous update ------------------------------------------------------------------------------


class _SyncOps(TorchDispatchMode):
    """Records the operators that make the host wait for the device (scalar reads, data-dependent shapes)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "is_nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(s in str(func) for s in self.SYNCING):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_forward_backward_and_update_read_the_device_once(monkeypatch):
    torch.manual_seed(2)
    model = tiny_model(dropout=0.1).train()
    src, tgt = pairs(8, seed=3)
    batches = [collate(src[:4], tgt[:4], [0, 1, 2, 3]), collate(src[4:], tgt[4:], [4, 5, 6, 7])]
    batches[0].src[1] = 0  # a source of padding only: its attention rows have nothing to attend to
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # SGD: no optimizer-internal scalar reads
    with _SyncOps() as mode:
        stats = Update(module=model, optimizer=opt, label_smoothing=0.1, clip_norm=1.0)(batches, lr=0.1)
    assert mode.seen == []  # no .item(), bool(tensor), masked_select, nonzero in forward, loss, backward, clip
    assert reads == [torch.Size([3])]  # one read: loss, nll and gradient norm together
    assert stats.ntokens == sum(b.ntokens for b in batches) and min(stats.loss, stats.nll, stats.grad_norm) > 0


def test_update_token_totals_are_what_every_process_would_all_reduce():
    tokens = [5, 7, 11, 13, 17, 19, 23, 29, 31]  # of the planned batches, in plan order
    # 2 processes, 2 micro-batches each: process 0 takes batches 0, 2, 4, 6 and process 1 takes 1, 3, 5, 7
    assert update_token_totals(tokens, 2, 2) == [5 + 11 + 7 + 13, 17 + 23 + 19 + 29]
    assert update_token_totals(tokens, 1, 1) == tokens


# --- torch.compile ----------------------------------------------------------------------------------------


def test_forward_and_loss_have_no_graph_break():
    torch.manual_seed(3)
    model = tiny_model(dropout=0.1).train()
    src, tgt = pairs(4, seed=4)
    batch = collate(src, tgt, list(range(4)), shape=(6, 16, 16))  # padded columns and all-padding rows

    def forward_and_loss(src, tgt_in, tgt_out):
        return label_smoothed_cross_entropy(model(src, tgt_in), tgt_out, 0.1, 0)

    explanation = torch._dynamo.explain(forward_and_loss)(batch.src, batch.tgt_in, batch.tgt_out)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.fixture(scope="module")
def compiled_tiny():
    """The one inductor compile of the suite's training tests (a C++ build of the kernels: ~20-60 s on a 2-core CPU):
    a 2+2-layer model compiled as ``train.compile`` does, warmed up by one update through :class:`Update` on a batch
    whose rows, source and target lengths are all 8 (so duck shaping, which would give them one symbol, is shown
    off by the later shapes). Yields (eager twin, compiled model, its module and loss, the graphs the warm-up built,
    the warm-up again). The loss's chunks are small (30 rows of the 40-word vocabulary), so the compiled loss goes
    over several chunks."""
    from aiayn.engine import CompileCounter

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_module, "CHUNK_ELEMENTS", 30 * 40)
        torch.manual_seed(4)
        cfg = load_config("tiny_reverse", ["train.compile=true", "model.dropout=0.0"])
        eager = tiny_model(n_encoder_layers=2, n_decoder_layers=2, max_positions=256)
        compiled_copy = tiny_model(n_encoder_layers=2, n_decoder_layers=2, max_positions=256)
        compiled_copy.load_state_dict(eager.state_dict())
        counter = CompileCounter()
        module, loss_fn = compile_for_training(compiled_copy, cfg)
        assert module is compiled_copy and list(module.state_dict()) == list(eager.state_dict())  # in place
        src, tgt = pairs(8, seed=6, low=7, high=8)  # 8 rows of 7 tokens + EOS / BOS: B = S = T = 8
        warm = collate(src, tgt, list(range(8)))
        assert warm.src.shape == warm.tgt_in.shape == (8, 8)
        warm_up = Update(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0), label_smoothing=0.1,
                         pad_id=0, loss_fn=loss_fn, fit_shapes=True)
        warm_up([warm], 0.0)
        # the graphs of the warm-up, counted now: a counter read later would also count what other tests compile
        # between (torch._dynamo.explain in the graph-break test builds one)
        yield eager, compiled_copy, module, loss_fn, counter.graphs, lambda: warm_up([warm], 0.0)
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_training_step_equals_eager(compiled_tiny, monkeypatch):
    """The layers compiled by regions and the compiled loss compute the eager values and gradients; the layers of a
    stack share their graph; a new batch shape reuses the graphs; eval mode (validation, decoding) runs the plain
    layers; the compiled chunks of the output projection fused into the loss compute the eager ones."""
    eager, compiled_copy, module, loss_fn, warm_graphs, rewarm = compiled_tiny
    counter = CompileCounter()
    rewarm()  # builds nothing unless dynamo was reset since the fixture ran
    counter.warmed_up()
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 30 * 40)  # several chunks and a last, shorter one
    compiled_copy.load_state_dict(eager.state_dict())
    src, tgt = pairs(5, seed=5)
    batch = collate(src, tgt, list(range(5)), shape=(6, 14, 22))  # lengths unlike any width (duck sizing)
    results = []
    for model, plain, fn in ((eager, eager, label_smoothed_cross_entropy), (module, compiled_copy, loss_fn)):
        model.zero_grad(set_to_none=True)
        loss, nll = fn(batch_logits(model, batch), batch.tgt_out, 0.1, 0)
        loss.backward()
        results.append((loss.item(), nll.item(), {k: p.grad for k, p in plain.named_parameters()}))
    (l0, n0, g0), (l1, n1, g1) = results
    assert l1 == pytest.approx(l0, rel=1e-5) and n1 == pytest.approx(n0, rel=1e-5)
    for k in g0:
        assert_close_at_scale(g1[k], g0[k], 1e-4, k)
    # the fixture's warm-up built the encoder layer, decoder layer, loss chunk forward and backward: 2 layers each
    assert warm_graphs == 4 and counter.recompiles == 0
    other = collate(src[:3], tgt[:3], [0, 1, 2], shape=(3, 22, 14))  # another batch size and lengths
    loss_fn(batch_logits(module, other), other.tgt_out, 0.1, 0)[0].backward()
    assert counter.recompiles == 0  # no recompilation for a new shape
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(batch_logits(module, other), batch_logits(eager.eval(), other))
    module.train()
    assert counter.recompiles == 0  # eval mode ran the plain layers
    # the output projection fused into the loss (train.fused_output_loss), its chunks compiled: the eager values
    hidden = batch_logits(eager.train(), batch, project=False).detach().requires_grad_()
    weight, _ = eager.decoder.output_projection()
    results = []
    for chunk_math in (None, compiled_kernels(dynamic=True)):
        loss, nll = projected_cross_entropy(hidden, weight, None, batch.tgt_out, 0.1, 0, chunk_math)
        results.append((loss.item(), nll.item(), torch.autograd.grad(loss, hidden)[0]))
    (l0, n0, g0), (l1, n1, g1) = results
    assert l1 == pytest.approx(l0, rel=1e-5) and n1 == pytest.approx(n0, rel=1e-5)
    assert_close_at_scale(g1, g0, 1e-4, "states")


@pytest.mark.slow
def test_compiled_training_never_compiles_again_after_its_first_update(compiled_tiny):
    """The shape policy (aiayn.engine): 200 updates of varied rows and lengths through :class:`Update`, one-row
    batches, targets of BOS alone and sources past the CPU's explicit-attention length (128 keys) among them, build
    no graph after the warm-up update."""
    from aiayn.engine import CompileCounter

    _, compiled_copy, module, loss_fn, _, rewarm = compiled_tiny  # warmed up by the fixture's first update
    counter = CompileCounter()
    rewarm()  # builds nothing unless dynamo was reset since the fixture ran
    counter.warmed_up()
    update = Update(module=module, optimizer=torch.optim.Adam(module.parameters(), lr=1e-3), label_smoothing=0.1,
                    pad_id=0, loss_fn=loss_fn, fit_shapes=True)
    g = torch.Generator().manual_seed(7)
    shapes = set()
    for step in range(200):
        rows = 1 if step % 50 == 3 else int(torch.randint(1, 9, (1,), generator=g))
        low, high = (130, 160) if step % 50 == 10 else (1, int(torch.randint(2, 30, (1,), generator=g)))
        src, tgt = pairs(rows, seed=100 + step, low=low, high=high)
        if step % 40 == 5:
            tgt = [[] for _ in tgt]  # targets of BOS alone: T = 1
        batch = collate(src, tgt, list(range(rows)))
        shapes.add((*batch.src.shape, batch.tgt_in.size(1)))
        update([batch], 1e-3, step + 1)
    assert len(shapes) > 150 and any(s[0] == 1 for s in shapes) and any(s[2] == 1 for s in shapes)
    assert any(s[1] > 128 for s in shapes)
    assert counter.recompiles == 0, f"{counter.recompiles} graphs after the first update"


# A process that compiles aiayn's loss (compiled_loss, as train.compile does), checks it against the eager loss
# and prints the worst relative error of the loss and the gradient (inf for a NaN).
_COMPILE_AND_COMPARE = """
import json, torch
from aiayn.train.loss import compiled_loss, label_smoothed_cross_entropy
from torch._inductor import config
g = torch.Generator().manual_seed(0)
logits = torch.randn(37, 40, generator=g, requires_grad=True)
target = torch.randint(0, 40, (37,), generator=g)
errors = []
for dynamic in (True, False):
    results = []
    for fn in (label_smoothed_cross_entropy, compiled_loss(dynamic=dynamic)):
        logits.grad = None
        loss, _ = fn(logits, target, 0.1, 0)
        loss.backward()
        results.append((loss.detach(), logits.grad.clone()))
    (l0, g0), (l1, g1) = results
    errors += [float((l1 - l0).abs() / l0.abs()), float((g1 - g0).norm() / g0.norm())]
print(json.dumps({"simdlen": config.cpp.simdlen, "worst": max(e if e == e else float("inf") for e in errors)}))
"""


@pytest.mark.slow
def test_one_inductor_cache_serves_processes_under_other_cpu_kernels_their_own_graphs(tmp_path):
    """PyTorch's on-disk FX graph cache does not key on the vector instructions inductor builds for (by the CPU and
    ATEN_CPU_CAPABILITY): a graph built under AVX-512 and replayed under AVX2 gave NaN on an AVX-512 Xeon, and
    vector code replayed under ``default`` failed to build. aiayn writes that width into inductor's config, which
    the key covers (:func:`aiayn.engine.key_cpu_kernels_by_vector_width`). Processes that share one cache
    directory, the CPU's own kernels first, then each narrower set: each computes the eager loss and gradient."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    widths = []
    for capability in (None, "avx2", "default"):  # the CPU's own (AVX-512 or AVX2), then narrower (or the same)
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        proc = subprocess.run([sys.executable, "-c", _COMPILE_AND_COMPARE], env=run_env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{capability or 'the CPU kernels'}: {proc.stderr[-2000:]}"
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["worst"] < 1e-5, (capability or "the CPU's own", got)
        widths.append(got["simdlen"])
    assert widths[0] >= widths[1] > widths[2] == 0, widths  # vectors of each width, none under default
    assert any((tmp_path / "inductor").rglob("*.so"))  # the processes did compile into the shared directory


def test_compiling_for_a_gpu_leaves_the_cpu_vector_width_unpicked(monkeypatch):
    # the pick builds a test program per instruction set with the C++ compiler: seconds in a fresh process,
    # and a compiled GPU training spent 53 s in its compile set-up on an H200 (2026-12-04, BENCHMARKS.md)
    # inductor's modules that import the pick by name (codecache, codegen.cpp_micro_gemm), loaded before the patch:
    # loaded under it, they would keep the refusal after the undo and fail every later CPU compile of this process
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.config as inductor_config
    import torch._inductor.cpu_vec_isa as vec_isa

    from aiayn import engine

    def refuse():
        raise AssertionError("picked a CPU vector width for a GPU")

    monkeypatch.setattr(vec_isa, "pick_vec_isa", refuse)
    # inductor's config through its own patch: monkeypatch would delete the key on undo (it is no plain attribute)
    with inductor_config.patch({"cpp.simdlen": None}):
        engine.key_cpu_kernels_by_vector_width(torch.device("cuda", 0))
        engine.compile_regions(torch.nn.Linear(2, 2, device="meta"), [], False, 0, "default")
        assert inductor_config.cpp.simdlen is None
        with pytest.raises(AssertionError, match="picked"):
            engine.key_cpu_kernels_by_vector_width(torch.device("cpu"))


# --- CUDA choices, checked without a GPU -------------------------------------------------------------------


def test_kernels_turn_the_cudnn_attention_backend_off_inside_the_block_only_and_only_on_cuda():
    backends = torch.backends.cuda
    flags = lambda: (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(),  # noqa: E731
                     backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled())
    before = flags()
    assert before[0]  # PyTorch's default: cuDNN attention allowed
    with kernels(torch.device("cpu")):
        assert flags() == before
    with kernels(torch.device("cuda", 0)):
        assert flags() == (False, True, True, True)
    assert flags() == before
    with pytest.raises(RuntimeError, match="boom"), kernels(torch.device("cuda", 0)):
        raise RuntimeError("boom")
    assert flags() == before  # restored on an exception too


def test_adam_is_fused_only_when_every_parameter_is_on_cuda():
    cuda = SimpleNamespace(device=torch.device("cuda", 0), is_floating_point=lambda: True)
    cpu = torch.zeros(2, requires_grad=True)
    assert use_fused_optimizer([cuda, cuda]) and not use_fused_optimizer([cuda, cpu])
    assert not use_fused_optimizer([]) and not use_fused_optimizer([cpu])
    opt = build_optimizer(tiny_model(), load_config("tiny_reverse").train)
    assert not opt.defaults.get("fused")  # CPU keeps the implementation its checkpoints were made with


def test_each_torchrun_process_trains_on_its_own_gpu():
    check_rank_device(torch.device("cuda", 1), local_rank=1, world=2)
    check_rank_device(torch.device("cpu"), local_rank=1, world=2)
    check_rank_device(torch.device("cuda", 0), local_rank=0, world=1)
    with pytest.raises(DeviceError, match="its own GPU"):
        check_rank_device(torch.device("cuda", 0), local_rank=1, world=2)


def test_precision_resolution(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_precision("auto", cpu, training=True) == "fp32"  # the suite keeps auto at fp32 (conftest)
    for p in ("tf32", "fp16"):  # bf16 on a CPU: tests/test_cpu_bf16.py (it depends on the CPU's probe)
        for training in (True, False):
            with pytest.raises(DeviceError, match="needs a CUDA device"):
                resolve_precision(p, cpu, training=training)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("tf32", cuda, training=False) == "tf32"
    assert resolve_precision("auto", cuda, training=True) == "bf16"
    assert resolve_precision("auto", cuda, training=False) == "fp32"
    assert resolve_precision("fp16", cuda, training=True) == "fp16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision("auto", cuda, training=True) == "fp32"
    with pytest.raises(DeviceError, match="does not support bfloat16"):
        resolve_precision("bf16", cuda, training=True)


def test_tf32_is_a_cuda_setting_inside_the_kernels_block_only():
    before = torch.get_float32_matmul_precision()
    with kernels(torch.device("cpu"), "tf32"):  # off CUDA: nothing changes
        assert torch.get_float32_matmul_precision() == before
    assert torch.get_float32_matmul_precision() == before


def test_validation_bleu_decodes_outside_the_training_autocast(tmp_path):
    """The one precision rule: validation loss under the training autocast, validation decoding in the inference
    precision (no autocast), so the BLEU a training logs is the BLEU of its run's translations."""
    from aiayn.data.pipeline import build_data, fit_model_to_vocab
    from aiayn.train.trainer import Trainer

    cfg = load_config("tiny_reverse", ["model.d_model=16", "model.d_ff=32", "model.n_heads=2"])
    data, tok = build_data(cfg, tmp_path)
    cfg = fit_model_to_vocab(cfg, tok)
    state = {"autocast": False, "entered": 0}
    trainer = Trainer(cfg, build_model(cfg.model, cfg.task), data, tmp_path,
                      evaluate_extra=lambda model, d: {"valid_bleu": float(state["autocast"])})

    class TrainingAutocast:  # stands for bf16 autocast, which not every CPU can run
        def __enter__(self) -> None:
            state["autocast"], state["entered"] = True, state["entered"] + 1

        def __exit__(self, *exc) -> None:
            state["autocast"] = False

    trainer.autocast = TrainingAutocast()
    records = []
    trainer._evaluate(SimpleNamespace(write=records.append))
    assert state["entered"] >= 1  # the validation loss ran under it
    assert records[-1]["valid_bleu"] == 0.0  # the decoding did not


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_grad_scaler_plumbing_equals_the_unscaled_update(fused):
    """fp16 training's GradScaler path through an Update (scale, unscale, clip, step, update), in fp32 on CPU: the
    same weights as without a scaler; fused Adam takes the scaler's inf check without a host read."""
    src, tgt = pairs(6, seed=6)
    batch = collate(src, tgt, list(range(6)))
    weights = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        torch.manual_seed(5)
        model = tiny_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9, fused=fused)
        for _ in range(2):
            Update(module=model, optimizer=opt, label_smoothing=0.1, clip_norm=1.0, scaler=scaler)([batch], lr=1e-3)
        weights.append(model.state_dict())
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=1e-5, atol=1e-6, msg=k)
    # An overflow skips the step and halves the scale.
    torch.manual_seed(5)
    model, scaler = tiny_model(), torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt = torch.optim.Adam(model.parameters(), lr=0.0, fused=fused)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.encoder.layers[0].ffn.fc1.weight[0, 0] = float("inf")
    before["encoder.layers.0.ffn.fc1.weight"][0, 0] = float("inf")
    Update(module=model, optimizer=opt, label_smoothing=0.1, scaler=scaler)([batch], lr=1e-3)
    assert scaler.get_scale() == 2.0**11
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


# --- the engine's choices: explicit, local, equal to the plain path -----------------------------------------


def test_loading_a_run_changes_no_process_wide_torch_setting(tiny_run):
    from aiayn.run.directory import load_run

    backends = torch.backends

    def settings():
        return (backends.cuda.cudnn_sdp_enabled(), backends.cuda.flash_sdp_enabled(),
                backends.cuda.mem_efficient_sdp_enabled(), backends.cuda.math_sdp_enabled(),
                backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
                torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), torch.get_default_dtype())

    before = settings()
    run = load_run(tiny_run, device="cpu")
    import aiayn

    tr = aiayn.load(tiny_run, device="cpu")
    tr.translate(["alpha bravo"], beam=2)
    assert settings() == before and run.model is not None


def test_a_prepared_model_takes_the_explicit_path_for_short_keys_and_the_fused_kernel_for_long_ones(monkeypatch):
    from aiayn.engine import prepare_model
    from aiayn.model import attention

    calls = []
    fused = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(a[1].size(-2)) or fused(*a, **k))
    model = prepare_model(tiny_model(max_positions=512), "cpu", training=False).eval()
    with torch.no_grad():
        model(torch.randint(4, 40, (1, 100)), torch.randint(4, 40, (1, 100)))  # 100 keys: explicit
        assert calls == []
        model(torch.randint(4, 40, (1, 300)), torch.randint(4, 40, (1, 20)))  # 300 source keys: fused
        assert sorted(set(calls)) == [300]  # encoder self-attention and cross-attention; the decoder's 20 not
        calls.clear()
        model.to("cpu")  # the choice is per device type and survives a move
        with attention_path(model, "fused"):
            model(torch.randint(4, 40, (1, 10)), torch.randint(4, 40, (1, 10)))
        assert calls and set(calls) == {10}
        calls.clear()
        model(torch.randint(4, 40, (1, 10)), torch.randint(4, 40, (1, 10)))
        assert calls == []  # restored


class FormerCpuDropout(torch.autograd.Function):
    """The CPU dropout the model carried before the engine owned it (frozen copy: the reference)."""

    @staticmethod
    def forward(ctx, x, p):
        scaled_mask = (torch.rand_like(x) >= p).to(x.dtype).mul_(1.0 / (1.0 - p))
        ctx.save_for_backward(scaled_mask)
        return x * scaled_mask

    @staticmethod
    def backward(ctx, grad):
        (scaled_mask,) = ctx.saved_tensors
        return grad * scaled_mask, None


def test_training_on_cpu_draws_the_former_dropout_masks():
    from aiayn.engine import CpuDropout, prepare_model

    x = torch.randn(6, 9, 16, requires_grad=True)
    torch.manual_seed(11)
    ours = CpuDropout(0.3).train()(x)
    ours.sum().backward()
    g_ours = x.grad.clone()
    x.grad = None
    torch.manual_seed(11)
    former = FormerCpuDropout.apply(x, 0.3)
    former.sum().backward()
    assert torch.equal(ours, former) and torch.equal(g_ours, x.grad)
    assert torch.equal(CpuDropout(0.3).eval()(x), x)  # eval: the identity
    model = prepare_model(tiny_model(dropout=0.1), "cpu", training=True)
    kinds = {type(m) for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert kinds == {CpuDropout}  # every dropout of a model trained on CPU
    assert {type(m) for m in tiny_model(dropout=0.1).modules() if isinstance(m, torch.nn.Dropout)} == {torch.nn.Dropout}


def test_the_empty_row_fix_up_is_computed_once_per_decoder_call(monkeypatch):
    """A query row with no key gets a zero output; finding such rows is one reduction per encoder or decoder
    call (the key-padding mask is shared by every layer), none for the causal self-attention."""
    model = tiny_model(n_decoder_layers=3).eval()
    src = torch.randint(4, 40, (2, 7))
    mask = src != 0
    memory = model.encode(src, mask)
    cache = model.new_cache()
    counts = {"any": 0}
    real_any = torch.Tensor.any

    def counted(self, *a, **k):
        counts["any"] += 1
        return real_any(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "any", counted)
    tok = torch.full((2, 1), 2)
    with torch.no_grad():
        for _ in range(4):
            model.decode(tok, memory, mask, cache)
    assert counts["any"] == 4  # one per step for 3 layers of cross-attention, none for self-attention


def test_keep_freed_memory_sets_glibc_once_and_leaves_a_tuned_allocator_alone(monkeypatch):
    import ctypes
    import sys

    from aiayn.engine import _MALLOC_ENV, keep_freed_memory

    for name in _MALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    glibc = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallopt")
    assert keep_freed_memory() is bool(glibc)  # glibc accepts both values (mallopt returns 1)
    for name in ("MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD"):  # the user's own tuning, or jemalloc / tcmalloc
        monkeypatch.setenv(name, "1")
        assert keep_freed_memory() is False
        monkeypatch.delenv(name)


def test_a_threads_cpu_count_stays_when_another_thread_sets_its_own(monkeypatch):
    """Two threads set their intra-op counts (two serve workers: 2 and 1), the second right after the first's set
    and before the first's next question: each keeps its own. PyTorch sets a thread's count from the process's last
    set at the thread's first question or parallel operation, so a count set before that was undone."""
    import threading

    from aiayn.engine import set_cpu_threads

    real_set = torch.set_num_threads
    first_set, second_set, got = threading.Event(), threading.Event(), {}

    def set_then_let_the_other_set(n):  # in the first thread: the second sets its count right after this one's
        real_set(n)
        if threading.current_thread().name == "first":
            first_set.set()
            second_set.wait(30)

    monkeypatch.setattr(torch, "set_num_threads", set_then_let_the_other_set)

    def first():
        got["first"] = set_cpu_threads(2)

    def second():
        first_set.wait(30)
        got["second"] = set_cpu_threads(1)
        second_set.set()

    threads = [threading.Thread(target=first, name="first"), threading.Thread(target=second, name="second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {"first": 2, "second": 1}
