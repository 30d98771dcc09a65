"""What the :class:`~aiayn.decode.translator.Translator` and the :class:`~aiayn.decode.generate.Generator` share:
a trained run in memory, its device, and its decoding options with per-call overrides."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from aiayn.config import Config, DecodeOptions
from aiayn.data.tokenizer import TokenizerPair
from aiayn.device import model_device
from aiayn.engine import kernels, prepare_model
from aiayn.run.directory import Run


def text_list(texts: object, what: str = "texts") -> list[str]:
    """``texts`` (a list, tuple, generator: any iterable of strings) as a list, read once here; anything else, or
    an item that is not a string, is one TypeError naming it (not an error from deep inside the tokenizer)."""
    if isinstance(texts, (str, bytes, bytearray)) or not isinstance(texts, Iterable):
        raise TypeError(f"{what}: expected a list (or any iterable) of strings, got {type(texts).__name__}")
    out = list(texts)
    for i, text in enumerate(out):
        if not isinstance(text, str):
            hint = " (decode bytes to str first)" if isinstance(text, (bytes, bytearray)) else ""
            raise TypeError(f"{what}[{i}]: expected a string, got {type(text).__name__}{hint}")
    return out


def merged_options(default: DecodeOptions, options: DecodeOptions | None = None, **overrides) -> DecodeOptions:
    """``options`` (None: ``default``, a run's ``decode`` section) with the non-None ``overrides`` replacing them;
    anything but a DecodeOptions as ``options`` is one TypeError."""
    if options is not None and not isinstance(options, DecodeOptions):
        raise TypeError(f"options: expected a DecodeOptions (or None), got {type(options).__name__}; single "
                        "options go as keywords (translate(texts, beam=5))")
    return (options or default).replace(**overrides)


class LoadedRun:
    """A :class:`~aiayn.run.directory.Run` ready to decode: its model in eval mode, tokenizers, config and directory.
    Decoding runs inside the engine's kernel choice for the model's device (:meth:`kernels`)."""

    def __init__(self, run: Run) -> None:
        run.model.eval()
        self.run = run

    @property
    def model(self) -> nn.Module:
        return self.run.model

    @property
    def tokenizers(self) -> TokenizerPair:
        return self.run.tokenizers

    @property
    def cfg(self) -> Config:
        return self.run.cfg

    @property
    def path(self) -> Path:
        return self.run.path

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def to(self, device: str | torch.device) -> LoadedRun:
        """Move the model (``"auto"`` resolves as everywhere), with the engine's choices for it; returns self."""
        prepare_model(self.model, device, training=False, precision=self.run.precision)
        return self

    def kernels(self):
        """A context that runs decoding with the engine's kernel choice for the model's device."""
        return kernels(self.device, self.run.precision)

    def options(self, options: DecodeOptions | None = None, **overrides) -> DecodeOptions:
        """``options`` (default: the run's ``decode`` section) with the non-None ``overrides`` replacing them."""
        return merged_options(self.cfg.decode, options, **overrides)

    def warm_up(self) -> None:
        """One tiny decoding, so that a server's first user does not pay for lazy initialisation."""
        raise NotImplementedError
