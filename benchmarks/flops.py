"""Model FLOPs of a training update (the numerator of MFU; the formula is explained in benchmarks/mfu.py)
and the matmul peak of a device measured in the same run (the denominator).

Shapes: B batch, S source length, T target length, D model width, F FFN width, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aiayn.config import ModelConfig
from aiayn.data.batching import Batch

# NVIDIA's datasheet peak of dense bf16 (and fp16) tensor-core math on one H100 SXM, the same on an H200:
# the reference the MFU goals are stated against. Our own measured matmul peak sits beside it.
DATASHEET_PEAK_FLOPS = 989e12
DATASHEET_PEAK_NAME = "H100/H200 SXM dense bf16 datasheet peak, 989 TFLOP/s"

CPU_PEAK_SIZES = (2048, 4096)
CUDA_PEAK_SIZES = (4096, 8192)


def sentence_forward_flops(cfg: ModelConfig, S: int, T: int, attention: bool = True) -> int:
    """Forward FLOPs of one sentence pair (S source tokens with EOS, T target positions with BOS);
    ``attention=False`` leaves out QK^T and PV (the projections, FFN and output layer only)."""
    D, F, V = cfg.d_model, cfg.d_ff, cfg.target_vocab_size
    a = 1 if attention else 0
    enc = S * (4 * D * D + 2 * D * F) + a * 2 * S * S * D
    dec = T * (6 * D * D + 2 * D * F) + 2 * S * D * D + a * (2 * T * T * D + 2 * T * S * D)
    return 2 * (cfg.n_encoder_layers * enc + cfg.n_decoder_layers * dec + T * D * V)


def batch_training_flops(cfg: ModelConfig, batch: Batch, padded: bool = False, attention: bool = True) -> int:
    """3 x forward FLOPs of ``batch``: real lengths, or the padded tensor shapes when ``padded``."""
    if padded:
        B, S = batch.src.shape
        return 3 * B * sentence_forward_flops(cfg, S, batch.tgt_in.size(1), attention)
    src_lens = (batch.src != cfg.pad_id).sum(dim=1).tolist()
    tgt_lens = (batch.tgt_out != cfg.pad_id).sum(dim=1).tolist()  # = real length of tgt_in (BOS + y)
    return 3 * sum(sentence_forward_flops(cfg, s, t, attention) for s, t in zip(src_lens, tgt_lens))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes, its device work included."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def matmul_peak(sizes: Sequence[int] = CPU_PEAK_SIZES, reps: int = 5, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Best ``torch.mm`` FLOP/s of two n x n matrices of ``dtype`` on ``device`` over ``reps`` runs per
    size (after one warm-up run); on CUDA each run is 10 back-to-back products, so launch time is noise."""
    device = torch.device(device)
    inner = 10 if device.type == "cuda" else 1
    per_size = {}
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)

        def run(a=a, b=b) -> None:
            for _ in range(inner):
                torch.mm(a, b)

        run()
        best = min(timed(run, device) for _ in range(reps))
        per_size[n] = inner * 2 * n**3 / best
        del a, b
    return {"flops_per_s": max(per_size.values()), "per_size": per_size, "reps": reps,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device)}
