"""Sampling values at their edges: a ``top_p`` below float32's smallest value keeps the most probable token, so
``aiayn translate`` and ``aiayn generate`` then give greedy search's output. (Issue 44.)
"""

from __future__ import annotations

import pytest

from aiayn.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("p", [1e-46, 1e-300, 5e-324])
def test_top_p_below_float32_keeps_the_most_probable_token(p):
    import torch

    from aiayn.search.processing import filter_top_p

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    kept = filter_top_p(logits, p)
    assert (kept.isfinite().sum(dim=-1) == 1).all() and (kept.argmax(-1) == logits.argmax(-1)).all()
    assert torch.multinomial(kept.softmax(-1), 1).squeeze(1).tolist() == logits.argmax(-1).tolist()


def test_translate_samples_with_a_tiny_top_p(tiny_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a b c\nhello world\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(tiny_run), "--input", str(src), "--sample", "--top-p", "1e-300", "--seed", "1",
                 "--device", "cpu"]) == 0
    sampled = capsys.readouterr().out
    assert main(["translate", str(tiny_run), "--input", str(src), "--beam", "1", "--device", "cpu"]) == 0
    assert sampled == capsys.readouterr().out  # only the top token is left: greedy search's output


def test_generate_samples_with_a_tiny_top_p(lm_run, capsys):
    capsys.readouterr()
    args = ["generate", str(lm_run), "--prompt", "the", "--max-new-tokens", "8", "--device", "cpu"]
    assert main([*args, "--top-p", "1e-300", "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    assert main([*args, "--temperature", "0"]) == 0
    assert sampled == capsys.readouterr().out  # only the most probable token is left: the greedy text
