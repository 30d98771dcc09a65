"""Checkpoints: weights and optimizer tensors in safetensors, everything else in JSON; never pickle.

A checkpoint ``checkpoints/step_NNNNNN`` is three files: ``.safetensors`` (model), ``.optim.safetensors``
(Adam moments) and ``.json`` (step, data position, RNG, schedule, optimizer scalars, metrics). Every
file is written to a temporary name and renamed into place, and the JSON is written last: a checkpoint
whose JSON exists is complete, so a run killed mid-save leaves the previous checkpoints usable.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from aiayn.errors import CheckpointError
from aiayn.files import atomic_write, atomic_write_json

CKPT_RE = re.compile(r"^step_(\d{6,})\.json$")


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor stored once (under its first name), contiguous, on CPU."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # storage addresses: tied parameters share one
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.detach().to("cpu").contiguous()
    return out


def save_weights(model: nn.Module | dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """Write model weights (a module or a tensor dict from :func:`model_tensors`) atomically."""
    tensors = model_tensors(model) if isinstance(model, nn.Module) else model
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such weights file") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def load_weights(model: nn.Module, path: str | Path | dict[str, torch.Tensor]) -> None:
    """Load weights into ``model``; tied aliases missing from the file are fine, anything else is an error."""
    tensors = path if isinstance(path, dict) else read_weights(path)
    where = "weights" if isinstance(path, dict) else str(path)
    expected = model_tensors(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(model.state_dict()))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(f"{where}: does not fit the model ({what})")
    for name, t in tensors.items():
        if name in expected and expected[name].shape != t.shape:
            raise CheckpointError(
                f"{where}: {name} has shape {tuple(t.shape)}, the model expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors, strict=False)


def _rng_to_json(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _rng_from_json(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    state = {"torch": _rng_to_json(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_rng_to_json(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_rng_from_json(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_rng_from_json(s) for s in state["cuda"]])


def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into tensors (for safetensors) and JSON-able scalars."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{idx}.{key}"] = val.detach().to("cpu").contiguous()
            else:
                scalars[f"{idx}.{key}"] = val
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = t
    for name, v in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = v
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[int]:
    """Steps of the complete checkpoints in ``run_dir`` (those whose JSON exists), ascending."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    steps = []
    for p in d.iterdir():
        m = CKPT_RE.match(p.name)
        if m and (d / f"step_{m.group(1)}.safetensors").exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


def checkpoint_paths(run_dir: str | Path, step: int) -> tuple[Path, Path, Path]:
    base = checkpoint_dir(run_dir) / f"step_{step:06d}"
    return Path(f"{base}.safetensors"), Path(f"{base}.optim.safetensors"), Path(f"{base}.json")


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint ``step`` (JSON last) and delete all but the newest ``keep_last``."""
    wpath, opath, jpath = checkpoint_paths(run_dir, step)
    save_weights(model, wpath)
    meta: dict[str, Any] = {"step": step, "rng": rng_state(), **state}
    if optimizer is not None:
        tensors, meta["optimizer"] = optimizer_to_files(optimizer)
        atomic_write(opath, lambda tmp: save_file(tensors, tmp))
    atomic_write_json(jpath, meta, allow_nan=True)  # a diverged run (NaN loss) must still checkpoint
    if keep_last:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            for p in reversed(checkpoint_paths(run_dir, old)):  # JSON first: never a half-listed one
                p.unlink(missing_ok=True)
    return jpath


def load_checkpoint(
    run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore weights (and optimizer) of checkpoint ``step``; returns its JSON state (RNG not yet applied)."""
    wpath, opath, jpath = checkpoint_paths(run_dir, step)
    try:
        meta = json.loads(jpath.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{jpath}: unreadable checkpoint state ({e})") from None
    load_weights(model, wpath)
    if optimizer is not None and "optimizer" in meta:
        optimizer_from_files(optimizer, read_weights(opath), meta["optimizer"])
    return meta


def average_checkpoints(paths: list[str | Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of several weight files (section 6.1: "averaging the last 5 checkpoints")."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for p in paths:
        tensors = read_weights(p)
        if total and set(tensors) != set(total):
            raise CheckpointError(f"{p}: holds different tensors than {paths[0]}")
        for k, t in tensors.items():
            acc = t.to(torch.float64)
            total[k] = total[k] + acc if k in total else acc
    first = read_weights(paths[0])
    return {k: (v / len(paths)).to(first[k].dtype) for k, v in total.items()}
