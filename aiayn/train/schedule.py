"""Learning-rate schedules and the optimizer of section 5.3.

Adam(beta1 0.9, beta2 0.98, eps 1e-9), lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5):
linear warm-up for ``warmup`` updates, then decay with the inverse square root of the step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from aiayn.config import TrainConfig


def noam_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """The paper's schedule (eq. 3 of section 5.3); ``step`` counts updates from 1."""
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
    every update. Fused (one kernel for all parameters, and no host-device synchronization under an fp16
    GradScaler) when every parameter is on CUDA; elsewhere PyTorch's default implementation, whose
    results earlier checkpoints and the exact-resume tests were made with."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if use_fused_optimizer(params) else {}
    if cfg.weight_decay > 0:
        return torch.optim.AdamW(params, lr=0.0, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay, **fused)
    return torch.optim.Adam(params, lr=0.0, betas=cfg.adam_betas, eps=cfg.adam_eps, **fused)


def use_fused_optimizer(params: list[torch.Tensor]) -> bool:
    """True when there are parameters and all are floating-point CUDA tensors (what ``fused=True`` takes)."""
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)
