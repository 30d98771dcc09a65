"""``aiayn viz model RUN`` (issue 62): the paper's Figure 1 drawn with a run's own N, d_model, h, d_k, d_ff and
parameter count, read from its config; a language model as its decoder column alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.model import count_parameters
from aiayn.viz.model import model_diagram, positions_label, stack_labels, title

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_diagram_carries_the_runs_numbers(tiny_run, tmp_path, capsys):
    import aiayn

    d = model_diagram(tiny_run)
    cfg = aiayn.load(tiny_run, device="cpu")
    m = cfg.cfg.model
    assert (d.n_encoder, d.n_decoder, d.d_model, d.heads, d.d_ff) == (m.n_encoder_layers, m.n_decoder_layers, 32,
                                                                       2, 64)
    assert d.parameters == count_parameters(cfg.model)  # built on the meta device, counted as the real one
    assert d.src_vocab == m.vocab_size and d.d_k == 16
    assert "h = 2, d_k = 16, d_v = 16" in stack_labels(d, encoder=True)[0]
    decoder = stack_labels(d, encoder=False)
    assert decoder[0].startswith("Masked Multi-Head Attention") and "encoder-decoder" in decoder[2]
    assert "d_ff = 64" in decoder[4] and f"N = {m.n_encoder_layers} + {m.n_decoder_layers}" in title(d)
    out = tmp_path / "fig1.png"
    assert main(["viz", "model", str(tiny_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    from PIL import Image

    assert Image.open(out).size == (1000, 900)


def test_paper_base_by_default_and_a_language_model_without_cross_attention(tmp_path):
    base = model_diagram()
    assert (base.n_encoder, base.d_model, base.heads, base.d_ff) == (6, 512, 8, 2048)
    assert round(base.parameters / 1e6, 1) == 63.1  # the README's 63.1M with a shared 37k vocabulary
    lm = Path(tmp_path / "lm.yaml")
    lm.write_text("task: lm\nmodel: {d_model: 64, n_heads: 4, d_ff: 256, n_decoder_layers: 3, norm_first: true}\n"
                  "data: {dataset: tinyshakespeare, tokenizer: char}\n", encoding="utf-8")
    d = model_diagram(lm)
    assert d.n_encoder == 0 and d.norm_first
    labels = stack_labels(d, encoder=False)
    assert not any("encoder-decoder" in x for x in labels) and "Norm, then the sub-layer; Add" in labels
    assert "decoder-only language model: N = 3" in title(d) and "pre-LN" in title(d)


def test_rotary_positions_are_drawn_as_turned_queries_and_keys_not_added(tmp_path):
    lm = Path(tmp_path / "lm.yaml")
    lm.write_text("task: lm\nmodel: {d_model: 64, n_heads: 4, d_ff: 256, n_decoder_layers: 2, positional: rotary}\n"
                  "data: {dataset: tinyshakespeare, tokenizer: char}\n", encoding="utf-8")
    assert positions_label(model_diagram(lm)) == "(rotary positions: self-attention turns Q and K)"
    assert positions_label(model_diagram()) == "+ Sinusoidal Positional Encoding"


def test_a_recipe_is_drawn_with_the_vocabulary_its_training_builds():
    """First hour, point 3: a recipe's model vocabulary is only a request; training takes the tokenizer's
    (data.vocab_size pieces), so the diagram of ``multi30k_en_de_quick`` shows 8,000 tokens and the 7.58M
    parameters that recipe trains, not the 37,000-token default; a preset that sets model.vocab_size keeps it."""
    d = model_diagram("multi30k_en_de_quick")
    assert (d.src_vocab, d.tgt_vocab) == (8000, 8000) and round(d.parameters / 1e6, 2) == 7.58
    assert "7.58M parameters" in title(d)
    assert model_diagram("paper-base").src_vocab == 37000
