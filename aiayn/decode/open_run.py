"""The one loader of a trained run for use: :func:`load` gives what the run's task loads (``aiayn.load`` is its
name at the front door; :func:`aiayn.decode.translator.load` is the same for a run that must translate, typed so;
the run on disk itself is read by :func:`aiayn.run_dir.load_run`)."""

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
