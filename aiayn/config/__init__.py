"""Typed configuration: model, data, training, decoding and expectation sections, YAML presets, ``--set`` overrides.

Unknown keys are an error (a typo in a recipe must not be silently ignored), and impossible model
shapes are rejected when the config is built, not deep inside a forward pass. A config is resolved once
and read-only after (frozen dataclasses): what training learns later (the model fitted to the tokenizer's
vocabulary, a run to start from) comes back as a new config (``dataclasses.replace``), never a mutation.

The package: :mod:`aiayn.config.schema` (the sections; whether a model fits this machine's memory),
:mod:`aiayn.config.checks` (limits, checks, coercion) and :mod:`aiayn.config.loading` (presets, YAML, ``--set``,
the run's config.yaml). Import the names from ``aiayn.config``.
"""

from aiayn.config.checks import (
    COUNT,
    LIMITS,
    MIN_TEMPERATURE,
    SEED,
)
from aiayn.config.loading import (
    CONFIG_DIR,
    MOVED_KEYS,
    apply_overrides,
    config_from_dict,
    list_presets,
    load_config,
    load_yaml,
    migrate,
    model_config,
    preset_summary,
    read_run_config,
    recipe_values,
    resolve_config_path,
    save_config,
)
from aiayn.config.schema import (
    COMPILE_MODES,
    DECODE_HINTS,
    DEFAULT_DECODE_TOKENS,
    LENGTH_PENALTIES,
    LOG_BACKENDS,
    PRETOKENIZERS,
    SDPA_BACKENDS,
    SPEED_KEYS,
    STOP_RULES,
    Config,
    DataConfig,
    DecodeConfig,
    DecodeOptions,
    ExpectConfig,
    ModelConfig,
    TrainConfig,
)
from aiayn.errors import ConfigError

__all__ = [
    "COMPILE_MODES", "CONFIG_DIR", "COUNT", "Config", "ConfigError", "DECODE_HINTS", "DEFAULT_DECODE_TOKENS",
    "SDPA_BACKENDS", "SPEED_KEYS", "DataConfig", "DecodeConfig", "DecodeOptions", "ExpectConfig",
    "LENGTH_PENALTIES", "LIMITS",
    "LOG_BACKENDS", "MIN_TEMPERATURE", "MOVED_KEYS", "ModelConfig", "PRETOKENIZERS", "SEED", "STOP_RULES",
    "TrainConfig", "apply_overrides", "config_from_dict", "list_presets",
    "load_config", "load_yaml", "migrate", "model_config", "preset_summary", "read_run_config",
    "recipe_values", "resolve_config_path", "save_config",
]
