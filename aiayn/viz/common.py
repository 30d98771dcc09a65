"""What every figure shares: exact pixel sizes, saving, and the optional window.

Figures are made with pyplot so that ``--show`` can open them, but the backend is Agg unless a
window was asked for (``use_backend``), so nothing needs a display to write a PNG.
Sizes are in pixels: figure size = pixels / DPI inches, saved at that DPI and without
``bbox_inches="tight"`` (which would crop and change the size); ``layout="constrained"`` keeps the
labels inside the canvas instead.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import matplotlib
import numpy as np

from aiayn.config import Config, ConfigError, load_config
from aiayn.files import atomic_write_bytes

DPI = 100
MAX_PIXELS = 16384  # a side's most pixels: a 16384 x 16384 RGBA canvas is 1 GiB already
log = logging.getLogger("aiayn.viz")


def use_backend(show: bool) -> None:
    """Agg (files only) unless ``show``; with ``show`` keep matplotlib's choice of an interactive backend."""
    if not show:
        matplotlib.use("Agg", force=True)


def check_size(width: int | None, height: int | None) -> None:
    """ConfigError unless the figure size asked for (None: the figure's default) is 50 to :data:`MAX_PIXELS` pixels
    a side: checked before any work (matplotlib's Agg refuses past 2**16 a side, after minutes of drawing)."""
    for name, v in (("--width", width), ("--height", height)):
        if v is not None and not 50 <= v <= MAX_PIXELS:
            raise ConfigError(f"viz: {name} {v} px: a figure is 50 to {MAX_PIXELS} pixels a side")


def new_figure(width: int | None, height: int | None, default: tuple[int, int]):
    """A pyplot figure of exactly ``width`` x ``height`` pixels (``default`` where None)."""
    import matplotlib.pyplot as plt

    w, h = width or default[0], height or default[1]
    check_size(w, h)
    # A thousandth of a pixel more so that float rounding can never lose a pixel.
    return plt.figure(figsize=((w + 1e-3) / DPI, (h + 1e-3) / DPI), dpi=DPI, layout="constrained")


def save_figure(fig, out: str | Path, show: bool = False) -> Path:
    """Write ``fig`` as a PNG at its exact pixel size, atomically (a reader, or a kill, never sees half a file);
    close it unless it is to be shown."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    if not show:
        plt.close(fig)
    return atomic_write_bytes(out, buf.getvalue())


def show_figures() -> None:
    """Open the figures still open in windows, if the backend can; otherwise say so."""
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend().lower()
    if backend in ("agg", "pdf", "ps", "svg", "cairo", "template") or "inline" in backend:
        log.warning("--show: no interactive matplotlib backend here (%s); the PNG is written", backend)
        plt.close("all")
        return
    plt.show()


def heatmap(ax, data: np.ndarray, title: str, xlabel: str, ylabel: str, symmetric: bool = False,
            colorbar: bool = True, **imshow):
    """imshow of a 2-d array with origin top-left (row 0 at the top, like a printed matrix); ``imshow``: more
    of its options (``cmap`` viridis unless given)."""
    data = np.asarray(data, dtype=np.float64)
    if symmetric:
        lim = float(np.nanmax(np.abs(data))) or 1.0
        imshow.setdefault("vmin", -lim)
        imshow.setdefault("vmax", lim)
    imshow.setdefault("cmap", "viridis")
    im = ax.imshow(data, aspect="auto", interpolation="nearest", **imshow)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    return im


def suptitle(fig, text: str, fontsize: int = 12) -> None:
    """A figure title wrapped to the figure's width (about 0.55 em per character)."""
    width_px = fig.get_figwidth() * fig.dpi
    chars = max(20, int(width_px / (0.55 * fontsize * fig.dpi / 72)))
    lines = [w for line in text.splitlines() for w in (textwrap.wrap(line, chars) or [""])]
    fig.suptitle("\n".join(lines), fontsize=fontsize)


def config_of(source: str | Path) -> tuple[Config, str]:
    """(config, name) of a run directory (its config.yaml), a YAML recipe or a preset name."""
    p = Path(source)
    if p.is_dir():
        if not (p / "config.yaml").exists():
            raise ConfigError(f"{p}: no config.yaml (is it a run directory?)")
        return load_config(p / "config.yaml"), p.name
    cfg = load_config(source)
    return cfg, (p.stem if p.suffix in (".yaml", ".yml") else str(source))
