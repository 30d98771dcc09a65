"""Every CUDA path, run for real on a GPU (``pytest -m cuda tests/test_cuda.py``); skipped where PyTorch sees none.

What the CPU suite proves with mocks, proven here on the device: training in each precision (fp32, tf32, bf16,
fp16 with its GradScaler), compiled with token-budget and with bucketed shapes, the compiled loss's chunks,
the TF32 setting's scope, decoding on CUDA against the CPU, the validation BLEU a training logs against
``aiayn evaluate``, and torchrun with NCCL. ``python -m benchmarks.gpu_check`` runs this file as one item.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import GREEDY_GAP, agree_up_to_ties, seq2seq_clear_picks  # tests/ is on sys.path under pytest

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to PyTorch")]

REPO = Path(__file__).resolve().parent.parent
# Sentences of the reverse task's own words, and words it never saw (the first one): the trained model's margins on
# them are its training's, so the tests below compare only as far as those margins allow, never demand them.
WORDS = ["alpha bravo charlie delta", "echo foxtrot golf", "hotel india juliet kilo lima",
         "mike november oscar papa quebec romeo", "sierra tango uniform", "victor whiskey xray yankee zulu",
         "delta alpha kilo echo", "papa lima golf bravo india", "the quick brown fox jumps"]
# How far a lower precision may move a logit: bf16 keeps 8 significant bits, so logits of magnitude ~10 move by a few
# hundredths; a quarter of a logit is several times that. A greedy pick whose fp32 margin over its runner-up is
# wider than this is the same in bf16 and tf32; from the first narrower one on, the outputs may part.
PRECISION_GAP = 0.25


def tiny(tmp: Path, *sets: str, updates: int = 6) -> tuple[Path, list[dict]]:
    """tiny_reverse, a 2+2-layer model, ``updates`` updates on CUDA with ``sets`` overrides; (run, metrics)."""
    from aiayn.config import load_config
    from aiayn.train.run import train

    run = tmp / "run"
    cfg = load_config("tiny_reverse", ["train.device=cuda", f"train.max_updates={updates}", "train.log_every=1",
                                       "train.eval_every=1000", "train.save_every=1000", *sets])
    train(cfg, run, progress=False)
    return run, [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_training_runs_in_each_precision(tmp_path, precision):
    _, records = tiny(tmp_path, f"train.precision={precision}", "model.dropout=0.0")
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # it learns


@pytest.mark.parametrize("buckets", [None, "[8,16]"])
def test_compiled_training_runs(tmp_path, buckets):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    sets = ["train.compile=true", "train.precision=bf16"] + ([f"data.length_buckets={buckets}"] if buckets else [])
    _, records = tiny(tmp_path, *sets, updates=8)
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


def test_compiled_loss_keeps_its_chunks_and_equals_eager(monkeypatch):
    from aiayn.train import loss as loss_module

    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 100 * 1000)  # 100 rows a chunk: 4 chunks, the last short
    torch.manual_seed(0)
    logits = (3 * torch.randn(350, 1000, device="cuda")).to(torch.bfloat16).requires_grad_()
    target = torch.randint(1, 1000, (350,), device="cuda")
    target[::7] = 0
    results = []
    for fn in (loss_module.label_smoothed_cross_entropy, loss_module.compiled_loss(dynamic=True)):
        loss, nll = fn(logits, target, 0.1, 0)
        (grad,) = torch.autograd.grad(loss, logits)
        results.append((loss.item(), nll.item(), grad.float()))
    (l0, n0, g0), (l1, n1, g1) = results
    assert l1 == pytest.approx(l0, rel=1e-5) and n1 == pytest.approx(n0, rel=1e-5)
    torch.testing.assert_close(g1, g0, rtol=2e-2, atol=1e-4)  # bf16 gradients, fp32 math in both


def test_the_projected_loss_in_bf16_is_the_plain_loss_eager_and_compiled():
    """train.fused_output_loss on the GPU: the output projection and the loss chunk by chunk under bf16 autocast (its
    chunks eager and compiled) give the plain path's loss and gradients (bf16 logits and matmuls in both)."""
    import torch.nn.functional as F

    from aiayn.train import loss as loss_module

    torch.manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", requires_grad=True)
    weight = (0.1 * torch.randn(1000, 64, device="cuda")).requires_grad_()
    target = torch.randint(1, 1000, (300,), device="cuda")
    target[::7] = 0
    results = []
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for kind in ("plain", "eager", "compiled"):
            if kind == "plain":
                loss, _ = loss_module.label_smoothed_cross_entropy(F.linear(hidden, weight), target, 0.1, 0)
            else:
                kernels = loss_module.compiled_kernels(dynamic=True) if kind == "compiled" else None
                loss, _ = loss_module.projected_cross_entropy(hidden, weight, None, target, 0.1, 0, kernels)
            results.append((loss.item(), *(g.float() for g in torch.autograd.grad(loss, (hidden, weight)))))
    (l0, h0, w0), *others = results
    for l1, h1, w1 in others:
        assert l1 == pytest.approx(l0, rel=1e-3)
        torch.testing.assert_close(h1, h0, rtol=3e-2, atol=1e-3)
        torch.testing.assert_close(w1, w0, rtol=3e-2, atol=1e-3)


def test_training_with_every_lever_runs_and_learns(tmp_path):
    _, records = tiny(tmp_path, "train.precision=bf16", "model.dropout=0.0", "train.cast_weights_once=true",
                      "train.fused_output_loss=true", "train.fuse_norms=true")
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert all(r["recompiles"] == 0 for r in records if "recompiles" in r)  # fuse_norms compiles its regions


def test_padded_attention_takes_a_fused_kernel_not_math():
    """issue 59: with aiayn's backends, attention with the padding mask (encoder self- and cross-attention) and the
    causal decoder self-attention take flash or memory-efficient attention, never the math kernel."""
    from aiayn import build_model, model_config
    from aiayn.engine import attention_backends, kernels, prepare_model

    model = build_model(model_config("paper-base", vocab_size=1000, n_encoder_layers=1, n_decoder_layers=1))
    prepare_model(model, "cuda", training=True).train()
    src, tgt = torch.randint(4, 1000, (8, 40), device="cuda"), torch.randint(4, 1000, (8, 48), device="cuda")
    src[0, 30:] = 0  # padding
    with kernels(torch.device("cuda"), "bf16"), torch.autocast("cuda", dtype=torch.bfloat16):
        found = attention_backends(model, lambda: model(src, tgt))
    assert set(found) == {"encoder self-attention", "decoder self-attention", "cross-attention"}
    assert not any("math" in v for v in found.values()), found
    assert found["decoder self-attention"] == "flash", found


def test_tf32_holds_inside_the_kernels_block_only():
    from aiayn.engine import kernels

    before = torch.get_float32_matmul_precision()
    with kernels(torch.device("cuda"), "tf32"):
        assert torch.get_float32_matmul_precision() == "high"
        with kernels(torch.device("cuda"), "fp32"):  # validation decoding inside a tf32 training: IEEE fp32
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """tiny_reverse trained to clear margins on CUDA (bf16, the default), with validation BLEU logged."""
    run, _ = tiny(tmp_path_factory.mktemp("reverse"), "model.dropout=0.0", "train.lr_scale=0.5",
                  "train.eval_bleu=true", "train.eval_every=300", "train.save_every=300",
                  "train.inference_weights=last", updates=300)
    return run


def compare_greedy_up_to_margins(reference, texts: list[str], got: list[list[int]], gap: float) -> tuple[int, int]:
    """Assert that each of ``got`` (greedy ids of another device or precision) equals ``reference``'s (the fp32
    CPU's) greedy ids for its text up to the first pick whose fp32 margin is within ``gap`` of its runner-up, the
    whole output (length included) where no pick is. (outputs compared whole, outputs compared up to a narrow pick):
    how far a trained model's margins allowed the comparison, counted, never required."""
    specials = reference.tokenizers.specials
    want = reference.translate_hypotheses(texts, beam=1)
    whole = cut = 0
    for text, hyps, ids in zip(texts, want, got, strict=True):
        ref = hyps[0].ids if hyps else []
        src = torch.tensor([reference.tokenizers.src.encode(text) + [specials.eos]])
        # EOS counted as the last pick: a cut output's "EOS pick" is no argmax (a negative margin), so only its ids
        clear = seq2seq_clear_picks(reference.model, src, ref, True, gap, specials.decoder_start, specials.eos)
        if clear > len(ref):
            assert list(ids) == list(ref), (text, gap)
            whole += 1
        else:
            assert list(ids)[:clear] == list(ref)[:clear], (text, gap, clear)
            cut += 1
    return whole, cut


def test_cuda_translation_equals_the_cpu(trained, record_property):
    """fp32 on CUDA decodes as the CPU does, beam and greedy, up to float-order ties (the CPU suite's contract across
    CPU kernels). tf32 and bf16 decode greedily as fp32 up to the first pick that their rounding may flip (a fp32
    margin within PRECISION_GAP); how many outputs were compared whole is recorded, not asserted."""
    from aiayn import load

    reference = load(trained, "cpu", "fp32")
    fp32 = load(trained, "cuda", "fp32")
    ours, theirs = (tr.translate_hypotheses(WORDS) for tr in (fp32, reference))
    agree_up_to_ties(reference, WORDS, [h[0].ids if h else [] for h in ours], [h[0].ids if h else [] for h in theirs])
    greedy = [h[0].ids if h else [] for h in fp32.translate_hypotheses(WORDS, beam=1)]
    compare_greedy_up_to_margins(reference, WORDS, greedy, GREEDY_GAP)
    for precision in ("tf32", "bf16"):
        tr = load(trained, "cuda", precision)
        got = [h[0].ids if h else [] for h in tr.translate_hypotheses(WORDS, beam=1)]
        whole, cut = compare_greedy_up_to_margins(reference, WORDS, got, PRECISION_GAP)
        record_property(f"{precision}_greedy_compared_whole", whole)
        record_property(f"{precision}_greedy_compared_up_to_a_narrow_pick", cut)
        print(f"{precision}: {whole} of {len(WORDS)} greedy outputs compared whole, {cut} up to a narrow fp32 pick")


def test_batched_equals_one_by_one_on_cuda(trained):
    from aiayn import load

    tr = load(trained, "cuda", "fp32")
    assert tr.translate(WORDS) == [tr.translate(w) for w in WORDS]


def test_cuda_graphs_decode_as_without(trained, monkeypatch):
    """``cuda_graphs``: beam search's steps replayed as one recorded CUDA graph per batch decode as the usual steps
    (fp32, up to float-order ties: attention sums over the masked positions too), and a graph is really recorded and
    replayed, with no fallback warning."""
    import warnings

    from aiayn import load

    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: (replays.append(1), replay(self))[1])
    tr = load(trained, "cuda", "fp32")
    usual = [h[0].ids if h else [] for h in tr.translate_hypotheses(WORDS)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        graphed = [h[0].ids if h else [] for h in tr.translate_hypotheses(WORDS, cuda_graphs=True)]
    assert replays, "no CUDA graph was replayed"
    agree_up_to_ties(tr, WORDS, graphed, usual)
    bf16 = load(trained, "cuda", "bf16")  # a half-precision model records and replays too
    assert len(bf16.translate_hypotheses(WORDS, cuda_graphs=True)) == len(WORDS)


def test_validation_bleu_is_the_bleu_of_aiayn_evaluate(trained):
    from aiayn.eval.evaluate import EvalData, evaluate_run

    records = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines() if x.strip()]
    logged = [r for r in records if "valid_bleu" in r][-1]["valid_bleu"]
    result = evaluate_run(trained, EvalData(split="valid"), device="cuda", beam=1)
    assert result["scores"]["bleu"] == pytest.approx(logged, abs=0.05)


def test_torchrun_trains_with_nccl(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    n = torch.cuda.device_count()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m", "aiayn",
           "train", "tiny_reverse", "--run-dir", str(tmp_path / "run"), "--no-progress", "--set", "train.device=cuda",
           "--set", "train.max_updates=6", "--set", "train.save_every=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{n} process(es)" in proc.stderr
    assert (tmp_path / "run" / "model.safetensors").exists()
