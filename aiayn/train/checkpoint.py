"""Checkpoints: weights and optimizer tensors in safetensors, everything else in JSON; never pickle.

A checkpoint ``checkpoints/step_NNNNNN`` is three files: ``.safetensors`` (model), ``.optim.safetensors``
(Adam moments) and ``.json`` (step, data position, RNG, schedule, optimizer scalars, metrics). Every
file is written to a temporary name and renamed into place, and the JSON is written last: a checkpoint
whose JSON exists is complete, so a run killed mid-save leaves the previous checkpoints usable; the
next save removes what such a kill left (temporaries, weights or optimizer files without their JSON).

Reading a checkpoint back checks it against its schema (:func:`read_checkpoint_state`: keys, types, the
RNG state's size, the optimizer file's tensor names) and against the model and optimizer it is loaded
into (names and shapes), so a damaged file is one :class:`CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from aiayn.errors import CheckpointError, one_line
from aiayn.files import atomic_write_json, read_json, remove_stale_temporaries
from aiayn.run.weights import (
    CKPT_DATA_RE,
    check_weights,
    checkpoint_dir,
    checkpoint_paths,
    list_checkpoints,
    read_weights,
    save_weights,
)

# The keys of a checkpoint's JSON: required ones, and those the trainer adds (train_state; world_size and
# accum_steps, whose product is the micro-batches of an update, which a resume keeps; and the CPU threads the run
# trained with: a resume uses the same count, as float sums depend on it).
REQUIRED_KEYS = ("step", "rng")
OPTIONAL_KEYS = ("optimizer", "train_state", "world_size", "accum_steps", "cpu_threads")
# Per-parameter state of the optimizers aiayn builds (Adam, AdamW; amsgrad adds max_exp_avg_sq).
OPTIMIZER_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _rng_to_json(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _rng_from_json(text: Any, size: int | None = None, where: str = "rng") -> torch.Tensor:
    """A generator state from its base64 text; ``size``: the byte count this PyTorch's generator has."""
    if not isinstance(text, str):
        raise ValueError(f"{where} is {type(text).__name__}, expected base64 text")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where} is not valid base64") from None
    if size is not None and len(raw) != size:
        raise ValueError(f"{where} has {len(raw)} bytes, this PyTorch's generator state has {size}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    state = {"torch": _rng_to_json(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_rng_to_json(s) for s in torch.cuda.get_rng_state_all()]
    return state


def check_rng_state(state: Any) -> None:
    """Raise ValueError unless ``state`` is what :func:`rng_state` wrote, with states of the right size."""
    if not isinstance(state, dict) or "torch" not in state:
        raise ValueError("rng is not an object with a 'torch' state")
    extra = sorted(set(state) - {"torch", "cuda"})
    if extra:
        raise ValueError(f"rng has an unexpected key {extra[0]!r}")
    _rng_from_json(state["torch"], torch.get_rng_state().numel(), "rng.torch")
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list):
        raise ValueError("rng.cuda is not a list")
    size = torch.cuda.get_rng_state().numel() if torch.cuda.is_available() else None
    for i, s in enumerate(cuda):
        _rng_from_json(s, size, f"rng.cuda[{i}]")


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_rng_from_json(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [_rng_from_json(s) for s in state["cuda"]][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


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
        save_weights(tensors, opath)
    atomic_write_json(jpath, meta, allow_nan=True)  # a diverged run (NaN loss) must still checkpoint
    if keep_last:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            for p in reversed(checkpoint_paths(run_dir, old)):  # JSON first: never a half-listed one
                p.unlink(missing_ok=True)
    remove_leftovers(run_dir, step)
    return jpath


def remove_leftovers(run_dir: str | Path, newest: int) -> list[Path]:
    """Delete what interrupted saves left: temporaries in the run and checkpoint directories, and weights or
    optimizer files without their JSON from steps before ``newest`` (the newest complete checkpoint), which
    nothing will ever read (a checkpoint is only listed once its JSON exists). Called by the one writer of
    the run (rank 0, holding the run's lock) between saves. Returns what was removed."""
    removed = remove_stale_temporaries(run_dir) + remove_stale_temporaries(checkpoint_dir(run_dir))
    d = checkpoint_dir(run_dir)
    for p in d.iterdir() if d.is_dir() else []:
        m = CKPT_DATA_RE.match(p.name)
        if m and int(m.group(1)) < newest and not (d / f"step_{m.group(1)}.json").exists():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _check_state(meta: Any, step: int) -> None:
    """Raise ValueError unless ``meta`` has the schema :func:`save_checkpoint` writes (the generic part)."""
    if not isinstance(meta, dict):
        raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise ValueError(f"no {missing[0]!r} key")
    extra = sorted(set(meta) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if extra:
        raise ValueError(f"unexpected key {extra[0]!r}")
    if meta["step"] != step or type(meta["step"]) is not int:
        raise ValueError(f"step is {meta['step']!r}, the file name says {step}")
    check_rng_state(meta["rng"])
    if "train_state" in meta and not isinstance(meta["train_state"], dict):
        raise ValueError("train_state is not an object")
    for key in ("world_size", "accum_steps", "cpu_threads"):
        if key in meta and (type(meta[key]) is not int or meta[key] < 1):
            raise ValueError(f"{key} is {meta[key]!r}, expected a positive integer")
    if "optimizer" in meta:
        _check_optimizer_meta(meta["optimizer"])


def _check_optimizer_meta(opt: Any) -> None:
    if not isinstance(opt, dict) or set(opt) != {"param_groups", "scalars"}:
        raise ValueError("optimizer is not an object with exactly 'param_groups' and 'scalars'")
    groups, scalars = opt["param_groups"], opt["scalars"]
    if not isinstance(groups, list) or not groups:
        raise ValueError("optimizer.param_groups is not a non-empty list")
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) or \
                not all(type(i) is int and i >= 0 for i in g["params"]):
            raise ValueError("optimizer.param_groups: each group needs 'params', a list of parameter indices")
    if not isinstance(scalars, dict) or not all(isinstance(v, (int, float)) for v in scalars.values()):
        raise ValueError("optimizer.scalars is not an object of numbers")
    ids = _param_ids(opt)
    for name in scalars:
        _state_name(name, ids)


def _param_ids(opt_meta: dict) -> list[int]:
    return [i for g in opt_meta["param_groups"] for i in g["params"]]


def _state_name(name: str, ids: list[int]) -> tuple[int, str]:
    """``"<parameter index>.<state key>"`` -> (index, key), checked against the parameters and Adam's keys."""
    idx, _, key = name.partition(".")
    if not idx.isdigit() or int(idx) not in ids or key not in OPTIMIZER_STATE_KEYS:
        raise ValueError(f"unexpected optimizer tensor {name!r} (expected <parameter index>."
                         f"{'|'.join(OPTIMIZER_STATE_KEYS)} for the {len(ids)} parameters)")
    return int(idx), key


def read_checkpoint_state(run_dir: str | Path, step: int) -> dict[str, Any]:
    """The JSON of checkpoint ``step``, checked against its schema, and the names of its optimizer file's
    tensors (read from the header only). Any problem is a one-line CheckpointError naming the file."""
    wpath, opath, jpath = checkpoint_paths(run_dir, step)
    try:
        meta = read_json(jpath)
        _check_state(meta, step)
    except OSError as e:
        raise CheckpointError(f"{jpath}: cannot read the checkpoint state ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{jpath}: not a valid checkpoint state (not JSON: {e.msg} at line {e.lineno} "
                              f"column {e.colno})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{jpath}: not a valid checkpoint state (not UTF-8 text)") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{jpath}: not a valid checkpoint state ({one_line(e)})") from None
    if "optimizer" in meta:
        ids = _param_ids(meta["optimizer"])
        try:
            with safe_open(str(opath), "pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{opath}: not a readable optimizer file ({one_line(e)})") from None
        try:
            for name in names:
                _state_name(name, ids)
        except ValueError as e:
            raise CheckpointError(f"{opath}: {e}") from None
    return meta


def _check_optimizer_fits(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict,
                          where: Path) -> None:
    """Tensor names and shapes of an optimizer file against the optimizer's parameters (flattened order)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = meta["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(f"{where}: parameter groups of sizes {sizes}, the model's optimizer has "
                              f"{[len(g['params']) for g in optimizer.param_groups]}")
    ids = _param_ids(meta)
    if sorted(ids) != list(range(len(params))):
        raise CheckpointError(f"{where}: parameter indices {ids[:3]}... do not number the model's "
                              f"{len(params)} parameters")
    for name, t in tensors.items():
        try:
            idx, _ = _state_name(name, ids)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        if t.dim() and t.shape != params[idx].shape:  # moments have the parameter's shape; 'step' is a scalar
            raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, parameter {idx} of the model "
                                  f"has {tuple(params[idx].shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: {name} is {t.dtype}, expected a floating-point tensor")


def load_checkpoint(
    run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore weights (and optimizer) of checkpoint ``step``; returns its JSON state (RNG not yet applied).
    Everything is checked before anything is loaded: a damaged checkpoint leaves model and optimizer as they were."""
    wpath, opath, jpath = checkpoint_paths(run_dir, step)
    meta = read_checkpoint_state(run_dir, step)
    weights = read_weights(wpath)
    check_weights(model, weights, str(wpath))
    if optimizer is not None and "optimizer" in meta:
        tensors = read_weights(opath)
        _check_optimizer_fits(optimizer, tensors, meta["optimizer"], opath)
    model.load_state_dict(weights, strict=False)
    if optimizer is not None and "optimizer" in meta:
        try:
            optimizer_from_files(optimizer, tensors, meta["optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{opath}: does not fit the optimizer ({one_line(e)})") from None
    return meta
