"""Where and in what precision a model runs: the one place that resolves ``--device`` and ``--precision``.

``device="auto"`` (the default of every command and of :func:`aiayn.load`) is CUDA when PyTorch sees a
GPU, else Apple's MPS where PyTorch offers it, else the CPU. A device that is asked for but not there
(``cuda`` on a CPU-only PyTorch, ``cuda:3`` on a one-GPU machine, ``bogus``) is a :class:`DeviceError`
(one line, exit 2) raised before any work starts.

Precision: ``fp32`` everywhere, and on CUDA it is IEEE fp32 (TF32 tensor cores stay off, PyTorch's default);
``tf32`` (CUDA only) keeps fp32 weights and activations and lets matmuls run on TF32 tensor cores (10-bit
mantissa inputs, fp32 accumulation; several times faster than fp32 on an H100, the setting nanoGPT and Lightning
recommend); ``bf16`` / ``fp16`` autocast on CUDA only (bf16 matmul is not safe on every CPU: it dies with
"Illegal instruction" on some); ``int8`` (inference on a CPU only) keeps fp32 weights and activations and
multiplies the linear layers in int8 (dynamic quantization, :mod:`aiayn.linear`). ``auto`` means bf16 for
training on a CUDA device that supports it, and fp32 for inference (``aiayn translate``, ``serve``, ``evaluate``
and the validation BLEU of a training, which decodes outside the training autocast: one rule, so the BLEU a
training reports is the BLEU its run gives); it never means int8.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from aiayn.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    from aiayn.config import ModelConfig

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"
PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16", "int8")
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16, "int8": torch.float32}  # int8: fp32 weights, int8 products (aiayn.linear)


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(name: str | torch.device | None = "auto", local_rank: int = 0) -> torch.device:
    """The :class:`torch.device` for ``name`` (auto | cpu | cuda | cuda:N | mps), checked to exist here.

    ``local_rank`` picks the GPU of a torchrun process for ``auto`` and a bare ``cuda``."""
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r}: unknown (expected {DEVICE_CHOICES})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DeviceError(f"device {name!r}: {why} (torch {torch.__version__}); use --device cpu or auto")
        index = local_rank if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise DeviceError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not _mps_available():
            raise DeviceError(f"device {name!r}: MPS is not available here; use --device cpu or auto")
        return dev
    raise DeviceError(f"device {name!r}: not supported (expected {DEVICE_CHOICES})")


def resolve_precision(precision: str, device: torch.device, training: bool) -> str:
    """``fp32``, ``tf32``, ``bf16``, ``fp16`` or ``int8`` for ``precision`` (auto | fp32 | tf32 | bf16 | fp16 |
    int8) on ``device``.

    ``auto``: bf16 when training on a CUDA device that supports it, fp32 otherwise (inference keeps fp32
    until bf16 decoding is measured to be as good). tf32 / bf16 / fp16 off CUDA is a :class:`DeviceError`, and so
    is int8 off the CPU or for training."""
    if precision not in PRECISIONS:
        raise DeviceError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    cuda = device.type == "cuda"
    if precision == "auto":
        return "bf16" if training and cuda and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "int8":
        if training:
            raise DeviceError("precision int8 is for inference (translate, evaluate, serve); train in fp32 or bf16")
        if device.type != "cpu":
            raise DeviceError(f"precision int8 runs on the CPU only (this runs on {device.type}); use fp32, or "
                              "bf16 / fp16 on CUDA")
        return precision
    if precision != "fp32" and not cuda:
        raise DeviceError(f"precision {precision} needs a CUDA device (this runs on {device.type}); use fp32")
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise DeviceError("precision bf16: this GPU does not support bfloat16; use fp16 or fp32")
    return precision


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (the CPU for a model without any, e.g. a scripted stub)."""
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return p.device if p is not None else torch.device("cpu")


def move_module(module: torch.nn.Module, device: str | torch.device) -> torch.device:
    """Move ``module`` to ``device`` (``"auto"`` resolves as everywhere; checked first); returns the resolved
    device."""
    dev = resolve_device(device)
    module.to(dev)
    return dev


def inference_precision(device: torch.device) -> str:
    """The precision inference runs in by default on ``device`` (``--precision auto``): the one rule for
    ``aiayn translate`` / ``evaluate`` / ``serve`` and the validation BLEU of a training."""
    return resolve_precision("auto", device, training=False)


def autocast_context(precision: str, device: torch.device) -> AbstractContextManager:
    """The autocast context of a resolved precision (fp32, tf32 and int8: a no-op context; tf32 is a matmul setting,
    :func:`aiayn.engine.kernels`, int8 the linear layers' kernel, :mod:`aiayn.linear`)."""
    if precision in ("fp32", "tf32", "int8"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def physical_memory() -> int | None:
    """Bytes of memory this machine has (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def check_fits_in_memory(cfg: ModelConfig) -> None:
    """Refuse, in one line, a model whose fp32 weights and position tables alone exceed this machine's memory.
    A check of the machine, not of the config (a config is the same on every machine) nor of the model: what opens
    a run or trains one calls it before building the model (:func:`aiayn.run_dir.load_run`, ``aiayn train`` before
    any work, ``aiayn import hf``)."""
    need, have = cfg.memory_bytes(), physical_memory()
    if have is not None and need > have:
        raise ConfigError(f"model: its weights and position tables alone need about {need / 2**30:,.1f} GiB in "
                          f"fp32 (d_model={cfg.d_model}, max_positions={cfg.max_positions}, vocabulary "
                          f"{cfg.vocab_size}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers), more "
                          f"than this machine's {have / 2**30:,.1f} GiB")


__all__ = [
    "DEVICE_CHOICES", "DTYPES", "PRECISIONS", "autocast_context", "check_fits_in_memory", "inference_precision",
    "model_device", "move_module", "physical_memory", "resolve_device", "resolve_precision",
]
