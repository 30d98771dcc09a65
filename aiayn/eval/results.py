"""Evaluation records in a run directory: ``RUN/eval/<name>.json`` (+ ``.hyp``), written atomically.

:func:`check_writable` runs *before* any decoding, so a read-only run directory fails in a second with
one line instead of after minutes of work.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiayn.errors import CheckpointError, ConfigError
from aiayn.files import atomic_write_json, atomic_write_text, guard_output
from aiayn.files import check_writable as check_directory_writable


def eval_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "eval"


def check_name(name: str) -> str:
    """``name`` if it is a plain file name (the stem of ``eval/<name>.json``)."""
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise ConfigError(f"--name {name!r}: expected a plain file name (no directories)")
    if not name.isprintable():  # a newline would split the log's lines and the listings of eval/
        raise ConfigError(f"--name {name!r}: expected a plain file name (no control characters)")
    return name


def check_writable(run_dir: str | Path, name: str, inputs: Sequence[str | Path | None] = (), hyp: bool = True) -> Path:
    """Refuse the record ``eval/<name>.json`` (and ``.hyp`` with ``hyp``) through the output guard (one of the
    ``inputs``, an existing file of another kind); create ``RUN/eval`` if needed and prove a file can be written
    there (a :class:`CheckpointError` naming the directory and the reason otherwise). Returns the eval directory."""
    out = eval_dir(run_dir)
    given = [p for p in inputs if p is not None]
    records = [(out / f"{name}.json", "json"), *([(out / f"{name}.hyp", "text")] if hyp else [])]
    for path, kind in records:
        guard_output(path, kind, given, "", creates=[path])
    try:
        out.mkdir(exist_ok=True)
        check_directory_writable(out)
    except OSError as e:
        raise CheckpointError(f"{out}: cannot write the evaluation there ({e.strerror or e})") from None
    return out


def weights_info(run_dir: Path) -> dict[str, Any]:
    """Which weights the run's inference uses, and where they came from (the file's metadata)."""
    from safetensors import safe_open

    from aiayn.run.weights import inference_weights_path

    path = inference_weights_path(run_dir)
    info: dict[str, Any] = {"path": str(run_dir), "weights": str(path.relative_to(run_dir))}
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if "source" in meta:
            info["weights_source"] = meta["source"]
    except Exception:  # informational only: load_run has already read and validated the file
        pass
    return info


def scored_weights(run_dir: Path, which: str) -> tuple[Path | dict | None, dict[str, Any], str | None]:
    """The weights an evaluation scores (``which``: :func:`aiayn.run.weights.select_weights`' names; ``model``: those
    inference uses), read only: (what ``load_run`` loads, None for the run's own; the record's ``run`` field; the
    suffix of the record's default name, None for the run's own weights, so that scoring other weights never
    replaces the run's record)."""
    if which == "model":
        return None, weights_info(run_dir), None
    from aiayn.config import read_run_config
    from aiayn.run.weights import select_weights

    weights, what, label = select_weights(run_dir, which, read_run_config(run_dir).train.average_last)
    return weights, {"path": str(run_dir), "weights": what}, label


def write_result(run_dir: Path, name: str, result: dict[str, Any], hyps: list[str] | None) -> Path:
    """Write ``eval/<name>.hyp`` (one line per hypothesis) then ``eval/<name>.json``; returns the JSON path."""
    out = eval_dir(run_dir)
    if hyps is not None:
        atomic_write_text(out / f"{name}.hyp", "".join(h + "\n" for h in hyps))
    return atomic_write_json(out / f"{name}.json", result, indent=2)
