"""Where and in what precision a model runs: the one place that resolves ``--device`` and ``--precision``.

``device="auto"`` (the default of every command and of :func:`aiayn.load`) is CUDA when PyTorch sees a
GPU, else Apple's MPS where PyTorch offers it, else the CPU. A device that is asked for but not there
(``cuda`` on a CPU-only PyTorch, ``cuda:3`` on a one-GPU machine, ``bogus``) is a :class:`DeviceError`
(one line, exit 2) raised before any work starts.

Precision: ``fp32`` everywhere, and on CUDA it is IEEE fp32 (TF32 tensor cores stay off, PyTorch's default);
``tf32`` (CUDA only) keeps fp32 weights and activations and lets matmuls run on TF32 tensor cores (10-bit
mantissa inputs, fp32 accumulation; several times faster than fp32 on an H100, the setting nanoGPT and Lightning
recommend); ``bf16`` is autocast on CUDA and, for training, on a CPU with native bf16 (AVX512-BF16 or AMX, checked
by :mod:`aiayn.cpu_probe` in a child process, since bf16 on a CPU or hypervisor without them can die with "Illegal
instruction"); for inference on such a CPU the weights stay fp32 and the linear layers multiply in bf16 (fp32
sums), while attention, softmax, layer norm and the search's scores stay fp32 (:mod:`aiayn.linear`). ``fp16`` is
CUDA only. ``int8`` (inference on a CPU only) keeps fp32 weights and activations and multiplies the linear layers
with int8 weights (:mod:`aiayn.linear`): their input rows quantized to int8 too (dynamic quantization), or rounded to
bf16 where this CPU's bf16 passed :mod:`aiayn.cpu_probe` and measured faster so (:func:`int8_kind`).

``auto``: on CUDA, bf16 for training where the GPU supports it and fp32 for inference; on a CPU, bf16 where
:mod:`aiayn.cpu_probe` found native bf16 that passed its probe and measured faster than fp32 (for inference, also
at one sentence's rows), else fp32; :func:`choose_precision` says which and why, in one line that training logs
and ``aiayn report`` show. Inference means ``aiayn translate``, ``serve``, ``evaluate`` and the validation BLEU
of a training (which decodes outside the training autocast: one rule, so the BLEU a training reports is the BLEU
its run gives). ``auto`` never means int8.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple

import torch

from aiayn.cpu_probe import ENV, cpu_bf16
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
    int8) on ``device``: :func:`choose_precision` without its reason."""
    return choose_precision(precision, device, training)[0]


class Precision(NamedTuple):
    """A resolved precision (fp32 | tf32 | bf16 | fp16 | int8) and why it was chosen (one line)."""

    name: str
    why: str


def choose_precision(precision: str, device: torch.device, training: bool) -> Precision:
    """The resolved precision and why (one line) for ``precision`` on ``device``, for training or inference.

    ``auto``: the module docstring's rule. tf32 / fp16 off CUDA, bf16 on a CPU without native bf16 (or one whose
    probe failed) and int8 off the CPU or for training are a :class:`DeviceError`, before any work."""
    if precision not in PRECISIONS:
        raise DeviceError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    cuda = device.type == "cuda"
    if precision == "auto":
        if cuda:
            if not training:
                return Precision("fp32", "auto: inference on a GPU runs in fp32")
            if torch.cuda.is_bf16_supported():
                return Precision("bf16", "auto: training on a GPU with bf16")
            return Precision("fp32", "auto: this GPU has no bf16")
        if device.type == "cpu":
            chosen, why = _cpu_auto(training)
            return Precision(chosen, f"auto: {why}")
        return Precision("fp32", f"auto: {device.type}")
    if precision == "int8":
        if training:
            raise DeviceError("precision int8 is for inference (translate, evaluate, serve); train in fp32 or bf16")
        if device.type != "cpu":
            raise DeviceError(f"precision int8 runs on the CPU only (this runs on {device.type}); use fp32, or "
                              "bf16 / fp16 on CUDA")
        return Precision(precision, f"asked for (--precision int8); {int8_kind()[1]}")
    if precision == "bf16" and device.type == "cpu":
        found = cpu_bf16()
        if not found.native:
            raise DeviceError(f"precision bf16 on this CPU ({found.cpu}): {found.why}; use fp32 (or auto)")
        return Precision("bf16", f"asked for (--precision bf16); {found.why}")
    if precision != "fp32" and not cuda:
        raise DeviceError(f"precision {precision} needs a CUDA device (this runs on {device.type}); use fp32"
                          + (" or bf16" if device.type == "cpu" else ""))
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise DeviceError("precision bf16: this GPU does not support bfloat16; use fp16 or fp32")
    return Precision(precision, f"asked for (--precision {precision})")


def _bf16_switched_off() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false")


def int8_kind() -> tuple[str, str]:
    """The linear layers' kind (:mod:`aiayn.linear`) that ``--precision int8`` runs on this CPU, and why (one
    phrase): int8 weights with bf16 rows where :mod:`aiayn.cpu_probe` found native bf16 and measured them faster
    (:meth:`aiayn.cpu_probe.CpuBf16.int8_kind`), else dynamic int8; ``AIAYN_CPU_BF16=off`` keeps dynamic int8."""
    if _bf16_switched_off():
        return "int8", f"int8 weights and rows ({ENV}={os.environ[ENV]})"
    return cpu_bf16().int8_kind()


def _cpu_auto(training: bool) -> tuple[str, str]:
    """What ``auto`` runs on this CPU, and why (:mod:`aiayn.cpu_probe`; ``AIAYN_CPU_BF16=off`` skips the probe)."""
    if _bf16_switched_off():
        return "fp32", f"{ENV}={os.environ[ENV]}"
    return cpu_bf16().precision(training)


def weights_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype a model's weights are held in for inference at a resolved ``precision``: that of the precision
    on CUDA and MPS; fp32 on a CPU, where bf16 is the linear layers' products only and int8 likewise
    (:mod:`aiayn.linear`)."""
    return torch.float32 if device.type == "cpu" else DTYPES[precision]


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
    a run or trains one calls it before building the model (:func:`aiayn.run.directory.load_run`, ``aiayn train`` before
    any work, ``aiayn import hf``)."""
    need, have = cfg.memory_bytes(), physical_memory()
    if have is not None and need > have:
        raise ConfigError(f"model: its weights and position tables alone need about {need / 2**30:,.1f} GiB in "
                          f"fp32 (d_model={cfg.d_model}, max_positions={cfg.max_positions}, vocabulary "
                          f"{cfg.vocab_size}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers), more "
                          f"than this machine's {have / 2**30:,.1f} GiB")


__all__ = [
    "DEVICE_CHOICES", "DTYPES", "PRECISIONS", "Precision", "autocast_context", "check_fits_in_memory",
    "choose_precision", "inference_precision", "model_device", "move_module", "physical_memory", "resolve_device",
    "resolve_precision", "weights_dtype",
]
