"""What ``aiayn.load`` does: :func:`open_run` gives what a run's task loads. ``aiayn.load`` is the one public
loader (the front door sits above the server and the command line, which call :func:`open_run` from below it);
the run on disk itself is read by :func:`aiayn.run.directory.load_run`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from aiayn.decode.generate import Generator
    from aiayn.decode.translator import Translator


def chosen_weights(run_dir: str | Path, weights: str | Path | dict[str, torch.Tensor] | None
                   ) -> Path | dict[str, torch.Tensor] | None:
    """``weights`` as :func:`~aiayn.run.directory.load_run` takes them: a name of
    :func:`aiayn.run.weights.select_weights` (``model``, ``last``, ``best``, ``average``, ``step:N``, or a
    ``.safetensors`` path as a string) resolved in the run; a ``Path`` or the tensors as given; None: those
    inference uses."""
    if not isinstance(weights, str) or not (Path(run_dir) / "config.yaml").is_file():
        return weights  # not a run directory: load_run says so in its own words
    from aiayn.config import read_run_config
    from aiayn.run.weights import select_weights

    return select_weights(run_dir, weights, read_run_config(run_dir).train.average_last)[0]


def open_run(run_dir: str | Path, device: str | torch.device = "auto", precision: str = "auto",
             weights: str | Path | dict[str, torch.Tensor] | None = None, *, translator_only: bool = False
             ) -> Translator | Generator:
    """A trained run, ready to use: what its task loads (``Task.loader``), a
    :class:`~aiayn.decode.translator.Translator` for translation and summarization runs, a
    :class:`~aiayn.decode.generate.Generator` for language models (``translator_only``: a language-model run is
    refused in one line, for the commands that translate). ``weights``: :func:`chosen_weights`."""
    from aiayn.decode.generate import Generator
    from aiayn.decode.translator import Translator
    from aiayn.run.directory import load_run

    run = load_run(run_dir, device, chosen_weights(run_dir, weights), precision=precision)
    if translator_only:
        run.cfg.kind.check_does("load_translator", run_dir)
    return {"translator": Translator, "generator": Generator}[run.cfg.kind.loader](run)
