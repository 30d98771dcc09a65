"""The targets of ``aiayn export``, each registered once under its name with what it supports.

A target (:class:`ExportTarget`) declares the tasks it takes, the ``aiayn export`` options it reads, and for
model options (fields of :class:`aiayn.config.ModelConfig`) the values it holds. :func:`export` checks a run
against that before the exporter runs: a task, an option or a model value the target does not declare is refused
in one line (:class:`~aiayn.errors.ConfigError`) and nothing is written. The model's options are read from the
config's fields, not listed here: a field a target does not declare must keep its default (the paper's value), so a
new ``ModelConfig`` field is refused by every target until one declares it, with no exporter edited.
The command line (its choices and help) and docs/architecture.md's table are read from :data:`TARGETS`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiayn.config as _config
from aiayn.config import ModelConfig
from aiayn.errors import ConfigError


@dataclass(frozen=True)
class Supports:
    """The values of one model option a target holds: ``values`` (empty: any), or ``test``, a check of the whole
    model config (for options that only mean something together, as d_k with d_model and n_heads). ``why`` is the
    refusal, formatted with ``value`` and ``cfg`` (the model config)."""

    values: tuple[Any, ...] = ()
    test: Callable[[ModelConfig], bool] | None = None
    why: str = ""
    label: str = ""  # what ``test`` accepts, for the docs' table

    def holds(self, cfg: ModelConfig, name: str) -> bool:
        if self.test is not None:
            return self.test(cfg)
        return not self.values or getattr(cfg, name) in self.values

    def shown(self) -> str:
        """How docs/architecture.md's table writes it."""
        if self.test is not None:
            return self.label
        return " or ".join(str(v) for v in self.values) if self.values else "any"


ANY = Supports()
# The sizes and rates of the model: every target carries whatever values they have.
SIZES: Mapping[str, Supports] = {name: ANY for name in (
    "vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers",
    "dropout", "attention_dropout", "activation_dropout", "max_positions", "pad_id")}


@dataclass(frozen=True)
class ExportTarget:
    """One ``aiayn export NAME RUN OUT`` target.

    ``run``: the exporter, ``run(run_dir, out, force=..., **options)`` -> the path written, or ``"module:function"``
    imported when used (an exporter's own dependencies load only then). ``title``: how a message names what it
    writes. ``help``: one line for ``aiayn export --help``. ``tasks``: the ``task:`` values it takes. ``options``:
    the ``aiayn export`` options it reads (``quantization``, ``sentence_model``). ``model``: the model options it
    declares (:class:`Supports`); any other keeps its default."""

    name: str
    run: Callable[..., Path] | str
    title: str
    help: str
    tasks: frozenset[str] = frozenset({"translation"})
    options: frozenset[str] = frozenset()
    model: Mapping[str, Supports] = field(default_factory=lambda: dict(SIZES))

    def exporter(self) -> Callable[..., Path]:
        if not isinstance(self.run, str):
            return self.run
        module, name = self.run.split(":")
        return getattr(importlib.import_module(module), name)


TARGETS: dict[str, ExportTarget] = {}


def register(target: ExportTarget) -> ExportTarget:
    """Add ``target`` under its name (once: a second target of the same name is a bug)."""
    if target.name in TARGETS:
        raise ValueError(f"export target {target.name!r} is registered twice")
    TARGETS[target.name] = target
    return target


def refusal(target: ExportTarget, cfg: ModelConfig) -> str | None:
    """Why ``target`` cannot hold a model of ``cfg`` (the first option it does not declare), or None."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        supports = target.model.get(f.name)
        if supports is None:
            if value != _default(f):
                return (f"{target.title} do not hold model.{f.name}={value!r} (only its default, "
                        f"{_default(f)!r}: aiayn export {target.name} does not declare this option)")
        elif not supports.holds(cfg, f.name):
            return supports.why.format(value=value, cfg=cfg)
    return None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def check_options(target: ExportTarget, options: Mapping[str, Any]) -> None:
    """Refuse an option given (not None) that ``target`` does not read, naming the targets that do."""
    for option, value in options.items():
        if value is not None and option not in target.options:
            takers = [t for t in TARGETS.values() if option in t.options]
            flag = "--" + option.replace("_", "-")
            raise ConfigError(f"{flag} is for {' and '.join(t.title for t in takers)} "
                              f"(aiayn export {'/'.join(t.name for t in takers)})")


def check_run(target: ExportTarget, run_dir: str | Path) -> None:
    """Refuse a run whose task or model ``target`` does not declare. A directory without config.yaml is left to
    the exporter, which says what it is not."""
    if not (Path(run_dir) / "config.yaml").is_file():
        return
    cfg = _config.read_run_config(run_dir)
    if cfg.task not in target.tasks:
        raise ConfigError(f"{run_dir}: a {cfg.task} run; {target.title} hold "
                          f"{' and '.join(sorted(target.tasks))} models")
    why = refusal(target, cfg.model)
    if why is not None:
        raise ConfigError(f"cannot export {run_dir} to {target.name}: {why}")


def check(name: str, run_dir: str | Path) -> None:
    """Refuse a run that target ``name`` does not declare (:func:`check_run`): what each exporter's Python function
    calls first, so that a direct call refuses as ``aiayn export`` does."""
    check_run(TARGETS[name], run_dir)


def check_model(name: str, model: Any, what: str) -> None:
    """Refuse a model object (a direct Python call that passes one) that target ``name`` cannot hold: one whose
    architecture none of the tasks it declares builds (:attr:`aiayn.task.Task.architecture`). A TypeError,
    ``what`` the function that refuses: "to_hf_marian converts an encoder-decoder Transformer, got DecoderOnlyLM"."""
    from aiayn.model.transformer import ARCHITECTURES
    from aiayn.task import task_named

    held = sorted({task_named(t).architecture for t in TARGETS[name].tasks})
    if getattr(model, "architecture", None) not in held:
        kinds = " or ".join(f"an {a} {ARCHITECTURES[a].__name__}" for a in held)
        raise TypeError(f"{what} {kinds}, got {type(model).__name__}")


def export(name: str, run_dir: str | Path, out: str | Path, *, force: bool = False, **options: Any) -> Path:
    """``aiayn export NAME RUN OUT``: check the options and the run against the target's declarations (one line
    on refusal, nothing written), then run its exporter with the options it reads; return what it wrote."""
    target = TARGETS[name]
    check_options(target, options)
    check_run(target, run_dir)
    given = {k: v for k, v in options.items() if k in target.options}
    return target.exporter()(run_dir, out, force=force, **given)


def option_help(option: str) -> str:
    """Which targets read ``option``, for its ``--help`` line."""
    return " and ".join(t.name for t in TARGETS.values() if option in t.options)


def features_table() -> str:
    """docs/architecture.md's table of the targets and the model options each declares beyond the sizes."""
    names = sorted({k for t in TARGETS.values() for k, s in t.model.items() if s is not ANY or k not in SIZES})
    rows = ["| target | writes | tasks | options | " + " | ".join(f"`{n}`" for n in names) + " |",
            "|---" * (4 + len(names)) + "|"]
    for t in TARGETS.values():
        cells = [t.model[n].shown() if n in t.model else "default" for n in names]
        rows.append(f"| `{t.name}` | {t.title} | {', '.join(sorted(t.tasks))} | "
                    f"{', '.join(sorted(t.options)) or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


_HEADS = ("heads are d_model / heads wide: model.d_k={cfg.key_width}, model.d_v={cfg.value_width} with "
          "d_model={cfg.d_model} and {cfg.n_heads} heads cannot be exported")
_ENCODER_DECODER = {"activation": ANY, "scale_embeddings": ANY, "share_embeddings": ANY, "tie_output": ANY,
                    "output_bias": ANY}
_DEFAULT_WIDTHS = "d_model / heads"
_CT2 = {**SIZES, **_ENCODER_DECODER, "norm_first": ANY, "layer_norm_eps": ANY, "positional": ANY,
        "positional_layout": ANY,
        "n_encoder_layers": Supports(test=lambda c: c.n_encoder_layers > 0, label="1 or more",
                                     why="CTranslate2 needs at least one encoder layer (model.n_encoder_layers=0)"),
        **{k: Supports(test=lambda c: c.default_head_widths, label=_DEFAULT_WIDTHS,
                       why="CTranslate2's Transformer " + _HEADS) for k in ("d_k", "d_v")}}

register(ExportTarget(
    name="ctranslate2", run="aiayn.interop.ctranslate2:export_run", title="CTranslate2 models",
    help="a CTranslate2 model directory", tasks=frozenset({"translation", "summarization"}),
    options=frozenset({"quantization"}), model=_CT2))
register(ExportTarget(
    name="hf", run="aiayn.interop.hf:export_hf", title="Hugging Face Marian directories",
    help="a Marian directory for transformers", tasks=frozenset({"translation", "summarization"}),
    model={**SIZES, **_ENCODER_DECODER, "positional_layout": ANY,  # sinusoids are laid out as Marian's on export
           "norm_first": Supports((False,), why="Marian is post-LN: set model.norm_first=false (a pre-LN model has "
                                                "no Marian form)"),
           "positional": Supports(("sinusoidal",), why="Marian has fixed sinusoidal positions only: "
                                  "model.positional={value!r} cannot be converted (set model.positional=sinusoidal "
                                  "and retrain)"),
           "layer_norm_eps": Supports((1e-5,), why="Marian's LayerNorm epsilon is fixed at 1e-05: set "
                                      "model.layer_norm_eps=1e-05 (got {value})"),
           **{k: Supports(test=lambda c: c.default_head_widths, label=_DEFAULT_WIDTHS, why="Marian's " + _HEADS)
              for k in ("d_k", "d_v")}}))
register(ExportTarget(
    name="argos", run="aiayn.interop.argos:export_argos", title="Argos packages", help="an .argosmodel package",
    options=frozenset({"quantization", "sentence_model"}), model=_CT2))
