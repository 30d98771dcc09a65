"""``aiayn train CONFIG --init-from RUN``: fine-tune a trained (or imported, e.g. Hugging Face Marian) run.

What comes from where:

* RUN: the weights (``RUN/model.safetensors``), the tokenizer (its files are copied into the new run
  unchanged, never retrained) and the model section of the config (the architecture the weights fit).
* CONFIG: everything else - data, learning rate, schedule, steps. Its ``model`` section may only repeat
  RUN's: a key set to something other than the default that differs from RUN's value is refused, so a
  recipe never silently trains a model other than the one it names.
* decode: RUN's decoding settings (e.g. an imported Marian run's beam, power length penalty and pad ban),
  except the keys CONFIG sets to a non-default value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from aiayn.config import Config, DecodeOptions, ModelConfig, load_config
from aiayn.data.pipeline import FITTED_KEYS, tokenizer_dir
from aiayn.data.tokenizer import (
    PAIR_FILE,  # written last: its presence marks a complete tokenizer directory
    tokenizer_files,
)
from aiayn.errors import CheckpointError, ConfigError
from aiayn.files import atomic_write_bytes


@dataclass
class InitFrom:
    """The run a training starts from: its directory, weights file and tokenizer directory."""

    run: Path
    weights: Path
    tokenizer: Path


def _contradictions(ours: ModelConfig, theirs: ModelConfig) -> list[str]:
    default = ModelConfig()
    out = []
    for f in dataclasses.fields(ModelConfig):
        mine, base, init = getattr(ours, f.name), getattr(default, f.name), getattr(theirs, f.name)
        if f.name not in FITTED_KEYS and mine != base and mine != init:
            out.append(f"model.{f.name}={mine!r} (the run has {init!r})")
    return out


def _merged_decode(ours: DecodeOptions, theirs: DecodeOptions) -> DecodeOptions:
    """RUN's decode section with CONFIG's non-default values on top."""
    default = DecodeOptions()
    changed = {f.name: getattr(ours, f.name) for f in dataclasses.fields(DecodeOptions)
               if getattr(ours, f.name) != getattr(default, f.name)}
    return dataclasses.replace(theirs, **changed)


def adopt_init_run(cfg: Config, init_from: str | Path) -> tuple[Config, InitFrom]:
    """Check ``init_from`` and return the config that trains its model: RUN's model section (refusing a CONFIG
    model section that contradicts it) and decode settings (see the module docstring), with the run's files.
    ``cfg`` itself is not changed."""
    run = Path(init_from)
    if not (run / "config.yaml").is_file():
        raise CheckpointError(f"--init-from {run}: no config.yaml (not a run directory)")
    weights = run / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"--init-from {run}: no model.safetensors (finish or `aiayn average` the run first)")
    tok = tokenizer_dir(run)
    if not (tok / PAIR_FILE).is_file():
        raise CheckpointError(f"--init-from {run}: no tokenizer/{PAIR_FILE}")
    init_cfg = load_config(run / "config.yaml")
    why = cfg.kind.refusal("init_from")
    if init_cfg.kind is not cfg.kind or why is not None:
        raise ConfigError(f"--init-from {run}: a {init_cfg.task} run cannot start a {cfg.task} training"
                          + (f" ({why})" if why is not None else ""))
    bad = _contradictions(cfg.model, init_cfg.model)
    if bad:
        raise ConfigError(f"--init-from {run}: the config's {bad[0]}; the model comes from the run, so drop "
                          f"that key from the config's model section")
    adopted = dataclasses.replace(cfg, model=init_cfg.model, decode=_merged_decode(cfg.decode, init_cfg.decode))
    return adopted, InitFrom(run, weights, tok)


def copy_init_tokenizer(init: InitFrom, run_dir: Path) -> None:
    """Copy RUN's tokenizer files into ``run_dir/tokenizer`` byte for byte (tokenizer.json last). A tokenizer
    already there (a resumed run) must be the same files."""
    dest = tokenizer_dir(run_dir)
    files = sorted(tokenizer_files(init.tokenizer), key=lambda p: p.name == PAIR_FILE)
    if (dest / PAIR_FILE).is_file():
        differ = [p.name for p in files if not (dest / p.name).is_file() or (dest / p.name).read_bytes()
                  != p.read_bytes()]
        if differ:
            raise CheckpointError(f"{dest}: its tokenizer is not --init-from {init.run}'s ({differ[0]} differs)")
        return
    for p in files:
        atomic_write_bytes(dest / p.name, p.read_bytes())
