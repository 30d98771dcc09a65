"""Figures (aiayn viz): the data behind each figure, and that each command writes a PNG of the asked size."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import spec_of  # noqa: E402  (tests/ is on sys.path under pytest)
from PIL import Image  # noqa: E402

from aiayn.cli import main  # noqa: E402
from aiayn.config import ConfigError, load_config  # noqa: E402
from aiayn.data.corpus import DataError  # noqa: E402
from aiayn.model.embeddings import sinusoidal_table  # noqa: E402
from aiayn.viz.attention import attention_data, output_paths, select  # noqa: E402
from aiayn.viz.curves import curves_data  # noqa: E402
from aiayn.viz.mask import causal_mask_matrix, masked_softmax  # noqa: E402
from aiayn.viz.positional import ENCODINGS, positional_views  # noqa: E402
from aiayn.viz.schedule import schedule_data  # noqa: E402

SRC = "alpha bravo charlie"


def png_size(path) -> tuple[int, int]:
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as im:
        assert im.format == "PNG"
        return im.size


# Positional encodings ----------------------------------------------------------------------------------


def test_sinusoidal_similarity_is_symmetric_and_depends_on_offset_only():
    m, sim = positional_views("sinusoidal", 64, 50)
    assert m.shape == (50, 64) and sim.shape == (50, 50)
    np.testing.assert_allclose(m, sinusoidal_table(50, 64).double().numpy(), atol=1e-6)
    np.testing.assert_allclose(sim, sim.T, atol=1e-9)
    for k in (1, 7, 20):  # S[i, j] == S[i + k, j + k]: a function of i - j, and by symmetry of |i - j|
        np.testing.assert_allclose(sim[:-k, :-k], sim[k:, k:], atol=1e-4)
    np.testing.assert_allclose(np.diag(sim), 32.0, atol=1e-4)  # |PE_i|^2 = D/2 (sin^2 + cos^2 per pair)


def test_rejected_encodings_are_what_the_figure_says():
    P, D = 32, 16
    views = {k: positional_views(k, D, P) for k in ENCODINGS}
    idx, norm, binary = views["index"][0], views["normalized"][0], views["binary"][0]
    np.testing.assert_array_equal(idx[:, 0], np.arange(P))
    assert idx.shape == (P, D) and (idx == idx[:, :1]).all()
    assert norm.min() == 0.0 and norm.max() == 1.0
    assert binary.shape == (P, math.ceil(math.log2(P))) and set(np.unique(binary)) == {-1.0, 1.0}
    assert len({tuple(r) for r in binary}) == P  # every position has its own code
    bits = (binary[:, ::-1] > 0).astype(int)  # most significant bit first
    assert [int("".join(map(str, r)), 2) for r in bits] == list(range(P))
    for kind in ("index", "normalized", "binary"):  # none of them is shift-invariant
        sim = views[kind][1]
        np.testing.assert_allclose(sim, sim.T)
        assert not np.allclose(sim[:-1, :-1], sim[1:, 1:])


def test_positional_rejects_bad_sizes():
    with pytest.raises(ConfigError):
        positional_views("sinusoidal", 7, 10)
    with pytest.raises(ConfigError):
        positional_views("rope", 8, 10)


# Mask ----------------------------------------------------------------------------------------------------


def test_causal_mask_is_zero_on_and_below_the_diagonal_and_minus_inf_above():
    m = causal_mask_matrix(6)
    assert m.shape == (6, 6)
    assert (m[np.tril_indices(6)] == 0).all()
    assert np.isneginf(m[np.triu_indices(6, k=1)]).all()
    w = masked_softmax(m)
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    np.testing.assert_allclose(np.diag(w), 1.0 / np.arange(1, 7))
    assert causal_mask_matrix(1).tolist() == [[0.0]]


# Schedule ------------------------------------------------------------------------------------------------


def test_schedule_peaks_at_warmup():
    (paper,) = schedule_data()
    assert "512" in paper.label and "4000" in paper.label
    assert paper.peak_step == 4000
    assert paper.peak_lr == pytest.approx(512**-0.5 * 4000**-0.5)
    assert paper.steps[-1] == 20000 and (np.diff(paper.steps) > 0).all()
    mine, ref = schedule_data(d_model=256, warmup=1000)
    assert mine.peak_step == 1000 and mine.peak_lr == pytest.approx(256**-0.5 * 1000**-0.5)
    assert ref.peak_step == 4000


@pytest.mark.parametrize("argv, message", [
    (["schedule", "--warmup", "0"], "train.warmup=0: must be >= 1"),  # was the paper's warmup 4000, drawn
    (["schedule", "--d-model", "0"], "--d-model must be at least 1, got 0"),  # was the paper's 512
    (["schedule", "--d-model", "-4"], "--d-model must be at least 1, got -4"),  # was drawn from complex rates
    (["positional", "--d-model", "0"], "--d-model must be even and positive, got 0"),  # was 512
])
def test_a_zero_or_negative_width_or_warmup_is_refused_not_replaced_by_the_papers(argv, message, tmp_path, capsys):
    out = tmp_path / "f.png"
    assert main(["viz", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_a_figure_never_writes_over_a_file_that_is_not_a_png(tmp_path, capsys):
    # --out RUN/config.yaml replaced the run's config with a PNG: the run no longer loaded
    out = tmp_path / "config.yaml"
    out.write_text("kept\n")
    assert main(["viz", "schedule", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists and is not a PNG" in err[0], err
    assert out.read_text() == "kept\n"
    png = tmp_path / "old.png"
    png.write_bytes(b"old")  # named .png, but not one (issue 70): the content decides
    assert main(["viz", "schedule", "--out", str(png)]) == 2 and png.read_bytes() == b"old"
    png.write_bytes(b"\x89PNG\r\n\x1a\nold")
    assert main(["viz", "schedule", "--out", str(png)]) == 0 and png.read_bytes()[:4] == b"\x89PNG"  # replaced


def test_schedule_of_a_preset_and_of_a_run(tiny_run):
    big, paper = schedule_data("paper-big")
    assert big.label.startswith("paper-big") and big.peak_lr == pytest.approx(1024**-0.5 * 4000**-0.5)
    assert paper.peak_lr > big.peak_lr
    cfg = load_config(tiny_run / "config.yaml")
    run_curve = schedule_data(tiny_run)[0]
    assert run_curve.peak_step == cfg.train.warmup
    assert run_curve.steps[-1] == cfg.train.max_updates  # shorter than 20000: the run's own length
    assert schedule_data(tiny_run, warmup=10)[0].peak_step == 10
    with pytest.raises(ConfigError):
        schedule_data("no-such-preset")


# Curves --------------------------------------------------------------------------------------------------


def test_curves_from_a_run(tiny_run):
    c = curves_data(tiny_run)
    assert {"train_loss", "train_nll", "valid_loss", "valid_nll", "lr"} <= set(c)
    assert "valid_bleu" not in c
    assert (np.diff(c["train_loss"].steps) > 0).all() and len(c["train_loss"]) >= 5
    assert len(c["valid_loss"]) >= 2 and c["valid_loss"].values[-1] < c["valid_loss"].values[0]


def test_curves_resumed_steps_bleu_and_torn_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    recs = [{"step": 10, "lr": 1e-4, "train_loss": 5.0, "train_nll": 4.8},
            {"step": 20, "lr": 2e-4, "train_loss": 4.0, "train_nll": 3.8},
            {"step": 20, "valid_loss": 4.1, "valid_nll": 3.9, "valid_bleu": 1.5},
            {"step": 20, "lr": 2e-4, "train_loss": 3.9, "train_nll": 3.7}]  # resumed: step 20 again
    p.write_text("\n".join(json.dumps(r) for r in recs) + '\n{"step": 30, "lr"')  # torn last line
    c = curves_data(p)
    assert c["train_loss"].steps.tolist() == [10, 20] and c["train_loss"].values.tolist() == [5.0, 3.9]
    assert c["valid_bleu"].values.tolist() == [1.5]
    p.write_text('not json\n{"step": 1, "lr": 0.1}\n')
    with pytest.raises(DataError):
        curves_data(p)
    with pytest.raises(FileNotFoundError):
        curves_data(tmp_path / "nowhere")


# Attention -----------------------------------------------------------------------------------------------


def test_attention_rows_sum_to_one_and_decoder_is_causal(tiny_run):
    data = attention_data(tiny_run, SRC, "charlie bravo alpha")
    assert set(data.maps) == {"encoder", "decoder_self", "cross"} and not data.generated
    enc, dec, cross = data.maps["encoder"], data.maps["decoder_self"], data.maps["cross"]
    assert enc.queries == enc.keys and enc.keys[-1] == "</s>"
    assert dec.queries[0] == "<s>" and cross.queries == dec.queries and cross.keys == enc.keys
    for m in data.maps.values():
        L, H, Q, K = m.weights.shape
        assert (L, H) == (2, 2) and (Q, K) == (len(m.queries), len(m.keys))
        np.testing.assert_allclose(m.weights.sum(-1), 1.0, atol=1e-5)
        assert (m.weights >= 0).all()
    T = dec.weights.shape[-1]
    assert np.abs(dec.weights[..., np.triu_indices(T, k=1)[0], np.triu_indices(T, k=1)[1]]).max() == 0.0


def test_attention_without_target_uses_the_models_translation(tiny_run):
    from aiayn.run.directory import load_run
    from aiayn.search import greedy_search

    run = load_run(tiny_run)
    data = attention_data(run, SRC)
    src = torch.tensor([run.tokenizers.src.encode(SRC) + [3]])
    ids = greedy_search(run.model, src, spec=spec_of(max_len_a=run.cfg.decode.max_len_a,
                                                     max_len_b=run.cfg.decode.max_len_b))[0]
    assert data.generated and data.tgt == run.tokenizers.tgt.decode(ids)
    assert data.maps["decoder_self"].weights.shape[-1] == len(ids) + 1


def test_attention_select_layer_and_head(tiny_run):
    data = attention_data(tiny_run, SRC, "charlie")
    one = select(data, layer=1, head=0)
    for kind, m in one.maps.items():
        assert m.weights.shape[:2] == (1, 1) and m.layers == [1] and m.heads == [0]
        np.testing.assert_array_equal(m.weights[0, 0], data.maps[kind].weights[1, 0])
    assert select(data, head=1).maps["cross"].weights.shape[:2] == (2, 1)
    with pytest.raises(ConfigError):
        select(data, layer=2)
    with pytest.raises(ConfigError):
        attention_data(tiny_run, "   ")


def test_attention_of_a_language_model(tiny_run):
    from aiayn.model import build_model
    from aiayn.run.directory import Run, load_run

    run = load_run(tiny_run)
    torch.manual_seed(0)
    cfg = replace(run.cfg, task="lm")
    lm = Run(run.path, cfg, build_model(cfg.model, "lm").eval(), run.tokenizers)
    data = attention_data(lm, SRC)
    (m,) = data.maps.values()
    assert m.kind == "decoder_self" and m.queries == m.keys and "</s>" not in m.keys
    np.testing.assert_allclose(m.weights.sum(-1), 1.0, atol=1e-5)
    assert np.triu(m.weights[0, 0], k=1).max() == 0.0


# Commands ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, size", [
    (["positional", "--d-model", "32", "--max-pos", "20"], (1200, 600)),  # the default size
    (["positional", "--compare", "--d-model", "16", "--max-pos", "16", "--width", "500", "--height", "701"],
     (500, 701)),
    (["mask", "--len", "5", "--width", "333", "--height", "217"], (333, 217)),
    (["schedule", "--warmup", "100", "--width", "401", "--height", "299"], (401, 299)),
])
def test_commands_write_a_png_of_the_requested_size(tmp_path, capsys, argv, size):
    out = tmp_path / "sub" / "fig.png"
    assert main(["viz", *argv, "--out", str(out)]) == 0
    assert png_size(out) == size
    assert f"wrote {out}" in capsys.readouterr().out


def test_run_commands_write_pngs(tiny_run, tmp_path):
    out = tmp_path / "curves.png"
    assert main(["viz", "curves", str(tiny_run), "--out", str(out), "--width", "640", "--height", "300"]) == 0
    assert png_size(out) == (640, 300)
    out = tmp_path / "att.png"
    argv = ["viz", "attention", str(tiny_run), "--src", SRC, "--out", str(out), "--width", "420", "--height", "380"]
    assert main(argv) == 0
    paths = output_paths(out, ["encoder", "decoder_self", "cross"])
    assert {png_size(p) for p in paths.values()} == {(420, 380)}
    assert main([*argv, "--layer", "0", "--head", "1"]) == 0


def test_commands_fail_with_one_line(tiny_run, tmp_path, capsys):
    assert main(["viz", "attention", str(tiny_run), "--out", str(tmp_path / "a.png")]) == 2
    assert main(["viz", "attention", str(tiny_run), "--src", SRC, "--layer", "9",
                 "--out", str(tmp_path / "a.png")]) == 2
    assert main(["viz", "curves", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    assert main(["viz", "mask", "--len", "0", "--out", str(tmp_path / "m.png")]) == 2
    assert main(["viz", "mask", "--width", "10", "--out", str(tmp_path / "m.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("aiayn: error: ") for line in err)
    assert not list(tmp_path.glob("*.png"))


def test_show_keeps_the_figure_for_the_window(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    import aiayn.viz.common as common

    shown = []
    monkeypatch.setattr(common, "show_figures", lambda: shown.append(plt.get_fignums()))
    monkeypatch.setattr(common, "use_backend", lambda show: None)  # stay on Agg: no window in tests
    assert main(["viz", "mask", "--len", "3", "--show", "--out", str(tmp_path / "m.png")]) == 0
    assert len(shown) == 1 and len(shown[0]) == 1 and (tmp_path / "m.png").stat().st_size > 0
    plt.close("all")
