"""The implementations and variants the training benchmarks time (``benchmarks.train_throughput --impls``), each
built from the weights of ``aiayn.Transformer(cfg)`` under one seed and trained by the same update code
(``aiayn.train.update.Update``):

* ``aiayn``             aiayn's model as ``aiayn train`` trains it, eager, with aiayn's speed levers added by name:
                        ``aiayn+cast+fused-loss``... (:data:`LEVERS`); ``aiayn-compile`` its layers and loss compiled
                        as ``train.compile: true`` (with levers too: ``aiayn-compile+cast+fused-loss``). The levers are
                        wired by the trainer's own code (:func:`aiayn.train.update.training_module`).
* ``hf-marian``         Hugging Face ``MarianMTModel`` (converted with aiayn.interop.marian.to_hf_marian); and
  ``hf-marian-compile`` its encoder and decoder layers compiled by regions, the loss compiled, the batches in
                        the same shape policy as aiayn's compiled training (what a careful user of HF would do).
* ``torch-nn``          embeddings + sinusoids + ``torch.nn.Transformer(batch_first=True, norm_first=False)``
                        (final encoder/decoder LayerNorms removed, dropout only where the paper has it) + the tied
                        output projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import aiayn.engine as engine
from aiayn.config import Config, ModelConfig, TrainConfig
from aiayn.data.batching import Batch
from aiayn.device import DTYPES, autocast_context
from aiayn.model.embeddings import sinusoidal_table
from aiayn.model.transformer import Transformer
from aiayn.train.loss import compiled_loss, label_smoothed_cross_entropy
from aiayn.train.parallel import Dist
from aiayn.train.update import Levers, batch_logits, training_module

BASES = ("aiayn", "aiayn-compile", "hf-marian", "hf-marian-compile", "torch-nn")
# aiayn's speed levers by their names in a variant (train.* key: what it does)
LEVERS = {
    "cast": "weights cast once",  # train.cast_weights_once
    "fused-loss": "output projection fused into the loss",  # train.fused_output_loss
    "fuse-norms": "fused residual + layer norm",  # train.fuse_norms
    "cudnn": "cuDNN attention first",  # train.attention_backends: [cudnn, flash, efficient, math]
}
BASE_LABELS = {
    "aiayn": "aiayn", "aiayn-compile": "aiayn + torch.compile", "hf-marian": "HF MarianMTModel",
    "hf-marian-compile": "HF MarianMTModel + torch.compile", "torch-nn": "torch.nn.Transformer",
}


@dataclass(frozen=True)
class Variant:
    """An implementation and the levers it trains with: ``aiayn-compile+cast+fused-loss``."""

    base: str
    levers: tuple[str, ...] = ()

    @classmethod
    def parse(cls, name: str) -> Variant:
        base, *levers = name.split("+")
        if base not in BASES:
            raise ValueError(f"unknown implementation {base!r} in {name!r} (known: {', '.join(BASES)})")
        for lever in levers:
            if lever not in LEVERS or not base.startswith("aiayn"):
                raise ValueError(f"{name!r}: aiayn's levers are {', '.join(LEVERS)} (aiayn and aiayn-compile only)")
        return cls(base, tuple(levers))

    @property
    def label(self) -> str:
        return " + ".join([BASE_LABELS[self.base], *(LEVERS[x] for x in self.levers)])

    @property
    def ours(self) -> bool:
        return self.base.startswith("aiayn")

    @property
    def compiled(self) -> bool:
        return self.base.endswith("-compile")

    @property
    def eager_base(self) -> str:
        """The base without compile (its peer in a throwaway first update)."""
        return self.base.removesuffix("-compile")

    def levers_for(self, precision: str, compile_mode: str) -> Levers:
        """aiayn's :class:`Levers` of this variant, as ``train.*`` keys would set them."""
        low = precision in ("bf16", "fp16")
        return Levers(compile=self.compiled, compile_mode=compile_mode,
                      cast_dtype=DTYPES[precision] if "cast" in self.levers and low else None,
                      fused_output_loss="fused-loss" in self.levers, fuse_norms="fuse-norms" in self.levers,
                      attention_backends=("cudnn", *engine.DEFAULT_SDPA_BACKENDS) if "cudnn" in self.levers else ())


def label(name: str) -> str:
    return Variant.parse(name).label


# The peers -------------------------------------------------------------------------------------------------------


class HFMarianSeq2Seq(nn.Module):
    """``MarianMTModel`` behind aiayn's ``model(src, tgt_in) -> logits`` interface."""

    def __init__(self, hf: nn.Module, pad_id: int = 0) -> None:
        super().__init__()
        self.hf, self.pad_id = hf, pad_id

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V). No KV cache is kept when training."""
        out = self.hf(input_ids=src, attention_mask=(src != self.pad_id).long(), decoder_input_ids=tgt_in,
                      use_cache=False)
        return out.logits


class TorchNNTransformer(nn.Module):
    """The paper's model on ``torch.nn.Transformer``: scaled shared embedding + sinusoids, post-LN layers,
    tied output projection.

    ``nn.Transformer`` adds a final LayerNorm to both stacks (a pre-LN habit the paper does not have):
    they are removed. Its single ``dropout`` also drops attention probabilities and FFN activations;
    those are set to the config's ``attention_dropout`` / ``activation_dropout`` (0 in the paper), so
    the three implementations drop the same things.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not (cfg.share_embeddings and cfg.tie_output) or cfg.norm_first or cfg.positional != "sinusoidal":
            raise ValueError("TorchNNTransformer builds the paper's shared/tied post-LN sinusoidal model only")
        D = cfg.d_model
        self.pad_id, self.scale = cfg.pad_id, math.sqrt(D) if cfg.scale_embeddings else 1.0
        self.embed = nn.Embedding(cfg.vocab_size, D, padding_idx=cfg.pad_id)
        self.register_buffer("pe", sinusoidal_table(cfg.max_positions, D, cfg.positional_layout), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(
            D, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.d_ff, cfg.dropout,
            activation=cfg.activation if cfg.activation != "swish" else F.silu,
            layer_norm_eps=cfg.layer_norm_eps, batch_first=True, norm_first=False,
        )
        self.transformer.encoder.norm = None
        self.transformer.decoder.norm = None
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.self_attn.dropout = cfg.attention_dropout
            if hasattr(layer, "multihead_attn"):
                layer.multihead_attn.dropout = cfg.attention_dropout
            layer.dropout.p = cfg.activation_dropout

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V)."""
        S, T = src.size(1), tgt_in.size(1)
        pad = src == self.pad_id  # (B, S), True = ignore (nn.Transformer's convention)
        x = self.dropout(self.embed(src) * self.scale + self.pe[:S])
        y = self.dropout(self.embed(tgt_in) * self.scale + self.pe[:T])
        causal = torch.ones(T, T, dtype=torch.bool, device=src.device).triu(1)  # True = may not attend
        h = self.transformer(x, y, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad,
                             tgt_is_causal=True)
        return F.linear(h, self.embed.weight)

    @classmethod
    @torch.no_grad()
    def from_aiayn(cls, ours: Transformer) -> TorchNNTransformer:
        """The same weights as ``ours`` (nn.MultiheadAttention stores Q|K|V rows like aiayn's in_proj)."""
        m = cls(ours.cfg)
        m.embed.weight.copy_(ours.encoder.embed.weight)

        def attn(dst: nn.MultiheadAttention, src: nn.Module) -> None:
            dst.in_proj_weight.copy_(src.in_proj.weight)
            dst.in_proj_bias.copy_(src.in_proj.bias)
            dst.out_proj.weight.copy_(src.out_proj.weight)
            dst.out_proj.bias.copy_(src.out_proj.bias)

        def lin(dst: nn.Module, src: nn.Module) -> None:
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)

        for dst, src in zip(m.transformer.encoder.layers, ours.encoder.layers):
            attn(dst.self_attn, src.self_attn)
            lin(dst.norm1, src.sub_attn.norm)
            lin(dst.linear1, src.ffn.fc1)
            lin(dst.linear2, src.ffn.fc2)
            lin(dst.norm2, src.sub_ffn.norm)
        for dst, src in zip(m.transformer.decoder.layers, ours.decoder.layers):
            attn(dst.self_attn, src.self_attn)
            lin(dst.norm1, src.sub_self.norm)
            attn(dst.multihead_attn, src.cross_attn)
            lin(dst.norm2, src.sub_cross.norm)
            lin(dst.linear1, src.ffn.fc1)
            lin(dst.linear2, src.ffn.fc2)
            lin(dst.norm3, src.sub_ffn.norm)
        return m.train(ours.training)


# Building a variant -------------------------------------------------------------------------------------------


@dataclass
class Built:
    """A variant ready to time: the module, the :class:`aiayn.train.update.Update` fields it trains with, the attention
    backends to run under (``kernels``), and which backend each kind of attention took (aiayn only)."""

    model: nn.Module
    fields: dict[str, Any]
    backends: tuple[str, ...] = ()
    attention: dict[str, str] | None = None


def build_variant(name: str, cfg: ModelConfig, seed: int = 1, compile_mode: str = "default",
                  device: str | torch.device = "cpu", precision: str = "fp32", probe: Batch | None = None) -> Built:
    """Variant ``name`` on ``device`` with the initial weights of ``Transformer(cfg)`` under ``seed``. For aiayn,
    ``probe`` (a batch) is run once eagerly first to report each attention's backend
    (:func:`aiayn.engine.attention_backends`)."""
    v = Variant.parse(name)
    dev = torch.device(device)
    torch.manual_seed(seed)
    ours = Transformer(cfg)
    if v.ours:
        engine.prepare_model(ours, dev, training=True)
        levers = v.levers_for(precision, compile_mode)
        attention = None if probe is None else _attention_report(ours, probe, dev, precision, levers)
        train_cfg = Config(model=cfg, train=TrainConfig(compile=v.compiled, compile_mode=compile_mode))
        module, fields = training_module(ours, train_cfg, Dist(), levers)
        return Built(module, fields, levers.attention_backends, attention)
    if v.eager_base == "hf-marian":
        from aiayn.interop.marian import to_hf_marian

        model = HFMarianSeq2Seq(to_hf_marian(ours), cfg.pad_id).to(dev)
        if not v.compiled:
            return Built(model, {"loss_fn": label_smoothed_cross_entropy})
        inner = model.hf.model
        engine.compile_regions(model, [*inner.encoder.layers, *inner.decoder.layers], False, 0, compile_mode)
        return Built(model, {"loss_fn": compiled_loss(dynamic=True), "fit_shapes": True})
    return Built(TorchNNTransformer.from_aiayn(ours).to(dev), {"loss_fn": label_smoothed_cross_entropy})


def _attention_report(model: nn.Module, batch: Batch, dev: torch.device, precision: str, levers: Levers
                      ) -> dict[str, str]:
    """The backend each kind of attention takes in one training-mode forward of ``batch`` (before any compile)."""
    model.to(dev).train()
    b = batch.to(dev)
    with engine.kernels(dev, precision, levers.attention_backends), autocast_context(precision, dev):
        return engine.attention_backends(model, lambda: batch_logits(model, b))


def build_impl(impl: str, cfg: ModelConfig, seed: int = 1, compile_mode: str = "default") -> nn.Module:
    """The implementation ``impl`` with the initial weights of ``Transformer(cfg)`` under ``seed`` (on the CPU)."""
    return build_variant(impl, cfg, seed, compile_mode).model
