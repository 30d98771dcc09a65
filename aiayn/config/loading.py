"""Configs from files and words: presets, YAML recipes (duplicate keys refused), ``--set`` overrides with their values
coerced to each field's type, the run's own config.yaml read back and written atomically."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from aiayn.config.checks import _coerce
from aiayn.config.schema import Config, ModelConfig
from aiayn.errors import ConfigError, did_you_mean, first_line
from aiayn.files import read_bounded

YAML_MAX_BYTES = 16 << 20  # a recipe or a grid: a few kB

# Presets ship inside the package (a wheel install has them); the repository's configs/ links here.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# Keys that moved to another section, old name -> new name. Each YAML file is migrated when read, so a run directory
# written before the move still loads (and resumes); on the command line an old name is refused with its new one.
MOVED_KEYS = {"train.reference_bleu": "expect.bleu", "train.useful_updates": "expect.useful_updates"}


def migrate(values: dict[str, Any], where: str) -> dict[str, Any]:
    """A copy of one file's mapping with each key of :data:`MOVED_KEYS` at its new place; a file that gives a
    setting under both names is a ConfigError naming ``where``."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in values.items()}
    for old, new in MOVED_KEYS.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        target = out.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # not a mapping: _build says so
        if new_key in target:
            raise ConfigError(f"{where}: {old} and {new} are one setting (it moved to {new}): give it once")
        target[new_key] = section.pop(old_key)
    return out


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from a dict, recursing into nested sections; reject unknown keys."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        prefix = f"{where}." if where else ""
        if f"{prefix}{unknown[0]}" in MOVED_KEYS:
            raise ConfigError(f"config key {prefix}{unknown[0]} is now {MOVED_KEYS[prefix + unknown[0]]}")
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]}{did_you_mean(unknown[0], known)} "
            f"(known: {', '.join(sorted(known))})"
        )
    kwargs = {}
    for key, value in values.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{where}.{key}" if where else key)
        else:
            kwargs[key] = _coerce(value, hint, f"{where}.{key}" if where else key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - defensive, fields are checked above
        raise ConfigError(str(e)) from None




def config_from_dict(values: dict[str, Any]) -> Config:
    """Build a validated :class:`Config` from nested dicts (as read from YAML)."""
    return _build(Config, values or {}, "")


def model_config(preset_or_values: str | dict[str, Any] | None = None, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a preset name in ``configs/`` (e.g. ``"paper-base"``) or a dict.

    >>> cfg = model_config("tiny", vocab_size=100)
    """
    values: dict[str, Any] = {}
    if isinstance(preset_or_values, str):
        values = dict(load_yaml(resolve_config_path(preset_or_values)).get("model", {}))
    elif isinstance(preset_or_values, dict):
        values = dict(preset_or_values)
    values.update(overrides)
    return _build(ModelConfig, values, "model")


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path as given, or a preset name looked up in ``configs/`` (``paper-base`` -> configs/paper-base.yaml)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    for candidate in (CONFIG_DIR / f"{name_or_path}.yaml", CONFIG_DIR / str(name_or_path)):
        if candidate.exists():
            return candidate
    presets = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))) if CONFIG_DIR.exists() else ""
    raise ConfigError(f"config {name_or_path}: no such file or preset (presets: {presets})")


def preset_summary(path: str | Path) -> str:
    """A recipe's one-line summary: the first line of the comment at the top of its YAML file."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if line.strip("# "):
            return line.lstrip("# ").rstrip()
    return ""


def list_presets() -> list[tuple[str, str]]:
    """(name, one-line summary) of every recipe in ``configs/``, by name."""
    return [(p.stem, preset_summary(p)) for p in sorted(CONFIG_DIR.glob("*.yaml"))]


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping naming one key twice is an error: PyYAML keeps the last
    value silently, so a recipe edited by hand could train with a setting its reader does not see."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: the key {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, where: str) -> Any:
    """YAML text as Python values; what PyYAML cannot read, what it reads into a crash (nesting deeper than the
    interpreter's stack, an integer longer than Python converts), and a key given twice in one mapping, is one
    ConfigError naming ``where``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion", ...
        why = "an integer too long to be a setting" if "digits" in str(e) else first_line(e)
        raise ConfigError(f"{where}: holds {why}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file; a directory, a binary file, bad UTF-8 or bad YAML is a one-line ConfigError."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a YAML file")
    try:  # a missing or unreadable file: OSError naming it, one line at the command line
        raw = read_bounded(p, YAML_MAX_BYTES)
    except ValueError as e:  # a symlink to /dev/zero, a pipe, a file far larger than any config
        raise ConfigError(f"{path}: not a YAML file ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        bad = raw[e.start]
        raise ConfigError(f"{path}: not a YAML file (line {line}: byte 0x{bad:02x} is not valid UTF-8)") from None
    data = _parse_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=v`` strings; ``v`` is parsed as YAML (so 0.1, true, [0.9, 0.98] work)."""
    out = dict(values)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = _parse_yaml(raw, f"--set {key}")
        except ConfigError as e:
            if "not valid YAML" not in str(e):
                raise
            value = raw
        node: dict[str, Any] = {}
        cur = node
        parts = key.strip().split(".")
        for p in parts[:-1]:
            cur[p] = {}
            cur = cur[p]
        cur[parts[-1]] = value
        out = _merge(out, node)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe (which may name a ``base:`` preset to extend) and apply ``--set`` overrides."""
    values = apply_overrides(_recipe_values(path, ()), overrides or [])
    return config_from_dict(values)


def recipe_values(path: str | Path) -> dict[str, Any]:
    """A recipe's own values as written (its ``base:`` chain merged), before defaults fill the rest: what it sets."""
    return _recipe_values(path, ())


def _recipe_values(path: str | Path, extending: tuple[Path, ...]) -> dict[str, Any]:
    """A recipe's values merged over those of its ``base:``, and of that one's base, and so on (``extending``:
    the files already on the chain, so that a base that leads back to one of them is refused, not followed)."""
    where = resolve_config_path(path).resolve()
    if where in extending:
        raise ConfigError(f"{extending[-1]}: base: {path} leads back to {where} (a recipe cannot extend itself)")
    values = migrate(load_yaml(where), str(path))
    base = values.pop("base", None)
    if base is None:
        return values
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected the name or path of a config to extend, got {base!r:.60}")
    return _merge(_recipe_values(base, (*extending, where)), values)


def read_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> Config:
    """RUN/config.yaml (with ``overrides``) as a validated config; a file that is not UTF-8, not YAML or not a
    valid config is a one-line CheckpointError naming it."""
    from aiayn.errors import CheckpointError

    cfg_path = Path(run_dir) / "config.yaml"
    try:
        return load_config(cfg_path, overrides)
    except ConfigError as e:
        msg = str(e)
        raise CheckpointError(msg if msg.startswith(str(cfg_path)) else f"{cfg_path}: {msg}") from None


def save_config(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as YAML to ``path`` atomically (a run reads its config.yaml back: never half-written)."""
    from aiayn.files import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
