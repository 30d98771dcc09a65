"""The training's speed levers (aiayn.train.update.Levers, aiayn.engine), each proven to compute what the plain update
computes: the output projection fused into the loss equals the plain loss in values and gradients and keeps no
logits-sized tensor; the weights cast once reach the fp32 weights' gradients; every lever, alone and together,
leaves a few updates of training unchanged in fp32; the config keys reach the update; a compiling training logs its
graphs and recompiles; which attention backend each kind of attention takes is reported. (The shape policy's
200-update recompile test and the compiled step against eager are in tests/test_engine.py, beside the suite's one
inductor compile.)
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_at_scale  # tests/ is on sys.path under pytest

import aiayn.engine as engine
from aiayn import build_model, model_config
from aiayn.config import ConfigError, load_config
from aiayn.data.batching import collate
from aiayn.train import loss as loss_module
from aiayn.train.loss import label_smoothed_cross_entropy, projected_cross_entropy
from aiayn.train.parallel import Dist
from aiayn.train.update import Levers, Update, batch_logits, training_module

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(**over):
    values = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=2,
                  dropout=0.0, max_positions=64)
    values.update(over)
    return build_model(model_config("tiny", **values))


def batches(n: int, rows: int = 5, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)

    def seqs() -> list[list[int]]:
        return [torch.randint(4, 40, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
                for _ in range(rows)]

    return [collate(seqs(), seqs(), list(range(rows))) for _ in range(n)]


# --- the output projection fused into the loss --------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("chunk_rows", [None, 4])  # None: one chunk; 4: several of balanced sizes
@pytest.mark.parametrize("with_bias", [False, True])
def test_projected_loss_equals_the_plain_loss_in_values_and_gradients(monkeypatch, epsilon, chunk_rows, with_bias):
    V, D = 37, 8
    if chunk_rows:
        monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", chunk_rows * V)
    torch.manual_seed(1)
    hidden = torch.randn(4, 5, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    bias = torch.randn(V, requires_grad=True) if with_bias else None
    target = torch.randint(1, V, (4, 5))
    target[1, 2:] = 0
    leaves = [hidden, weight] + ([bias] if with_bias else [])
    results = []
    for fused in (False, True):
        if fused:
            loss, nll = projected_cross_entropy(hidden, weight, bias, target, epsilon, 0)
        else:
            loss, nll = label_smoothed_cross_entropy(F.linear(hidden, weight, bias), target, epsilon, 0)
        grads = torch.autograd.grad(2.5 * loss, leaves)  # a scaled loss, as the update's 1 / tokens
        results.append((loss, nll, grads))
    (l0, n0, g0), (l1, n1, g1) = results
    assert not n1.requires_grad and l1.dtype == n1.dtype == torch.float32
    assert l1.item() == pytest.approx(l0.item(), rel=1e-5) and n1.item() == pytest.approx(n0.item(), rel=1e-5)
    for got, want, name in zip(g1, g0, ("hidden", "weight", "bias")):
        assert got.dtype == want.dtype
        assert_close_at_scale(got, want, 1e-5, name)
    assert g1[0][1, 2:].abs().max().item() == 0.0  # padding positions get no gradient


def test_projected_loss_keeps_no_logits_sized_tensor_and_under_no_grad_computes_the_loss_alone(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 3 * 50)
    hidden, weight = torch.randn(9, 4, requires_grad=True), torch.randn(50, 4, requires_grad=True)
    target = torch.randint(1, 50, (9,))
    loss, _ = projected_cross_entropy(hidden, weight, None, target, 0.1)
    saved = loss.grad_fn.saved_tensors
    assert sorted(t.shape for t in saved) == [(9, 4), (50, 4)]  # the two gradients, no (9, 50) tensor
    with torch.no_grad():
        no_grad, _ = projected_cross_entropy(hidden, weight, None, target, 0.1)
    assert no_grad.item() == pytest.approx(loss.item(), rel=1e-6)


def test_chunks_are_balanced_so_that_none_has_one_row(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 4 * 10)
    for n in range(2, 60):
        sizes = [s.stop - s.start for s in loss_module._chunks(n, 10, torch.device("cpu"))]
        assert sum(sizes) == n and max(sizes) <= 4 and min(sizes) >= 2 and max(sizes) - min(sizes) <= 1, (n, sizes)


def test_a_cpu_chunk_of_fp32_temporaries_stays_below_the_mmap_threshold():
    """On a CPU an fp32 (C, V) temporary of the loss stays below glibc's largest mmap threshold, so the allocator
    keeps its blocks between updates (engine.keep_freed_memory) instead of mapping fresh, page-faulting ones; off
    the CPU (another allocator) the chunks stay as big as CHUNK_ELEMENTS allows. The quick recipe's 4,000-token
    batch and 8,000 words: one chunk of 130 MB before, 5 of 26 MB now."""
    N, V = 4080, 8000
    cpu = loss_module._chunks(N, V, torch.device("cpu"))
    assert len(cpu) == 5 and all(4 * (s.stop - s.start) * V < engine.HEAP_BLOCK_MAX for s in cpu)
    assert sum(s.stop - s.start for s in cpu) == N
    assert loss_module._chunks(N, V, torch.device("meta")) == [slice(0, N)]


# --- the weights cast once --------------------------------------------------------------------------------------


def test_weights_in_casts_each_tensor_once_and_restores_the_originals():
    model = tiny_model()
    before = {k: p for k, p in model.named_parameters(remove_duplicate=False)}
    with engine.weights_in(model, torch.float64):
        assert model.encoder.embed.weight.dtype == torch.float64
        assert model.decoder.output_proj.weight is model.encoder.embed.weight  # the tied embedding: one cast
        assert model.decoder.positions.table.dtype == torch.float64  # buffers too: the stream stays in the dtype
        logits = batch_logits(model, batches(1)[0])
    assert logits.dtype == torch.float64
    after = {k: p for k, p in model.named_parameters(remove_duplicate=False)}
    assert all(after[k] is before[k] for k in before)  # the very Parameters, tied as before
    logits.sum().backward()
    assert model.encoder.embed.weight.grad.dtype == torch.float32  # through the casts into the fp32 weights
    with pytest.raises(RuntimeError), engine.weights_in(model, torch.float64):
        raise RuntimeError("inside")
    assert model.encoder.embed.weight is before["encoder.embed.weight"]


# --- every lever leaves training unchanged (fp32) ----------------------------------------------------------------


def train_with(levers: Levers, model: torch.nn.Module, steps: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A few SGD updates of ``model`` (a copy) through the trainer's own wiring of ``levers``; losses and weights.
    (SGD, not Adam: Adam's first steps move every weight by about the learning rate whatever the gradient's size, so
    a key bias, whose true gradient is 0 (a softmax ignores a shift), would move by +-lr on rounding noise.)"""
    model = copy.deepcopy(model)
    cfg = load_config("tiny_reverse", ["model.dropout=0.0"])
    module, fields = training_module(model, cfg, Dist(), levers)
    module.train()
    update = Update(module=module, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), label_smoothing=0.1, pad_id=0,
                    **fields)
    losses = [update([b], 0.5, i + 1).loss for i, b in enumerate(steps)]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("lever", ["fused_output_loss", "cast_once", "fuse_norms", "all"])
def test_each_lever_leaves_training_unchanged_in_fp32(monkeypatch, lever):
    """Four updates with each lever against the plain update, from the same weights on the same batches (dropout 0):
    the same losses and weights within float rounding. The compiled levers (``all`` has compile) run dynamo's graphs
    eagerly here (the wiring and dynamo's capture without inductor's C++ build, seconds instead of a minute: the
    inductor compile against eager is tests/test_engine.py's); the weights are cast once to float64 (the mechanism
    bf16 uses on a GPU, in a dtype every CPU has)."""
    monkeypatch.setattr(engine, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 7 * 40)  # several chunks
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = tiny_model()
    steps = batches(4, seed=3)
    every = {"fused_output_loss": True, "cast_dtype": torch.float64, "fuse_norms": True, "compile": True}
    chosen = {"cast_once": {"cast_dtype": torch.float64}, "all": every}.get(lever, {lever: True})
    plain_losses, plain = train_with(Levers(), model, steps)
    losses, weights = train_with(Levers(**chosen), model, steps)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for k in plain:
        assert_close_at_scale(weights[k], plain[k], 1e-5, k)
    torch._dynamo.reset()


# --- the config keys reach the update ----------------------------------------------------------------------------


def test_the_lever_keys_reach_the_levers_and_compile_auto_compiles_long_cuda_runs_only():
    keys = ["train.cast_weights_once=true", "train.fused_output_loss=true", "train.fuse_norms=true",
            "train.attention_backends=[cudnn,flash]", "train.max_updates=10000"]
    cfg = load_config("tiny_reverse", keys)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cfg.train.compile == "auto"
    levers = Levers.from_config(cfg, cuda, "bf16")
    assert levers == Levers(compile=True, cast_dtype=torch.bfloat16, fused_output_loss=True, fuse_norms=True,
                            attention_backends=("cudnn", "flash"))
    assert Levers.from_config(cfg, cpu, "fp32").cast_dtype is None and not Levers.from_config(cfg, cpu, "fp32").compile
    assert not engine.compile_wanted("auto", cuda, engine.COMPILE_AUTO_MIN_UPDATES - 1)
    assert engine.compile_wanted("auto", cuda, engine.COMPILE_AUTO_MIN_UPDATES)
    assert engine.compile_wanted(True, cpu, 1) and not engine.compile_wanted(False, cuda, 10**6)
    assert not engine.compile_wanted("auto", cuda, 10**6, max_minutes=5)  # a short time budget: eager at once
    assert load_config("tiny_reverse", ["train.compile=false"]).train.compile is False
    for bad in ("train.compile=sometimes", "train.attention_backends=[flash,flash]", "train.attention_backends=[xla]"):
        with pytest.raises(ConfigError):
            load_config("tiny_reverse", [bad])


def test_a_compiling_training_logs_its_graphs_and_recompiles(tmp_path, monkeypatch, caplog):
    """``aiayn train``'s loop with ``train.fuse_norms`` (a compiled region; dynamo's graph run eagerly here): every
    logged line says the graphs built and the recompiles after the first update (none: the shape policy)."""
    from aiayn.train.run import train

    monkeypatch.setattr(engine, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    cfg = load_config("tiny_reverse", ["model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.dropout=0.1",
                                       "train.max_updates=6", "train.log_every=2", "train.eval_every=1000",
                                       "train.save_every=1000", "train.fuse_norms=true", "train.threads=1",
                                       "data.max_tokens=256", "data.vocab_size=300"])
    with caplog.at_level("INFO", logger="aiayn.train"):
        train(cfg, tmp_path / "run", progress=False)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train_loss" in r]
    assert len(logged) == 3 and all(r["graphs"] >= 1 and r["recompiles"] == 0 for r in logged)
    assert "speed levers: output projection fused into the loss, fused residual + layer norm" in caplog.text
    torch._dynamo.reset()


# --- which attention backend runs --------------------------------------------------------------------------------


def test_attention_backends_names_the_computation_of_each_kind_of_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = tiny_model().train()
    batch = batches(1)[0]

    def report() -> dict[str, str]:
        return engine.attention_backends(model, lambda: batch_logits(model, batch))

    kinds = {"encoder self-attention", "decoder self-attention", "cross-attention"}
    with engine.attention_path(model, "explicit"):
        assert report() == dict.fromkeys(kinds, "explicit")
    with engine.attention_path(model, "fused"):
        assert report() == dict.fromkeys(kinds, "flash (CPU)")  # padding mask and causal alike on a CPU
        with sdpa_kernel([SDPBackend.MATH]):
            assert report() == dict.fromkeys(kinds, "math")
        assert report() == dict.fromkeys(kinds, "flash (CPU)")  # the spy left nothing behind
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # its hooks are gone


def test_the_cpu_levers_are_on_by_default_where_a_cpu_trains():
    """train.cast_weights_once = auto: on for bf16 on a CPU (measured faster there); fused_output_loss = auto: on a
    CPU in any precision (measured faster in bf16 and in fp32); both off on a GPU (not measured there yet); an
    explicit true / false wins."""
    cfg = load_config("tiny_reverse")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cfg.train.cast_weights_once == "auto" and cfg.train.fused_output_loss == "auto"
    on = Levers.from_config(cfg, cpu, "bf16")
    assert on.cast_dtype == torch.bfloat16 and on.fused_output_loss
    fp32 = Levers.from_config(cfg, cpu, "fp32")
    assert fp32.cast_dtype is None and fp32.fused_output_loss
    for dev, precision in ((cuda, "bf16"), (cuda, "fp32")):
        off = Levers.from_config(cfg, dev, precision)
        assert off.cast_dtype is None and not off.fused_output_loss, (dev, precision)
    cfg = load_config("tiny_reverse", ["train.cast_weights_once=false", "train.fused_output_loss=false"])
    assert Levers.from_config(cfg, cpu, "bf16") == Levers()
    with pytest.raises(ConfigError, match="train.fused_output_loss='sometimes': expected true, false or auto"):
        load_config("tiny_reverse", ["train.fused_output_loss=sometimes"])
