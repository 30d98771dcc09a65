"""Weight files: save, read, check and load a model's tensors (safetensors, never pickle), average them, and
find which file a run's inference uses.

A run directory holds ``model.safetensors`` (the weights inference uses: last, best or averaged) and
``checkpoints/step_NNNNNN.{safetensors,optim.safetensors,json}``; a checkpoint counts once its JSON exists
(it is written last). This module knows the file names and the weights; the optimizer and training state
inside a checkpoint are :mod:`aiayn.train.checkpoint`'s. It sits low in the package (errors and files below
it), so that loading a run for inference, exporting or serving it never imports the training code.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from aiayn.errors import CheckpointError
from aiayn.files import atomic_write_safetensors

FINAL_WEIGHTS = "model.safetensors"
# A complete checkpoint: its JSON, written after its weights.
CKPT_RE = re.compile(r"^step_(\d{6,})\.json$")
# The files of a checkpoint that are written before its JSON (weights, optimizer tensors).
CKPT_DATA_RE = re.compile(r"^step_(\d{6,})\.(optim\.)?safetensors$")


# Checkpoint file names -----------------------------------------------------------------------------------


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_paths(run_dir: str | Path, step: int) -> tuple[Path, Path, Path]:
    """The weights, optimizer and JSON files of checkpoint ``step``."""
    base = checkpoint_dir(run_dir) / f"step_{step:06d}"
    return Path(f"{base}.safetensors"), Path(f"{base}.optim.safetensors"), Path(f"{base}.json")


def best_path(run_dir: str | Path) -> Path:
    """Where a training keeps its best weights by validation NLL, apart from the rotating checkpoints."""
    return checkpoint_dir(run_dir) / "best.safetensors"


def list_checkpoints(run_dir: str | Path) -> list[int]:
    """Steps of the complete checkpoints in ``run_dir`` (those whose JSON and weights exist), ascending."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    steps = []
    for p in d.iterdir():
        m = CKPT_RE.match(p.name)
        if m and (d / f"step_{m.group(1)}.safetensors").exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


def inference_weights_path(run_dir: str | Path) -> Path:
    """The weights a run's inference uses: model.safetensors, or the newest checkpoint while training has
    not finished yet."""
    run_dir = Path(run_dir)
    final = run_dir / FINAL_WEIGHTS
    if final.exists():
        return final
    steps = list_checkpoints(run_dir)
    if steps:
        return checkpoint_paths(run_dir, steps[-1])[0]
    if (run_dir / "config.yaml").is_file():  # a run directory whose training stopped before its first save
        raise CheckpointError(f"{run_dir}: no weights yet: its training stopped before the first checkpoint "
                              f"(train.save_every updates); continue it with aiayn train --resume {run_dir}")
    raise CheckpointError(f"{run_dir}: no {FINAL_WEIGHTS} and no checkpoints (is it a run directory?)")


# Tensors -------------------------------------------------------------------------------------------------


def _stored_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict's (name, tensor) pairs with each shared tensor once (under its first name), uncopied."""
    seen: set[int] = set()  # storage addresses: tied parameters share one
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            yield name, t


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor stored once (under its first name), contiguous, on CPU."""
    return {name: t.detach().to("cpu").contiguous() for name, t in _stored_tensors(model)}


def save_weights(model: nn.Module | dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """Write model weights (a module or a tensor dict from :func:`model_tensors`) atomically."""
    tensors = model_tensors(model) if isinstance(model, nn.Module) else model
    # No metadata is None, not {}: safetensors writes an unreadable header for {} with no tensors (the optimizer
    # file of a checkpoint taken before the first update).
    meta = {k: str(v) for k, v in metadata.items()} if metadata else None
    atomic_write_safetensors(path, tensors, meta, save_file)  # this module's save_file: tests replace it


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a missing or unreadable file is a one-line CheckpointError, and so is a
    pipe, a device or a directory in its place (reading a pipe would wait for a writer that never comes)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise CheckpointError(f"{path}: not a regular file (a pipe, a device or a directory stands in its place)")
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such weights file") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def check_weights(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """CheckpointError unless ``tensors`` fit ``model``: every tensor it needs (tied aliases may be missing),
    nothing else, each of the model's shape."""
    expected = {name: t.shape for name, t in model.state_dict().items()}
    needed = {name for name, _ in _stored_tensors(model)}
    missing = sorted(needed - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"{where}: does not fit the model ({what})")
    for name, t in tensors.items():
        if expected[name] != t.shape:
            raise CheckpointError(
                f"{where}: {name} has shape {tuple(t.shape)}, the model expects {tuple(expected[name])}")


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """CheckpointError when a floating tensor holds NaN or an infinity: such weights answer nothing sensible (an
    empty line for every input), so they are refused in one line rather than served."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"{where}: {len(bad)} of {len(tensors)} tensors hold NaN or infinite values (first: "
                              f"{bad[0]}), so these weights cannot be used (a training that diverged writes such "
                              "weights; an earlier checkpoint may be sound)")


def load_weights(model: nn.Module, path: str | Path | dict[str, torch.Tensor]) -> None:
    """Load weights into ``model``; tied aliases missing from the file are fine, anything else is an error, and
    so are NaN or infinite values (checked before anything is loaded)."""
    tensors = path if isinstance(path, dict) else read_weights(path)
    where = "weights" if isinstance(path, dict) else str(path)
    check_weights(model, tensors, where)
    check_finite(tensors, where)
    model.load_state_dict(tensors, strict=False)


def average_weights(paths: Sequence[str | Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of several weight files (section 6.1: "averaging the last 5 checkpoints"), summed in
    float64 and returned in the first file's dtypes; a file holding NaN or an infinity (or a mean that overflows
    its dtype) is a one-line CheckpointError, before anything is written."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for p in paths:
        tensors = read_weights(p)
        check_finite(tensors, str(p))  # one NaN would make every mean it touches NaN
        if total and set(tensors) != set(total):
            raise CheckpointError(f"{p}: holds different tensors than {paths[0]}")
        for k, t in tensors.items():
            if k in total and t.shape != total[k].shape:  # checkpoints of another model: no mean exists
                raise CheckpointError(f"{p}: {k} has shape {tuple(t.shape)}, {paths[0]} has {tuple(total[k].shape)}: "
                                      "checkpoints of different models cannot be averaged")
            first = dtypes.setdefault(k, t.dtype)
            if t.dtype != first and not (t.is_floating_point() and first.is_floating_point):  # fp32 with bf16: fine
                raise CheckpointError(f"{p}: {k} holds {t.dtype} values, {paths[0]} {first}: checkpoints of "
                                      "different kinds cannot be averaged")
            acc = t.to(torch.float64)
            total[k] = total[k] + acc if k in total else acc
    mean = {k: (v / len(paths)).to(dtypes[k]) for k, v in total.items()}
    check_finite(mean, f"the average of {len(paths)} checkpoints")  # float16 means can overflow to infinity
    return mean


# Which weights of a run -----------------------------------------------------------------------------------

WEIGHT_CHOICES = ("model", "last", "best", "average", "step N", "a .safetensors file")


def select_weights(run_dir: str | Path, which: str, average_last: int) -> tuple[Path | dict[str, torch.Tensor], str,
                                                                              str]:
    """The weights ``which`` names in a run, read only (nothing is written): ``model`` (model.safetensors, what
    inference uses), ``last`` (the newest checkpoint), ``best`` (``checkpoints/best.safetensors``), ``average``
    (the mean of the last ``average_last`` checkpoints, computed in memory), ``step:N`` (checkpoint N), or the path
    of a ``.safetensors`` file. Returns (a path or the tensors, what they are in words, a label for file names)."""
    run_dir = Path(run_dir)
    steps = list_checkpoints(run_dir)
    if which == "model":
        path = inference_weights_path(run_dir)
        return path, str(path.relative_to(run_dir)), "model"
    if which in ("last", "average") and not steps:
        raise CheckpointError(f"{run_dir}: no checkpoints, so no {which} weights (it has: {FINAL_WEIGHTS})")
    if which == "last":
        return checkpoint_paths(run_dir, steps[-1])[0], f"the last checkpoint, step {steps[-1]}", "last"
    if which == "average":
        chosen = steps[-average_last:]
        return (average_weights([checkpoint_paths(run_dir, s)[0] for s in chosen]),
                f"the average of steps {chosen}", "average")
    if which == "best":
        best = best_path(run_dir)
        if not best.is_file():
            raise CheckpointError(f"{best}: no such file (a run keeps its best weights when it evaluates)")
        return best, "the best checkpoint (lowest validation NLL)", "best"
    if which.startswith("step:"):
        step = int(which[5:])
        if step not in steps:
            raise CheckpointError(f"{run_dir}: no checkpoint of step {step} (it has steps {steps})")
        return checkpoint_paths(run_dir, step)[0], f"the checkpoint of step {step}", f"step_{step}"
    path = Path(which)
    if path.suffix != ".safetensors" or not path.is_file():
        raise CheckpointError(f"--weights {which}: expected one of {', '.join(WEIGHT_CHOICES)}")
    return path, str(path), path.stem
