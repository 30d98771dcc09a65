"""Training curves from RUN/metrics.jsonl: loss (label-smoothed and NLL, training and validation),
learning rate, and validation BLEU when the run measured it (train.eval_bleu)."""

from __future__ import annotations

from pathlib import Path

from aiayn.train.metrics_log import Series, curves_data

__all__ = ["curves_data", "plot_curves", "plot_seed_curves"]  # curves_data: re-exported for the viz command


def plot_curves(curves: dict[str, Series], out: str | Path, title: str = "", width: int | None = None,
                height: int | None = None, show: bool = False) -> Path:
    """Panels: loss (train/valid x label-smoothed/NLL), learning rate, and BLEU if measured."""
    from aiayn.viz.common import new_figure, save_figure, suptitle

    has_bleu = "valid_bleu" in curves
    n = 3 if has_bleu else 2
    fig = new_figure(width, height, (1500 if has_bleu else 1200, 500))
    axes = fig.subplots(1, n)
    ax = axes[0]
    styles = {  # colour = split, line style = which loss
        "train_loss": ("C0", "-", "", "train, label-smoothed"),
        "train_nll": ("C0", "--", "", "train, NLL"),
        "valid_loss": ("C1", "-", "o", "valid, label-smoothed"),
        "valid_nll": ("C1", "--", "o", "valid, NLL"),
    }
    for k, (color, ls, marker, label) in styles.items():
        if k in curves:
            s = curves[k]
            ax.plot(s.steps, s.values, color=color, linestyle=ls, marker=marker, markersize=4, label=label)
    ax.set_title("Loss per target token (nats)", fontsize=10)
    ax.set_xlabel("update step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    ax = axes[1]
    if "lr" in curves:
        ax.plot(curves["lr"].steps, curves["lr"].values, color="C2")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.set_title("Learning rate", fontsize=10)
    ax.set_xlabel("update step")
    ax.set_ylabel("learning rate")
    ax.grid(alpha=0.3)
    if has_bleu:
        ax = axes[2]
        s = curves["valid_bleu"]
        ax.plot(s.steps, s.values, color="C3", marker="o", markersize=4)
        ax.set_title("Validation BLEU", fontsize=10)
        ax.set_xlabel("update step")
        ax.set_ylabel("BLEU")
        ax.grid(alpha=0.3)
    note = "" if has_bleu else " (no BLEU logged: train.eval_bleu is off)"
    suptitle(fig, f"Training curves{': ' + title if title else ''}{note}")
    return save_figure(fig, out, show)


def plot_seed_curves(runs: dict[str, dict[str, Series]], out: str | Path, title: str = "",
                     width: int | None = None, height: int | None = None) -> Path:
    """Validation BLEU against updates, one line per run (``runs``: label -> its :func:`curves_data`, labels
    "VARIANT seed S"): a colour per variant and a line style per seed, so the spread between seeds is the spread
    between lines of one colour (one variant: a colour per seed). Runs that logged no BLEU (train.eval_bleu off)
    are drawn by their validation NLL instead, in a second panel."""
    from aiayn.viz.common import new_figure, save_figure, suptitle

    with_bleu = {k: c["valid_bleu"] for k, c in runs.items() if "valid_bleu" in c}
    with_nll = {k: c["valid_nll"] for k, c in runs.items() if "valid_bleu" not in c and "valid_nll" in c}
    panels = [(p, what) for p, what in ((with_bleu, "Validation BLEU (greedy, as logged)"),
                                        (with_nll, "Validation NLL (no BLEU logged)")) if p]
    fig = new_figure(width, height, (900 * max(1, len(panels)), 550))
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    variants = list(dict.fromkeys(label.rsplit(" seed ", 1)[0] for label in runs))
    seeds = list(dict.fromkeys(label.rsplit(" seed ", 1)[-1] for label in runs))
    markers, styles = "osD^v<>ph*", ("-", "--", ":", "-.")
    for ax, (series, what) in zip(axes, panels):
        for label, s in series.items():
            variant, seed = label.rsplit(" seed ", 1)[0], label.rsplit(" seed ", 1)[-1]
            i, j = variants.index(variant), seeds.index(seed)
            # One variant: a colour per seed. Several: a colour per variant, a line style and marker per seed.
            ax.plot(s.steps, s.values, color=f"C{(i if len(variants) > 1 else j) % 10}", marker=markers[j % 10],
                    linestyle=styles[j % len(styles)] if len(variants) > 1 else "-", markersize=4, linewidth=1.2,
                    label=label)
        ax.set_title(what, fontsize=10)
        ax.set_xlabel("update step")
        ax.set_ylabel("BLEU" if "BLEU" in what else "NLL (nats per token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    suptitle(fig, f"Seeds{': ' + title if title else ''}")
    return save_figure(fig, out)
