"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017), from training to deployment.

The public names are imported on first use (PEP 562), so ``import aiayn`` and ``aiayn --help`` do not
pay for PyTorch until a model is needed.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_LAZY = {
    "Config": "aiayn.config",
    "DecodeOptions": "aiayn.config",
    "ModelConfig": "aiayn.config",
    "load_config": "aiayn.config",
    "model_config": "aiayn.config",
    "DecoderOnlyLM": "aiayn.model",
    "Transformer": "aiayn.model",
    "build_model": "aiayn.model",
}

__all__ = ["Config", "DecodeOptions", "DecoderOnlyLM", "ModelConfig", "Transformer", "__version__", "build_model",
           "load", "load_config", "model_config"]

if TYPE_CHECKING:  # pragma: no cover
    from aiayn.config import Config, DecodeOptions, ModelConfig, load_config, model_config  # noqa: F401
    from aiayn.decode.generate import Generator
    from aiayn.decode.translator import Translator
    from aiayn.model import DecoderOnlyLM, Transformer, build_model  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'aiayn' has no attribute {name!r}")


def load(run_dir: str | Path, device: str = "auto", precision: str = "auto",
         weights: str | Path | dict[str, Any] | None = None) -> Translator | Generator:
    """A trained run, ready to use: a :class:`~aiayn.decode.translator.Translator` for translation and
    summarization runs, a :class:`~aiayn.decode.generate.Generator` for language models; aiayn's one loader.

    ``device="auto"`` is CUDA when available, else MPS, else CPU; both objects move with ``.to(device)``.
    ``precision``: auto | fp32 | tf32 | bf16 | fp16 | int8, as the commands' ``--precision``.
    ``weights``: which weights of the run, as ``aiayn evaluate --weights`` names them: ``"model"`` (the default,
    None: those inference uses, ``model.safetensors``), ``"last"``, ``"best"``, ``"average"`` (of the last
    ``train.average_last`` checkpoints), ``"step:N"``, or a ``.safetensors`` file (a string or a ``Path``); or the
    tensors themselves (a state dict).

    >>> tr = aiayn.load("runs/demo"); tr.translate(["A dog runs on the beach."])
    >>> best = aiayn.load("runs/demo", weights="best")
    """
    from aiayn.decode.open_run import open_run

    return open_run(run_dir, device, precision, weights)
