"""A trained model on disk (the run directory): config.yaml, tokenizer/, model.safetensors, checkpoints/."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aiayn.config import Config, ConfigError, load_config
from aiayn.data.tokenizer import TokenizerPair
from aiayn.device import DTYPES, resolve_device, resolve_precision
from aiayn.engine import prepare_model
from aiayn.errors import CheckpointError
from aiayn.model import build_model
from aiayn.weights import inference_weights_path, load_weights


@dataclass
class Run:
    """A loaded run: its resolved config, the model in eval mode, and its tokenizers."""

    path: Path
    cfg: Config
    model: nn.Module
    tokenizers: TokenizerPair


def read_run_config(run_dir: str | Path) -> Config:
    """RUN/config.yaml as a validated config; a file that is not UTF-8, not YAML or not a valid config is a
    one-line CheckpointError naming it."""
    cfg_path = Path(run_dir) / "config.yaml"
    try:
        return load_config(cfg_path)
    except ConfigError as e:
        msg = str(e)
        raise CheckpointError(msg if msg.startswith(str(cfg_path)) else f"{cfg_path}: {msg}") from None


def load_run(run_dir: str | Path, device: str | torch.device = "auto", weights: str | Path | None = None,
             precision: str = "auto") -> Run:
    """Read config, tokenizer and weights of a run; the model is on ``device`` (auto: CUDA, else MPS, else CPU)
    in eval mode, its weights in ``precision`` (auto: fp32 for inference; bf16 / fp16 on CUDA only).
    The device and precision are checked before anything is read."""
    dev = resolve_device(device)
    dtype = DTYPES[resolve_precision(precision, dev, training=False)]
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: no such run directory")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise CheckpointError(f"{run_dir}: no config.yaml (is it a run directory?)")
    cfg = read_run_config(run_dir)
    tok = TokenizerPair.load(run_dir / "tokenizer")
    model = build_model(cfg.model, cfg.task)
    load_weights(model, weights or inference_weights_path(run_dir))
    model.to(dtype=dtype)
    prepare_model(model, dev, training=False)
    return Run(run_dir, cfg, model.eval(), tok)
