"""The benchmark scripts in benchmarks/ run (seconds-long ``--smoke`` versions) and report what they
promise; their pieces that carry correctness (the interleaved -> concat re-layout, the peer models
being the same model, the FLOP formula) are checked exactly. The real numbers are not measured here:
see benchmarks/README.md. Nothing is written to the repository's BENCHMARKS.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ is not an installed package

pytest.importorskip("transformers")
pytest.importorskip("ctranslate2")

from aiayn.config import ModelConfig  # noqa: E402
from aiayn.interop.marian import concat_layout_copy  # noqa: E402
from aiayn.model.transformer import Transformer  # noqa: E402
from benchmarks import common, mfu, run_all, train_throughput  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_run_all_smoke_writes_every_section_and_json(tmp_path):
    md, jdir = tmp_path / "BENCHMARKS.md", tmp_path / "results"
    md.write_text("# Benchmarks\n\nkept text\n", encoding="utf-8")
    results = run_all.main(["--smoke", "--threads", "1", "--no-isolate", "--md", str(md), "--json-dir", str(jdir)])

    text = md.read_text(encoding="utf-8")
    assert "kept text" in text
    for name in ("train_throughput", "translate_speed", "mfu"):
        assert f"<!-- BEGIN {name} -->" in text and f"<!-- END {name} -->" in text
        on_disk = json.loads((jdir / f"{name}.json").read_text())
        assert on_disk["benchmark"] == name and on_disk["machine"]["torch"] == torch.__version__
        assert f"python -m benchmarks.{name} " in on_disk["command"]
    assert text.index("BEGIN train_throughput") < text.index("BEGIN translate_speed") < text.index("BEGIN mfu")
    assert "Date:" in text and "Versions:" in text and "goal >=" in text

    train = results["train_throughput"]["configs"][0]
    assert set(train["results"]) == {"aiayn", "hf-marian", "torch-nn"}
    for r in train["results"].values():
        assert _positive(r["tokens_per_s"]) and r["timed_steps"] == 2 and r["warmup_steps"] == 1
    # the three are one model: same initial weights, same logits
    assert all(d < 1e-4 for d in train["logit_diff"].values())

    modes = results["translate_speed"]["modes"]
    assert set(modes) == {"batch-1", "batched"}
    for res in modes.values():
        assert list(res) == ["aiayn", "aiayn-exact", "hf", "ct2-fp32", "ct2-int8"]
        for r in res.values():
            assert _positive(r["sentences_per_s"]) and _positive(r["tokens_per_s"]) and r["sentences"] == 8
            assert 0 <= r["bleu"] <= 100
        # aiayn (stop=hf) and Hugging Face generate() agree token for token
        assert res["hf"]["same_as_aiayn"] == 8
    assert results["translate_speed"]["checks"]["hf_max_logit_diff"] < 1e-4

    m = results["mfu"]
    assert _positive(m["peak"]["flops_per_s"])
    c = m["configs"][0]
    assert 0 < c["mfu"] < 1.5 and _positive(c["model_flops_per_update"])
    assert c["counted_over_executed"] == pytest.approx(1.0, abs=1e-9)  # formula == torch's own count


def test_train_throughput_isolated_worker_measures_memory(tmp_path):
    out = tmp_path / "t.json"
    result = train_throughput.main(["--smoke", "--threads", "1", "--impls", "aiayn", "--md", str(tmp_path / "B.md"),
                                    "--out-json", str(out)])
    r = result["configs"][0]["results"]["aiayn"]
    assert _positive(r["peak_rss_mib"]) and r["peak_rss_mib"] >= r["rss_before_model_mib"]
    assert json.loads(out.read_text())["args"]["isolate"] is True


@torch.no_grad()
def test_concat_layout_copy_computes_the_same_function():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1, n_decoder_layers=2,
                      dropout=0.0, max_positions=32, norm_first=True, tie_output=False, output_bias=True)
    model = Transformer(cfg).eval()
    for p in model.parameters():
        p.add_(0.1 * torch.randn_like(p))
    copy = concat_layout_copy(model)
    assert copy.cfg.positional_layout == "concat"
    src, tgt = torch.randint(4, 40, (3, 7)), torch.randint(4, 40, (3, 5))
    src[0, 5:] = 0
    assert common.max_logit_diff(model, copy, src, tgt) < 1e-5
    # the permutation matters: the same weights under the other layout compute something else
    plain = Transformer(copy.cfg).eval()
    plain.load_state_dict(model.state_dict())
    assert common.max_logit_diff(model, plain, src, tgt) > 1e-2


@torch.no_grad()
def test_torch_nn_transformer_is_the_paper_model():
    cfg = train_throughput.bench_config("smoke", dropout=0.0)
    ours = train_throughput.build_impl("aiayn", cfg).eval()
    for p in ours.parameters():
        p.add_(0.1 * torch.randn_like(p))
    theirs = train_throughput.TorchNNTransformer.from_aiayn(ours).eval()
    src, tgt = torch.randint(4, cfg.vocab_size, (2, 9)), torch.randint(4, cfg.vocab_size, (2, 6))
    src[1, 6:] = 0
    assert common.max_logit_diff(ours, theirs.train(), src, tgt) < 1e-5  # training path (no fast path)


def test_flop_formula_counts_the_padded_batch():
    cfg = train_throughput.bench_config("smoke")
    batch = common.training_batches(common.synthetic_token_pairs(30, cfg.vocab_size), 128, 1)[0]
    real = mfu.batch_training_flops(cfg, batch)
    padded = mfu.batch_training_flops(cfg, batch, padded=True)
    assert 0 < real <= padded
    B, S = batch.src.shape
    assert padded == 3 * B * mfu.sentence_forward_flops(cfg, S, batch.tgt_in.size(1))


def test_update_section_replaces_only_its_own_block(tmp_path):
    md = tmp_path / "B.md"
    common.update_section(md, "mfu", "## mfu v1")
    common.update_section(md, "train_throughput", "## train v1")
    common.update_section(md, "mfu", "## mfu v2")
    text = md.read_text()
    assert text.startswith(common.MD_HEADER.split("\n")[0]) and "No GPU was lent" in text
    assert "mfu v1" not in text and text.index("train v1") < text.index("mfu v2")
