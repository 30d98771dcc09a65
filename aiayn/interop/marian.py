"""Hugging Face Marian (``MarianMTModel``) <-> aiayn :class:`Transformer`, weight for weight.

Marian (as ported to Hugging Face) is the paper's post-LN Transformer with sinusoidal positions in the
*concat* layout (all sines, then all cosines), optional sqrt(D) embedding scaling and a
``final_logits_bias``. The mapping (Marian name -> ours), per layer:

    q_proj | k_proj | v_proj (three (D, D))   -> in_proj (3D, D), rows Q then K then V
    out_proj                                  -> out_proj
    self_attn_layer_norm / encoder_attn_layer_norm / final_layer_norm
                                              -> sub_attn|sub_self / sub_cross / sub_ffn .norm
    fc1 / fc2                                 -> ffn.fc1 / ffn.fc2
    encoder_attn                              -> cross_attn
    embed_tokens, lm_head, final_logits_bias  -> embed.weight, output_proj.weight, output_bias

Hugging Face scales the queries by head_dim^-0.5 inside attention, not in ``q_proj``, so the
weights copy unchanged. Which matrices are shared (source/target embeddings, output projection)
is read from the tensors themselves, not only from the config flags: transformers 5 unties the
encoder and decoder embeddings when ``tie_word_embeddings`` is false even if
``share_encoder_decoder_embeddings`` is true, and what matters for exact equivalence is the values.

Special tokens are a convention, not a weight: Marian checkpoints start decoding from
``decoder_start_token_id`` (their pad id), aiayn models from BOS. :func:`to_hf_marian` sets
``decoder_start_token_id`` to our BOS so ``generate`` reproduces our decoding; a model converted
with :func:`from_hf_marian` must be decoded from the Marian config's ``decoder_start_token_id``.

A model trained with the paper's interleaved sinusoids is first re-laid out to Marian's concat layout
by :func:`concat_layout_copy` (a permutation of the model-width axis, computing the same function).

``transformers`` is imported inside the functions, so aiayn works without it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from aiayn.config import ModelConfig
from aiayn.interop import registry
from aiayn.model.embeddings import sinusoidal_table
from aiayn.model.transformer import Transformer

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import MarianConfig, MarianMTModel

# Our SentencePiece convention (pad 0, unk 1, bos 2, eos 3): used for the HF generation settings.
BOS_ID, EOS_ID = 2, 3

# aiayn activation <-> Hugging Face ACT2FN name. "gelu" is the exact (erf) GELU on both sides;
# HF's tanh approximations (gelu_new, gelu_fast, ...) have no aiayn equivalent and are refused.
_TO_HF_ACT = {"relu": "relu", "gelu": "gelu", "swish": "swish"}
_FROM_HF_ACT = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}

# torch.nn.LayerNorm's default, which Marian's layers use unconditionally (no config field).
_HF_LN_EPS = 1e-5


def marian_config_from(cfg: ModelConfig, bos_id: int = BOS_ID, eos_id: int = EOS_ID) -> MarianConfig:
    """The :class:`~transformers.MarianConfig` describing an aiayn model config.

    Raises ValueError for what Marian cannot represent (pre-LN, learned or interleaved positions,
    a LayerNorm epsilon other than 1e-5). ``bos_id`` becomes ``decoder_start_token_id`` (aiayn
    decoders start from BOS) and ``eos_id`` the EOS of generation.
    """
    from transformers import MarianConfig

    check_marian_compatible(cfg)
    return MarianConfig(
        vocab_size=cfg.vocab_size,
        decoder_vocab_size=cfg.target_vocab_size,
        max_position_embeddings=cfg.max_positions,
        encoder_layers=cfg.n_encoder_layers,
        decoder_layers=cfg.n_decoder_layers,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        d_model=cfg.d_model,
        activation_function=_TO_HF_ACT[cfg.activation],
        dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout,
        activation_dropout=cfg.activation_dropout,
        scale_embedding=cfg.scale_embeddings,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
        tie_word_embeddings=cfg.tie_output,
        pad_token_id=cfg.pad_id,
        eos_token_id=eos_id,
        # Marian's default forces EOS at max_length; plain aiayn search does not, so neither do we.
        forced_eos_token_id=None,
        decoder_start_token_id=bos_id,
    )


def check_marian_compatible(cfg: ModelConfig) -> None:
    """Raise ValueError, naming the option to change, if Marian cannot represent ``cfg`` exactly."""
    if cfg.norm_first:
        raise ValueError("Marian is post-LN: set model.norm_first=false (a pre-LN model has no Marian form)")
    if cfg.positional != "sinusoidal":
        raise ValueError(
            f"Marian has fixed sinusoidal positions only: model.positional={cfg.positional!r} "
            "cannot be converted (set model.positional=sinusoidal and retrain)"
        )
    if cfg.positional_layout != "concat":
        raise ValueError(
            "Marian lays out sinusoidal positions as all sines then all cosines: set "
            f"model.positional_layout=concat (got {cfg.positional_layout!r}); the weights of a model "
            "trained with the interleaved layout do not carry over"
        )
    if not cfg.default_head_widths:
        raise ValueError(
            f"Marian's heads are d_model / heads wide: model.d_k={cfg.key_width}, model.d_v={cfg.value_width} "
            f"with d_model={cfg.d_model} and {cfg.n_heads} heads cannot be converted (Table 3 row B has no Marian form)"
        )
    if cfg.layer_norm_eps != _HF_LN_EPS:
        raise ValueError(
            f"Marian's LayerNorm epsilon is fixed at {_HF_LN_EPS}: set model.layer_norm_eps={_HF_LN_EPS} "
            f"(got {cfg.layer_norm_eps})"
        )


def model_config_from_marian(
    hf_config: MarianConfig,
    *,
    share_embeddings: bool | None = None,
    tie_output: bool | None = None,
    output_bias: bool = False,
) -> ModelConfig:
    """The aiayn :class:`ModelConfig` of a Marian config (post-LN, concat sinusoids).

    ``share_embeddings`` / ``tie_output`` default to the config's flags; :func:`from_hf_marian`
    passes what the weights actually share instead. ``output_bias`` says whether to keep a logits
    bias (the config cannot tell whether ``final_logits_bias`` is used).
    """
    c = hf_config
    if c.encoder_attention_heads != c.decoder_attention_heads:
        raise ValueError(
            "aiayn uses one head count: encoder_attention_heads="
            f"{c.encoder_attention_heads} != decoder_attention_heads={c.decoder_attention_heads}"
        )
    if c.encoder_ffn_dim != c.decoder_ffn_dim:
        raise ValueError(
            f"aiayn uses one d_ff: encoder_ffn_dim={c.encoder_ffn_dim} != decoder_ffn_dim={c.decoder_ffn_dim}"
        )
    if c.activation_function not in _FROM_HF_ACT:
        raise ValueError(
            f"activation_function={c.activation_function!r} has no aiayn equivalent "
            f"(supported: {', '.join(sorted(_FROM_HF_ACT))})"
        )
    if c.pad_token_id is None:
        raise ValueError("the Marian config has no pad_token_id; aiayn needs one (model.pad_id)")
    share = c.share_encoder_decoder_embeddings if share_embeddings is None else share_embeddings
    tie = c.tie_word_embeddings if tie_output is None else tie_output
    dec_vocab = c.vocab_size if c.share_encoder_decoder_embeddings else c.decoder_vocab_size
    return ModelConfig(
        vocab_size=c.vocab_size,
        tgt_vocab_size=None if share else dec_vocab,
        d_model=c.d_model,
        n_heads=c.encoder_attention_heads,
        d_ff=c.encoder_ffn_dim,
        n_encoder_layers=c.encoder_layers,
        n_decoder_layers=c.decoder_layers,
        dropout=float(c.dropout),
        attention_dropout=float(c.attention_dropout),
        activation_dropout=float(c.activation_dropout),
        activation=_FROM_HF_ACT[c.activation_function],
        norm_first=False,
        layer_norm_eps=_HF_LN_EPS,
        positional="sinusoidal",
        positional_layout="concat",
        max_positions=c.max_position_embeddings,
        scale_embeddings=bool(c.scale_embedding),
        share_embeddings=share,
        tie_output=tie,
        output_bias=output_bias,
        pad_id=c.pad_token_id,
    )


def _layer_pairs(model: Transformer, hf: MarianMTModel) -> list[tuple[str, Tensor, list[Tensor]]]:
    """(name, our tensor, Marian tensors whose row-wise concatenation equals ours) for every layer weight."""
    pairs: list[tuple[str, Tensor, list[Tensor]]] = []

    def attention(name: str, ours: Any, theirs: Any) -> None:
        for p in ("weight", "bias"):
            qkv = [getattr(getattr(theirs, f"{x}_proj"), p) for x in "qkv"]
            pairs.append((f"{name}.in_proj.{p}", getattr(ours.in_proj, p), qkv))
            pairs.append((f"{name}.out_proj.{p}", getattr(ours.out_proj, p), [getattr(theirs.out_proj, p)]))

    def linear_or_norm(name: str, ours: Any, theirs: Any) -> None:
        for p in ("weight", "bias"):
            pairs.append((f"{name}.{p}", getattr(ours, p), [getattr(theirs, p)]))

    for i, (ours, theirs) in enumerate(zip(model.encoder.layers, hf.model.encoder.layers)):
        n = f"encoder.layers.{i}"
        attention(f"{n}.self_attn", ours.self_attn, theirs.self_attn)
        linear_or_norm(f"{n}.sub_attn.norm", ours.sub_attn.norm, theirs.self_attn_layer_norm)
        linear_or_norm(f"{n}.ffn.fc1", ours.ffn.fc1, theirs.fc1)
        linear_or_norm(f"{n}.ffn.fc2", ours.ffn.fc2, theirs.fc2)
        linear_or_norm(f"{n}.sub_ffn.norm", ours.sub_ffn.norm, theirs.final_layer_norm)
    for i, (ours, theirs) in enumerate(zip(model.decoder.layers, hf.model.decoder.layers)):
        n = f"decoder.layers.{i}"
        attention(f"{n}.self_attn", ours.self_attn, theirs.self_attn)
        linear_or_norm(f"{n}.sub_self.norm", ours.sub_self.norm, theirs.self_attn_layer_norm)
        attention(f"{n}.cross_attn", ours.cross_attn, theirs.encoder_attn)
        linear_or_norm(f"{n}.sub_cross.norm", ours.sub_cross.norm, theirs.encoder_attn_layer_norm)
        linear_or_norm(f"{n}.ffn.fc1", ours.ffn.fc1, theirs.fc1)
        linear_or_norm(f"{n}.ffn.fc2", ours.ffn.fc2, theirs.fc2)
        linear_or_norm(f"{n}.sub_ffn.norm", ours.sub_ffn.norm, theirs.final_layer_norm)
    return pairs


def _check_marian_model(hf: Any) -> None:
    if not (hasattr(hf, "lm_head") and hasattr(hf, "model") and hasattr(hf.model, "encoder")):
        raise TypeError(f"expected a transformers MarianMTModel, got {type(hf).__name__}")
    for side in ("encoder", "decoder"):
        stack = getattr(hf.model, side)
        eps = {m.eps for layer in stack.layers for m in layer.modules() if isinstance(m, torch.nn.LayerNorm)}
        if eps - {_HF_LN_EPS}:
            raise ValueError(f"Marian {side} LayerNorm epsilon {sorted(eps)} is not {_HF_LN_EPS}")
        table = stack.embed_positions.weight.detach().float().cpu()
        expected = sinusoidal_table(table.size(0), table.size(1), "concat")
        # A few float32 ulps apart (numpy vs torch formula); anything larger is not Marian's sinusoid.
        if (table - expected).abs().max().item() > 1e-5:
            raise ValueError(f"Marian {side} position table is not the standard sinusoid; cannot convert")


@torch.no_grad()
def from_hf_marian(hf_model: MarianMTModel, output_bias: bool | None = None) -> Transformer:
    """An aiayn :class:`Transformer` computing the same logits as ``hf_model``.

    ``output_bias`` None keeps a logits bias only when ``final_logits_bias`` is non-zero (OPUS-MT
    checkpoints carry one); True / False force it (False refuses a non-zero bias). The model comes
    back in ``hf_model``'s train/eval mode, in float32. Decode it starting from
    ``hf_model.config.decoder_start_token_id`` (Marian's convention), not from BOS.
    """
    _check_marian_model(hf_model)
    hf = hf_model
    enc_emb = hf.model.encoder.embed_tokens.weight
    dec_emb = hf.model.decoder.embed_tokens.weight
    lm_head = hf.lm_head.weight
    bias = hf.final_logits_bias.detach().reshape(-1)
    has_bias = bool(bias.ne(0).any()) if output_bias is None else output_bias
    if not has_bias and bias.ne(0).any():
        raise ValueError("output_bias=False but the Marian final_logits_bias is non-zero")
    share = enc_emb.shape == dec_emb.shape and bool(torch.equal(enc_emb, dec_emb))
    tie = lm_head.shape == dec_emb.shape and bool(torch.equal(lm_head, dec_emb))
    cfg = model_config_from_marian(hf.config, share_embeddings=share, tie_output=tie, output_bias=has_bias)
    if cfg.target_vocab_size != dec_emb.size(0) or cfg.vocab_size != enc_emb.size(0):
        raise ValueError(
            f"Marian config vocabularies ({cfg.vocab_size}, {cfg.target_vocab_size}) do not match the "
            f"embedding tensors ({enc_emb.size(0)}, {dec_emb.size(0)})"
        )
    model = Transformer(cfg)
    model.encoder.embed.weight.copy_(enc_emb)
    model.decoder.embed.weight.copy_(dec_emb)  # same tensor as the encoder's when shared
    model.decoder.output_proj.weight.copy_(lm_head)  # same tensor as the embedding when tied
    if model.decoder.output_bias is not None:
        model.decoder.output_bias.copy_(bias)
    for _, ours, theirs in _layer_pairs(model, hf):
        ours.copy_(torch.cat([t.detach() for t in theirs], dim=0))
    return model.train(hf.training)


@torch.no_grad()
def to_hf_marian(model: Transformer, bos_id: int = BOS_ID, eos_id: int = EOS_ID) -> MarianMTModel:
    """A Hugging Face ``MarianMTModel`` computing the same logits as ``model``.

    Raises ValueError for models Marian cannot represent (see :func:`check_marian_compatible`).
    ``decoder_start_token_id`` is set to ``bos_id`` so ``generate`` starts like aiayn decoding.
    Marian keeps its own (identical up to float rounding) sinusoid table. The model comes back in
    ``model``'s train/eval mode.
    """
    from transformers import MarianMTModel

    registry.check_model("hf", model, "to_hf_marian converts")
    cfg = model.cfg
    hf = MarianMTModel(marian_config_from(cfg, bos_id=bos_id, eos_id=eos_id))
    dtype = model.encoder.embed.weight.dtype
    hf.to(dtype)
    src_emb, tgt_emb = model.encoder.embed.weight, model.decoder.embed.weight
    if cfg.share_embeddings:
        hf.model.shared.weight.copy_(src_emb)
    # Copy every side even where HF ties them: with tie_word_embeddings=False transformers 5 also
    # unties the encoder and decoder embeddings, and copying a tied tensor twice is harmless.
    hf.model.encoder.embed_tokens.weight.copy_(src_emb)
    hf.model.decoder.embed_tokens.weight.copy_(tgt_emb)
    hf.lm_head.weight.copy_(model.decoder.output_proj.weight)
    bias = model.decoder.output_bias
    hf.final_logits_bias.copy_(bias.reshape(1, -1) if bias is not None else torch.zeros_like(hf.final_logits_bias))
    for name, ours, theirs in _layer_pairs(model, hf):
        chunks = ours.split([t.size(0) for t in theirs], dim=0)
        if len(chunks) != len(theirs):  # pragma: no cover - shapes come from the same config
            raise RuntimeError(f"cannot split {name}")
        for chunk, t in zip(chunks, theirs):
            t.copy_(chunk)
    return hf.train(model.training)


# Interleaved -> concat sinusoid layout ----------------------------------------------------------------


def concat_permutation(d_model: int) -> Tensor:
    """perm such that ``interleaved_table[:, perm] == concat_table``: even dims (sines), then odd (cosines)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _relayout(name: str, t: Tensor, perm: Tensor) -> Tensor:
    # Only axes indexed by the model width D move; the Q/K/V rows of in_proj (per-head structure), the
    # FFN inner dimension, the attention output before out_proj and the vocabulary stay where they are.
    if name.endswith(("embed.weight", "output_proj.weight", "in_proj.weight", "fc1.weight")):
        return t[:, perm]  # D is the input (column) axis
    if name.endswith(("out_proj.weight", "fc2.weight", "out_proj.bias", "fc2.bias")):
        return t[perm]  # D is the output axis
    if ".norm." in name or "final_norm." in name:
        return t[perm]  # LayerNorm statistics do not depend on the order of the dimensions
    if name.endswith(("in_proj.bias", "fc1.bias", "output_bias")):
        return t
    raise ValueError(f"no re-layout rule for the parameter {name}")


@torch.no_grad()
def concat_layout_copy(model: Transformer) -> Transformer:
    """A copy of ``model`` with ``positional_layout='concat'`` that computes the same function.

    A model trained with the paper's interleaved sinusoids (sin on even, cos on odd dimensions) equals,
    up to float rounding, a concat-layout model (all sines, then all cosines: Marian's and CTranslate2's
    layout) whose every model-width axis is permuted by :func:`concat_permutation`: the embedding
    columns, the input columns of in_proj / fc1 / the output projection, the output rows of out_proj /
    fc2 and the LayerNorm parameters. Every weight is moved, none is changed; the hidden states are the
    old ones permuted and every matmul sums the same products in another order, so the logits agree to
    float rounding (not bit for bit). A concat-layout model comes back as an exact copy.
    """
    cfg = model.cfg
    if cfg.positional != "sinusoidal":
        raise ValueError(f"only sinusoidal positions have a layout (model.positional={cfg.positional!r})")
    out = Transformer(dataclasses.replace(cfg, positional_layout="concat"))
    if cfg.positional_layout == "concat":
        out.load_state_dict(model.state_dict())
        return out.train(model.training)
    perm = concat_permutation(cfg.d_model)
    table = sinusoidal_table(8, cfg.d_model, "interleaved")
    if not torch.equal(table[:, perm], sinusoidal_table(8, cfg.d_model, "concat")):  # pragma: no cover
        raise RuntimeError("the interleaved and concat sinusoid tables are not permutations of each other")
    out.load_state_dict({k: _relayout(k, v, perm) for k, v in model.state_dict().items()}, strict=True)
    return out.train(model.training)
