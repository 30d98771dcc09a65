"""Learning-rate schedules and the optimizer of section 5.3.

Adam(beta1 0.9, beta2 0.98, eps 1e-9), lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5):
linear warm-up for ``warmup`` updates, then decay with the inverse square root of the step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from aiayn.config import TrainConfig
from aiayn.engine import use_fused_optimizer


def noam_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule, eq. (3) (section 5.3); ``step`` counts updates from 1."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` at ``warmup``, then peak * sqrt(warmup / step) (fairseq's inverse_sqrt)."""
    step = max(step, 1)
    if warmup > 0 and step < warmup:
        return peak * step / warmup
    return peak * math.sqrt(max(warmup, 1) / step)


def learning_rate(cfg: TrainConfig, d_model: int, step: int) -> float:
    """The learning rate of update ``step`` (1-based) under ``cfg.schedule``."""
    if cfg.schedule == "noam":
        return noam_lr(step, d_model, cfg.warmup, cfg.lr_scale)
    if cfg.schedule == "inverse_sqrt":
        return inverse_sqrt_lr(step, cfg.lr, cfg.warmup)
    return cfg.lr


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam with the paper's betas and eps (AdamW with ``weight_decay``); the learning rate is set before
    every update; fused where the engine says so (:func:`aiayn.engine.use_fused_optimizer`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if use_fused_optimizer(params) else {}
    if cfg.weight_decay > 0:
        return torch.optim.AdamW(params, lr=0.0, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay, **fused)
    return torch.optim.Adam(params, lr=0.0, betas=cfg.adam_betas, eps=cfg.adam_eps, **fused)
