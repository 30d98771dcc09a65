"""What a config value may be, and the checks every section runs: the ceilings past which a value is a typo or an
attack, lower bounds, choices, the coercion of a value to its field's type (``--set`` gives strings)."""

from __future__ import annotations

import math
import typing
from typing import Any

from aiayn.errors import ConfigError

# The largest value of every size and count, one table for the recipes, the command line (--set, the decoding
# flags) and the server (whose requests go through DecodeOptions): past these a value is a typo or an attack,
# not a model. The lower bounds sit beside each field's check; a model whose weights would not fit in this
# machine's memory is refused before it is built (aiayn.device.check_fits_in_memory), not here: a config is
# the same everywhere. docs/configuration.md lists them (a test keeps it true).
COUNT = 2**62  # updates, steps, epochs, checkpoints: far beyond any real run, and within a 64-bit integer
SEED = 2**64 - 1  # torch.manual_seed takes 0 .. 2**64 - 1
MIN_TEMPERATURE = 1e-6  # logits / a smaller temperature can overflow fp32 (1e-320 gives inf); 0 means greedy
LIMITS: dict[str, float] = {
    "model.vocab_size": 2**24, "model.tgt_vocab_size": 2**24, "model.d_model": 65536, "model.n_heads": 4096,
    "model.d_k": 65536, "model.d_v": 65536,
    "model.d_ff": 2**20, "model.n_encoder_layers": 1024, "model.n_decoder_layers": 1024, "model.max_positions": 2**20,
    "model.pad_id": 2**24, "data.vocab_size": 2**24, "data.tokenizer_sample": 2**40, "data.max_tokens": 2**31,
    "data.update_tokens": 2**40, "data.loader_workers": 256,
    "data.max_len": 2**20, "data.block_size": 2**20, "data.batch_size": 2**20, "data.pad_to_multiple": 4096,
    "train.max_updates": COUNT, "train.max_epochs": COUNT, "train.max_minutes": 1e9, "train.warmup": COUNT,
    "train.accum_steps": 2**20, "train.seed": SEED, "train.log_every": COUNT, "train.eval_every": COUNT,
    "train.save_every": COUNT, "train.keep_last": COUNT, "train.patience": COUNT, "train.average_last": 2**20,
    "train.threads": 4096, "train.lr": 1e3, "train.lr_scale": 1e6,
    "train.clip_norm": 1e12, "train.weight_decay": 1e3,
    "decode.beam": 1024, "decode.nbest": 1024, "decode.alpha": 1e3, "decode.max_len_a": 1e3, "decode.max_len_b": 2**20,
    "decode.min_len": 2**20, "decode.no_repeat_ngram": 2**20, "decode.temperature": 1e4, "decode.top_k": 2**24,
    "decode.seed": SEED, "decode.max_new_tokens": 2**20, "decode.max_tokens": 2**31,
    "expect.useful_updates": COUNT,
}


def _check_limits(section: str, obj: Any) -> None:
    """Every field of ``section`` that has a ceiling in :data:`LIMITS` is within it (a one-line ConfigError)."""
    for key, ceiling in LIMITS.items():
        sec, _, name = key.partition(".")
        value = getattr(obj, name) if sec == section else None
        if isinstance(value, float) and not math.isfinite(value):
            _finite(key, value)  # inf / nan: said as such, not as "over the ceiling"
        if value is not None and not isinstance(value, bool) and abs(value) > ceiling:
            digits = str(value) if isinstance(value, int) else ""
            shown = f"{value:.3g}" if isinstance(value, float) else (
                f"{digits[:12]}... ({len(digits)} digits)" if len(digits) > 24 else digits)
            raise ConfigError(f"{key}={shown}: must be at most {ceiling:g}" if isinstance(ceiling, float)
                              else f"{key}={shown}: must be at most {ceiling:,}")


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{name}={value}: expected a finite number")


def _at_least(name: str, value: float, low: float, note: str = "") -> None:
    _finite(name, value)
    if value < low:
        raise ConfigError(f"{name}={value}: must be >= {low}" + (f" {note}" if note else ""))


def _positive(name: str, value: float) -> None:
    _finite(name, value)
    if value <= 0:
        raise ConfigError(f"{name}={value}: must be > 0")


def _fraction(name: str, value: float) -> None:
    """A probability-like value in [0, 1): dropout, label smoothing, Adam's betas."""
    _finite(name, value)
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{name}={value}: expected a number in [0, 1)")


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(map(str, allowed))}")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check (and mildly coerce: int -> float, str -> number from --set) a value against its hint."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{where}: may not be null")
    if args and type(None) in args:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            value = [value]  # --set train.log_to=tensorboard: one item
        return [_coerce(v, args[0], where) for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value
