"""Decoding on token ids (search) and text in / text out (translator, generator), and :func:`load`, the one loader
of a trained run: ``aiayn.load``, ``aiayn.decode.translator.load`` and ``aiayn.decode.generate.load_for_task`` are
its names elsewhere (the run on disk itself is read by :func:`aiayn.run_dir.load_run`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from aiayn.decode.generate import Generator
    from aiayn.decode.translator import Translator


def load(run_dir: str | Path, device: str | torch.device = "auto", precision: str = "auto",
         weights: str | Path | dict[str, torch.Tensor] | None = None) -> Translator | Generator:
    """A trained run, ready to use: what its task loads (``Task.loader``), a
    :class:`~aiayn.decode.translator.Translator` for translation and summarization runs, a
    :class:`~aiayn.decode.generate.Generator` for language models. ``weights``: other weights of the run than
    those inference uses (:func:`aiayn.weights.select_weights`)."""
    from aiayn.decode.generate import Generator
    from aiayn.decode.translator import Translator
    from aiayn.run_dir import load_run

    run = load_run(run_dir, device, weights, precision=precision)
    return {"translator": Translator, "generator": Generator}[run.cfg.kind.loader](run)
