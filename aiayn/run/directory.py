"""A trained model on disk (the run directory): config.yaml, tokenizer/, model.safetensors, checkpoints/."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from aiayn.config import Config, read_run_config
from aiayn.data.tokenizer import TokenizerPair
from aiayn.device import check_fits_in_memory, choose_precision, resolve_device, weights_dtype
from aiayn.engine import prepare_model
from aiayn.errors import CheckpointError
from aiayn.model import build_model
from aiayn.run.weights import inference_weights_path, list_checkpoints, load_weights

log = logging.getLogger("aiayn")


@dataclass
class Run:
    """A loaded run: its resolved config, the model in eval mode, and its tokenizers."""

    path: Path
    cfg: Config
    model: nn.Module
    tokenizers: TokenizerPair
    precision: str = "fp32"  # resolved: fp32 | tf32 | bf16 | fp16 | int8 (tf32: fp32 weights, TF32 matmuls in
    # kernels(); int8, and bf16 on a CPU: fp32 weights, int8 / bf16 linear layers, aiayn.linear)
    precision_why: str = ""  # why that precision (aiayn.device.choose_precision)


def load_run(run_dir: str | Path, device: str | torch.device = "auto",
             weights: str | Path | dict[str, torch.Tensor] | None = None, precision: str = "auto") -> Run:
    """Read config, tokenizer and weights of a run; the model is on ``device`` (auto: CUDA, else MPS, else CPU)
    in eval mode, its weights in ``precision`` (auto: :func:`aiayn.device.choose_precision`; fp16 on CUDA only;
    bf16 on CUDA or on a CPU with native bf16, there as fp32 weights and bf16 linear layers; int8 on a CPU only: fp32
    weights, int8 linear layers).
    ``weights``: a file or the tensors (:func:`aiayn.run.weights.select_weights`; None: those inference uses).
    The device and precision are checked before anything is read."""
    dev = resolve_device(device)
    precision, why = choose_precision(precision, dev, training=False)
    dtype = weights_dtype(precision, dev)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: no such run directory")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise CheckpointError(f"{run_dir}: no config.yaml (is it a run directory?)")
    cfg = read_run_config(run_dir)
    tok = TokenizerPair.load(run_dir / "tokenizer")
    check_fits_in_memory(cfg.model)
    model = build_model(cfg.model, cfg.task)
    load_weights(model, weights or inference_weights_path(run_dir))
    model.to(dtype=dtype)
    prepare_model(model, dev, training=False, precision=precision)
    warn_if_undertrained(run_dir, cfg)
    log.debug("precision: %s (%s)", precision, why)  # aiayn -v; serve's /v1/model says it too
    return Run(run_dir, cfg, model.eval(), tok, precision, why)


def trained_updates(run_dir: str | Path) -> int | None:
    """The updates of a run's newest checkpoint (None for a run without any, e.g. one imported from HF)."""
    steps = list_checkpoints(run_dir)
    return steps[-1] if steps else None


def warn_if_undertrained(run_dir: Path, cfg: Config) -> bool:
    """One warning when the run trained fewer updates than its recipe needs to be useful
    (``expect.useful_updates``, measured: docs/results.md); returns whether it did."""
    useful, done = cfg.expect.useful_updates, trained_updates(run_dir)
    if useful is None or done is None or done >= useful:
        return False
    log.warning("%s trained for %s updates, fewer than the %s its recipe needs to be useful: expect poor output "
                "(continue it with: aiayn train --resume %s --set train.max_minutes=...)", run_dir, f"{done:,}",
                f"{useful:,}", run_dir)
    return True
