"""``aiayn viz WHAT``: compute a figure's data with the library functions, then draw it to a PNG.

positional [--d-model 512] [--max-pos 128] [--compare]   -> positional.png
attention RUN --src TEXT [--tgt TEXT] [--layer L] [--head H]
                                     -> attention_encoder.png, attention_decoder_self.png, attention_cross.png
schedule [RUN | CONFIG | PRESET] [--d-model D] [--warmup W]  -> schedule.png
curves RUN                                                -> curves.png
mask [--len 8]                                            -> mask.png
model [RUN | CONFIG | PRESET]                             -> model.png (Figure 1 with its N, d_model, h, d_ff)

``--out`` names the PNG (for attention: the stem of the three files); ``--width/--height`` in pixels.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.config import ConfigError
from aiayn.files import guard_output


def _out(args: argparse.Namespace, what: str) -> Path:
    """The PNG ``--out`` names (default WHAT.png), through the output guard: never the run or its files, never an
    existing file that is not a PNG (checked again for each name attention derives from it)."""
    out = Path(args.out) if args.out else Path(f"{what}.png")
    return guard_output(out, "png", _inputs(args), "--out")


def _inputs(args: argparse.Namespace) -> list[str]:
    return [args.run] if args.run is not None else []


def _positional(args: argparse.Namespace) -> list[Path]:
    from aiayn.viz.positional import ENCODINGS, plot_positional, positional_views

    d_model = 512 if args.d_model is None else args.d_model  # --d-model 0 is refused, not the default
    kinds = list(ENCODINGS) if args.compare else ["sinusoidal"]
    out = _out(args, "positional")
    views = {k: positional_views(k, d_model, args.max_pos) for k in kinds}
    return [plot_positional(views, out, d_model, args.width, args.height, args.show)]


def _attention(args: argparse.Namespace) -> list[Path]:
    from aiayn.viz.attention import KINDS, attention_data, output_paths, plot_attention, select

    if args.run is None:
        raise ConfigError("viz attention: give the run directory: aiayn viz attention RUN --src TEXT")
    if args.src is None:
        raise ConfigError("viz attention: --src TEXT is required")
    stem = Path(args.out) if args.out else Path("attention.png")  # a stem: only the names derived from it are written
    for path in output_paths(stem, KINDS).values():  # every derived name, before the model is loaded
        guard_output(path, "png", _inputs(args), "--out")
    data = select(attention_data(args.run, args.src, args.tgt, args.device), args.layer, args.head)
    tgt_note = " (the model's greedy translation)" if data.generated else ""
    subtitle = f"{Path(args.run).name}: source {data.src!r}"
    if data.tgt is not None:
        subtitle += f" -> target {data.tgt!r}{tgt_note}"
    paths = output_paths(stem, data.maps)
    return [plot_attention(data.maps[k], paths[k], subtitle, args.width, args.height, args.show)
            for k in KINDS if k in data.maps]


def _schedule(args: argparse.Namespace) -> list[Path]:
    from aiayn.viz.schedule import plot_schedule, schedule_data

    out = _out(args, "schedule")
    curves = schedule_data(args.run, args.d_model, args.warmup)
    return [plot_schedule(curves, out, args.width, args.height, args.show)]


def _curves(args: argparse.Namespace) -> list[Path]:
    from aiayn.viz.curves import curves_data, plot_curves

    if args.run is None:
        raise ConfigError("viz curves: give the run directory (or its metrics.jsonl): aiayn viz curves RUN")
    out = _out(args, "curves")
    data = curves_data(args.run)
    p = Path(args.run)
    name = p.name if p.is_dir() else p.parent.name
    return [plot_curves(data, out, name, args.width, args.height, args.show)]


def _mask(args: argparse.Namespace) -> list[Path]:
    from aiayn.viz.mask import causal_mask_matrix, plot_mask

    out = _out(args, "mask")
    return [plot_mask(causal_mask_matrix(args.length), out, args.width, args.height, args.show)]


def _model(args: argparse.Namespace) -> list[Path]:
    from aiayn.viz.model import model_diagram, plot_model

    out = _out(args, "model")
    return [plot_model(model_diagram(args.run or "paper-base"), out, args.width, args.height,
                       args.show)]


COMMANDS = {"positional": _positional, "attention": _attention, "schedule": _schedule,
            "curves": _curves, "mask": _mask, "model": _model}


def viz_cli(args: argparse.Namespace) -> int:
    """Write the figure(s) ``args.what`` asks for, print their paths, open them with ``--show``."""
    from aiayn.viz.common import check_size, show_figures, use_backend

    if args.what not in COMMANDS:
        raise ConfigError(f"viz: unknown figure {args.what!r} (expected one of {', '.join(COMMANDS)})")
    if args.what in ("positional", "mask") and args.run is not None:
        raise ConfigError(f"viz {args.what}: takes no RUN argument (got {args.run!r})")
    check_size(args.width, args.height)
    use_backend(args.show)
    for path in COMMANDS[args.what](args):
        print(f"wrote {path}")
    if args.show:
        show_figures()
    return 0
