"""Attention maps of a trained run for one sentence: encoder self-attention, masked decoder
self-attention and encoder-decoder attention, each a grid of layers x heads with tokens on the axes.

Shapes: L layers, H heads, Q query positions, K key positions (S source, T target length).
The encoder sees the source pieces + </s>; the decoder's input (its queries) is <s> + target pieces,
so the query row of <s> is the step that predicts the first target piece.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from aiayn.config import Config, ConfigError
from aiayn.data.tokenizer import SPECIAL_PIECES
from aiayn.device import model_device
from aiayn.run.directory import Run, load_run
from aiayn.search import SearchSpec, decode_ids

log = logging.getLogger("aiayn.viz")

KINDS = {
    "encoder": "Encoder self-attention",
    "decoder_self": "Decoder masked self-attention",
    "cross": "Encoder-decoder attention",
}
# Token labels are drawn only up to this many positions per axis (beyond, they would overlap).
MAX_LABELS = 48


@dataclass
class AttentionMaps:
    """One kind of attention: ``weights`` (L, H, Q, K) (rows sum to 1), tick labels per axis, and the
    0-based layer and head numbers that the first two axes hold (all, or the ones selected)."""

    kind: str
    weights: np.ndarray
    queries: list[str]
    keys: list[str]
    layers: list[int]
    heads: list[int]
    predicts: list[str] | None = None  # decoder rows: the token each step predicts (the next input, or </s>)


@dataclass
class AttentionData:
    """The maps of one sentence (pair); ``generated`` when the target is the model's own translation."""

    maps: dict[str, AttentionMaps]
    src: str
    tgt: str | None
    generated: bool


def token_labels(tok, ids: list[int]) -> list[str]:
    """Tick labels: SentencePiece pieces (with their word-start mark) or characters, specials by name."""
    out = []
    for i in ids:
        piece = SPECIAL_PIECES[i] if 0 <= i < len(SPECIAL_PIECES) else tok.id_to_piece(i)
        out.append("\u2423" if piece == " " else piece)  # a visible space for character tokenizers
    return out


def _maps(kind: str, probs: torch.Tensor, queries: list[str], keys: list[str],
          predicts: list[str] | None = None) -> AttentionMaps:
    w = probs[:, 0].double().cpu().numpy()  # (L, 1, H, Q, K) -> (L, H, Q, K)
    return AttentionMaps(kind, w, queries, keys, list(range(w.shape[0])), list(range(w.shape[1])), predicts)


@torch.no_grad()
def attention_data(run: Run | str | Path, src: str, tgt: str | None = None, device: str = "auto") -> AttentionData:
    """Attention probabilities of ``run``'s model for ``src`` (and ``tgt``; None: greedy-decode it), as its
    architecture reads them (:func:`attention_reader`).

    Translation models give {"encoder", "decoder_self", "cross"}; language models {"decoder_self"} over
    the tokens of ``src`` (``tgt`` is ignored). ``device`` is used when ``run`` is a path.
    """
    run = run if isinstance(run, Run) else load_run(run, device)
    if not src or not src.strip():
        raise ConfigError("viz attention: --src TEXT is required and must not be empty")
    return attention_reader(run).read(run, src, tgt)


class StreamAttention:
    """A decoder-only model's maps: its masked self-attention over the tokens of a text (a target is ignored)."""

    def source_room(self, cfg: Config) -> int:
        """The most tokens a text may have."""
        return cfg.model.max_positions

    def target_room(self, cfg: Config) -> int | None:
        """The most tokens a target may have (None: a target is not read)."""
        return None

    @torch.no_grad()
    def read(self, run: Run, src: str, tgt: str | None) -> AttentionData:
        if tgt is not None:
            log.warning("viz attention: %s is a language model; --tgt is ignored", run.path)
        tok, limit = run.tokenizers.src, self.source_room(run.cfg)
        src_ids = tok.encode(src)
        if len(src_ids) > limit:
            raise ConfigError(f"viz attention: --src has {len(src_ids)} tokens, the model takes {limit}")
        probs = run.model.attention_maps(torch.tensor([src_ids], device=model_device(run.model)))
        labels = token_labels(tok, src_ids)
        nxt = labels[1:] + ["\u2026"]  # the last step predicts a token the text does not hold yet
        return AttentionData({"decoder_self": _maps("decoder_self", probs["decoder_self"], labels, labels, nxt)},
                             src, None, False)


class PairAttention:
    """An encoder-decoder's maps: the encoder's self-attention over the source, the decoder's masked
    self-attention and its attention to the source over the target (given, or its greedy translation)."""

    def source_room(self, cfg: Config) -> int:
        return cfg.model.max_positions - 1  # the source ends in EOS

    def target_room(self, cfg: Config) -> int | None:
        return cfg.model.max_positions - 1  # the decoder reads it after its start token

    @torch.no_grad()
    def read(self, run: Run, src: str, tgt: str | None) -> AttentionData:
        model, tok, cfg = run.model, run.tokenizers, run.cfg
        limit, sp, dev = cfg.model.max_positions, tok.specials, model_device(model)
        src_ids = tok.src.encode(src) + [sp.eos]
        if len(src_ids) > limit:
            raise ConfigError(f"viz attention: --src has {len(src_ids)} tokens with </s>, the model takes {limit}")
        src_t = torch.tensor([src_ids], device=dev)  # (1, S)
        generated = tgt is None
        if generated:  # what `aiayn translate --beam 1` gives (the same decoding: banned ids, limits, n-grams)
            spec = SearchSpec(cfg.decode.replace(beam=1, nbest=1, sample=False), sp)
            tgt_ids = decode_ids(model, [src_ids[:-1]], spec, scores=False)[0][0].tokens
            tgt = tok.tgt.decode(tgt_ids)
        else:
            tgt_ids = tok.tgt.encode(tgt)
        if not generated and len(tgt_ids) > limit - 1:  # the whole target or nothing: part of it would mislead
            raise ConfigError(f"viz attention: the target has {len(tgt_ids)} tokens, the decoder reads at most "
                              f"{limit - 1} after its start token")
        tgt_in = [sp.decoder_start] + tgt_ids[: limit - 1]  # a generated one stops at the model's positions anyway
        probs = model.attention_maps(src_t, torch.tensor([tgt_in], device=dev))
        s_lab, t_lab = token_labels(tok.src, src_ids), token_labels(tok.tgt, tgt_in)
        nxt = token_labels(tok.tgt, tgt_in[1:] + [sp.eos])  # each step predicts the next input; the last, </s>
        maps = {
            "encoder": _maps("encoder", probs["encoder"], s_lab, s_lab),
            "decoder_self": _maps("decoder_self", probs["decoder_self"], t_lab, t_lab, nxt),
            "cross": _maps("cross", probs["cross"], t_lab, s_lab, nxt),
        }
        return AttentionData(maps, src, tgt, generated)


# How each architecture's attention is read (:attr:`aiayn.model.transformer.Transformer.architecture`).
READERS: dict[str, StreamAttention | PairAttention] = {"decoder-only": StreamAttention(),
                                                       "encoder-decoder": PairAttention()}


def attention_reader(run: Run) -> StreamAttention | PairAttention:
    """How ``run``'s model's attention is read: by its architecture (the maps it has, the text it takes)."""
    return READERS[run.model.architecture]


def select(data: AttentionData, layer: int | None = None, head: int | None = None) -> AttentionData:
    """Keep one layer and/or one head (0-based) of every kind; out of range is a one-line error."""
    maps = {}
    for kind, m in data.maps.items():
        L, H = m.weights.shape[:2]
        if layer is not None and not 0 <= layer < L:
            raise ConfigError(f"viz attention: --layer {layer}: the {KINDS[kind].lower()} has {L} layers (0-{L - 1})")
        if head is not None and not 0 <= head < H:
            raise ConfigError(f"viz attention: --head {head}: the model has {H} heads (0-{H - 1})")
        w = m.weights
        layers, heads = m.layers, m.heads
        if layer is not None:
            w, layers = w[layer : layer + 1], [layer]
        if head is not None:
            w, heads = w[:, head : head + 1], [head]
        maps[kind] = replace(m, weights=w, layers=layers, heads=heads)
    return replace(data, maps=maps)


def output_paths(out: str | Path, kinds) -> dict[str, Path]:
    """One PNG per kind beside ``out``: attention.png -> attention_encoder.png, attention_cross.png, ..."""
    out = Path(out)
    suffix = out.suffix or ".png"
    return {k: out.with_name(f"{out.stem}_{k}{suffix}") for k in kinds}


def default_size(m: AttentionMaps) -> tuple[int, int]:
    """Pixels for a grid: about 16 px per token and at least 240 px per map."""
    L, H, Q, K = m.weights.shape
    cell_w = min(600, max(240, 16 * K + 110))
    cell_h = min(600, max(240, 16 * Q + 110))
    return max(900, H * cell_w + 120), max(500, L * cell_h + 130)


def plot_attention(m: AttentionMaps, out: str | Path, subtitle: str = "", width: int | None = None,
                   height: int | None = None, show: bool = False) -> Path:
    """A grid of heatmaps (rows: layers, columns: heads), queries on y and keys on x, one colour scale
    from 0 to 1; labels on the outer maps only."""
    from aiayn.viz.common import new_figure, save_figure, suptitle

    L, H, Q, K = m.weights.shape
    fig = new_figure(width, height, default_size(m))
    axes = fig.subplots(L, H, squeeze=False)
    q_name = "query (source)" if m.kind == "encoder" else "query (decoder input)"
    k_name = "key (source)" if m.kind in ("encoder", "cross") else "key (decoder input)"
    small = Q * K <= 100 and L * H == 1  # one small map: write the weights in the cells
    for r in range(L):
        for c in range(H):
            ax = axes[r, c]
            im = ax.imshow(m.weights[r, c], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                           interpolation="nearest")
            ax.set_title(f"layer {m.layers[r]}, head {m.heads[c]}", fontsize=9)
            ax.set_xticks(range(K) if K <= MAX_LABELS else [])
            ax.set_yticks(range(Q) if Q <= MAX_LABELS else [])
            if r == L - 1 and K <= MAX_LABELS:
                ax.set_xticklabels(m.keys, rotation=90, fontsize=8)
            else:
                ax.set_xticklabels([])
            if c == 0 and Q <= MAX_LABELS:
                ax.set_yticklabels(m.queries, fontsize=8)
            else:
                ax.set_yticklabels([])
            if r == L - 1:
                ax.set_xlabel(k_name)
            if c == 0:
                ax.set_ylabel(q_name)
            if small:
                for i in range(Q):
                    for j in range(K):
                        v = m.weights[r, c, i, j]
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                                color="black" if v > 0.6 else "white")
    fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight")
    if L * H == 1:
        title = f"{KINDS[m.kind]}, layer {m.layers[0]}, head {m.heads[0]} (each row sums to 1)"
    else:
        title = f"{KINDS[m.kind]} (rows: layers, columns: heads; each row of a map sums to 1)"
    suptitle(fig, title + (f"\n{subtitle}" if subtitle else ""))
    return save_figure(fig, out, show)
