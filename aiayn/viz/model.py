"""The model itself, drawn as the paper's Figure 1 with a run's own sizes: the encoder and decoder stacks (N of each),
multi-head attention with its h heads of width d_k / d_v, the feed-forward width d_ff, the embeddings and
positions, and the output projection; a language model (no encoder) as its decoder column alone, without the
encoder-decoder attention. The numbers come from the run's config.yaml (or a recipe or preset), and the parameter
count from the model those numbers build (on PyTorch's meta device: no memory, no weights read).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from aiayn.config import Config, ModelConfig, recipe_values
from aiayn.model import build_model, count_parameters
from aiayn.viz.common import config_of, new_figure, save_figure, suptitle


@dataclass(frozen=True, kw_only=True)
class ModelDiagram:
    """What Figure 1 shows, for one config: the stacks' depths, the widths, the embeddings and the norm's place."""

    name: str
    n_encoder: int  # N of the encoder (0: a decoder-only language model)
    n_decoder: int
    d_model: int
    heads: int
    d_k: int
    d_v: int
    d_ff: int
    activation: str
    positional: str  # sinusoidal (section 3.5) | learned | rotary (not in the paper)
    norm_first: bool  # pre-LN (norm before each sub-layer, one more at the top) instead of the paper's post-LN
    dropout: float
    src_vocab: int
    tgt_vocab: int
    shared_embeddings: bool
    tied_output: bool
    parameters: int


def model_diagram(source: str | Path = "paper-base") -> ModelDiagram:
    """The diagram's numbers of a run directory, a YAML recipe or a preset name (default: the paper's base)."""
    cfg, name = config_of(source)
    m = recipe_vocabulary(cfg, source)
    with torch.device("meta"):  # the parameter count of exactly this architecture, without allocating it
        model = build_model(m, cfg.task)
    parameters = count_parameters(model)
    return ModelDiagram(name=name, n_encoder=model.encoder_layers, n_decoder=m.n_decoder_layers, d_model=m.d_model,
                        heads=m.n_heads, d_k=m.d_k or m.d_model // m.n_heads, d_v=m.d_v or m.d_model // m.n_heads,
                        d_ff=m.d_ff, activation=m.activation, positional=m.positional, norm_first=m.norm_first,
                        dropout=m.dropout, src_vocab=m.vocab_size, tgt_vocab=m.tgt_vocab_size or m.vocab_size,
                        shared_embeddings=m.share_embeddings, tied_output=m.tie_output, parameters=parameters)


def recipe_vocabulary(cfg: Config, source: str | Path) -> ModelConfig:
    """The model ``source`` trains. A run directory's config holds the sizes its tokenizer gave; a recipe's model
    vocabulary is only a request, which training replaces by the tokenizer's (``data.vocab_size`` pieces of BPE,
    :func:`~aiayn.data.pipeline.fit_model_to_vocab`) unless the recipe sets ``model.vocab_size`` itself (the
    paper's presets: 37,000). A character vocabulary is known only once trained: the model's number stays."""
    if Path(source).is_dir() or cfg.data.tokenizer != "bpe" or "vocab_size" in recipe_values(source).get("model", {}):
        return cfg.model
    v = cfg.data.vocab_size
    return dataclasses.replace(cfg.model, vocab_size=v, tgt_vocab_size=None if cfg.data.shared_vocab else v)


def stack_labels(d: ModelDiagram, encoder: bool) -> list[str]:
    """One stack's boxes, bottom to top, as the figure labels them (the paper's names, this config's sizes)."""
    norm = "Norm, then the sub-layer; Add" if d.norm_first else "Add & Norm"
    attention = f"Multi-Head Attention\nh = {d.heads}, d_k = {d.d_k}, d_v = {d.d_v}"
    ffn = f"Feed Forward\nd_ff = {d.d_ff}, {d.activation}"
    if encoder:
        return [attention, norm, ffn, norm]
    cross = [f"Multi-Head Attention (encoder-decoder)\nh = {d.heads}, d_k = {d.d_k}, d_v = {d.d_v}", norm]
    return [f"Masked {attention}", norm, *(cross if d.n_encoder else []), ffn, norm]


def title(d: ModelDiagram) -> str:
    kind = "encoder-decoder" if d.n_encoder else "decoder-only language model"
    layers = f"N = {d.n_encoder} + {d.n_decoder}" if d.n_encoder else f"N = {d.n_decoder}"
    return (f"{d.name}: the Transformer of Figure 1 (Vaswani et al., 2017) with this config's sizes, {kind}: "
            f"{layers}, d_model = {d.d_model}, h = {d.heads}, d_ff = {d.d_ff}, P_drop = {d.dropout:g}, "
            f"{'pre-LN' if d.norm_first else 'post-LN (the paper)'}; {d.parameters / 1e6:.2f}M parameters")


def _box(ax, x: float, y: float, w: float, h: float, text: str, colour: str) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.004,rounding_size=0.01", facecolor=colour,
                                edgecolor="#333333", linewidth=1.0))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)


def _arrow(ax, x0: float, y0: float, x1: float, y1: float) -> None:
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={"arrowstyle": "->", "color": "#333333", "lw": 1.0})


COLOURS = {"attention": "#fce5b6", "norm": "#f4f4b0", "ffn": "#c9e7f5", "embedding": "#f7c9c9", "linear": "#d7d2ee"}


def _colour(label: str) -> str:
    return (COLOURS["attention"] if "Attention" in label else COLOURS["ffn"] if "Feed" in label
            else COLOURS["norm"])


def positions_label(d: ModelDiagram) -> str:
    """What the figure says above the embeddings: the positions added there (sinusoidal, learned), or that
    rotary positions are not added but turn each self-attention's queries and keys."""
    if d.positional == "rotary":
        return "(rotary positions: self-attention turns Q and K)"
    return f"+ {d.positional.capitalize()} Positional Encoding"


def _column(ax, d: ModelDiagram, x: float, encoder: bool) -> tuple[float, float]:
    """One column (embedding, positions, the N x stack), bottom to top; returns the y of the stack's top and of
    its cross-attention box (decoder) or output (encoder)."""
    w, h, gap = 0.34, 0.052, 0.018
    vocab = d.src_vocab if encoder else d.tgt_vocab
    below = "Inputs (source pieces)" if encoder else "Outputs (shifted right)" if d.n_encoder else "The text so far"
    ax.text(x + w / 2, 0.025, below, ha="center", fontsize=8.5)
    embedding = "Input" if encoder else "Output" if d.n_encoder else "Token"
    _box(ax, x, 0.06, w, h, f"{embedding} Embedding\n{vocab:,} x {d.d_model}", COLOURS["embedding"])
    ax.text(x + w / 2, 0.145, positions_label(d), ha="center", fontsize=8.5)
    labels = stack_labels(d, encoder)
    y, cross = 0.19, 0.0
    stack_bottom = y - 0.012
    for label in labels:
        _box(ax, x + 0.02, y, w - 0.04, h, label, _colour(label))
        if "encoder-decoder" in label:
            cross = y + h / 2
        y += h + gap
    top = y - gap + 0.012
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, stack_bottom), w, top - stack_bottom, fill=False, edgecolor="#777777", lw=1.2))
    n = d.n_encoder if encoder else d.n_decoder
    ax.text(x - 0.012 if encoder else x + w + 0.012, (stack_bottom + top) / 2, f"N = {n}x", fontsize=10,
            ha="right" if encoder else "left", va="center", fontweight="bold")
    _arrow(ax, x + w / 2, 0.06 + h, x + w / 2, stack_bottom)
    return top, cross


def plot_model(d: ModelDiagram, out: str | Path, width: int | None = None, height: int | None = None,
               show: bool = False) -> Path:
    """Figure 1 with ``d``'s numbers: the encoder column on the left, the decoder's on the right (alone, centred,
    for a language model), the encoder's output into every decoder layer's encoder-decoder attention, then the
    linear projection and the softmax."""
    fig = new_figure(width, height, (1000, 900))
    ax = fig.add_subplot()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 0.8)
    ax.axis("off")
    dec_x = 0.56 if d.n_encoder else 0.33
    if d.n_encoder:
        enc_top, _ = _column(ax, d, 0.08, encoder=True)
    dec_top, cross = _column(ax, d, dec_x, encoder=False)
    if d.n_encoder:  # the encoder's output: up, across, and into every decoder layer's cross-attention
        up, mid = enc_top + 0.025, (0.08 + 0.34 + dec_x) / 2
        ax.plot([0.08 + 0.17, 0.08 + 0.17, mid, mid], [enc_top, up, up, cross], color="#333333", lw=1.0)
        _arrow(ax, mid, cross, dec_x + 0.02, cross)
    tied = ", tied to the output embedding" if d.tied_output else ""
    _box(ax, dec_x, dec_top + 0.03, 0.34, 0.045, f"Linear {d.d_model} x {d.tgt_vocab:,}{tied}", COLOURS["linear"])
    _box(ax, dec_x, dec_top + 0.095, 0.34, 0.04, "Softmax", COLOURS["linear"])
    ax.text(dec_x + 0.17, dec_top + 0.16, "Output Probabilities", ha="center", fontsize=8.5)
    _arrow(ax, dec_x + 0.17, dec_top, dec_x + 0.17, dec_top + 0.03)
    _arrow(ax, dec_x + 0.17, dec_top + 0.075, dec_x + 0.17, dec_top + 0.095)
    if d.norm_first:
        ax.text(dec_x + 0.18, dec_top + 0.008, "pre-LN: a final LayerNorm on each stack's output", ha="left",
                fontsize=7.5, va="bottom")
    suptitle(fig, title(d), fontsize=11)
    return save_figure(fig, out, show)
