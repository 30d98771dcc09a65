"""Export an aiayn :class:`Transformer` to a CTranslate2 model directory (``model.bin``, ``config.json``,
vocabularies) for fast CPU/GPU inference with ``ctranslate2.Translator``.

The spec is filled weight for weight, like CTranslate2's own converters do for fairseq or Marian:

    in_proj (3D, D), rows Q | K | V  -> self_attention.linear[0] (CT2 fuses Q, K, V the same way)
    cross in_proj rows Q / rows K|V  -> attention.linear[0] / attention.linear[1]
    out_proj                         -> linear[-1];  sub-layer norms -> the sub-layer's layer_norm
    ffn.fc1 / ffn.fc2                -> ffn.linear_0 / ffn.linear_1
    output_proj (+ output_bias)      -> decoder.projection (weight, bias)

Positions are written out as an explicit table (our sinusoids in either layout, or the learned
vectors), because CTranslate2's built-in sinusoid is tensor2tensor's (positions from 1, a different
frequency spacing), not section 3.5's. Rotary positions (``model.positional: rotary``) are CTranslate2's
own rotation of the self-attentions' queries and keys, in halves over the whole head width.
``pre_norm`` follows ``norm_first`` (CTranslate2's pre-norm stack ends with a LayerNorm, like ours),
``scale_embeddings`` the sqrt(D) flag, and the LayerNorm epsilon is stored in ``config.json``.

Special tokens, matching how aiayn trains: the source is ``tokens + [EOS]`` (so the exported config
sets ``add_source_eos`` and callers pass pieces *without* ``</s>``), the decoder starts from BOS
(``decoder_start_token``), and decoding stops at EOS. CTranslate2 works on piece strings, so the
caller gives the id -> piece lists (SentencePiece's ``<pad> <unk> <s> </s>`` at ids 0-3 in aiayn).

``ctranslate2`` is imported inside the functions, so aiayn works without it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor, nn

from aiayn.data.tokenizer import SpecialIds
from aiayn.errors import first_line
from aiayn.files import check_output_dir, locked, staged_directory
from aiayn.interop import registry
from aiayn.model.embeddings import sinusoidal_table
from aiayn.model.transformer import Transformer

if TYPE_CHECKING:  # pragma: no cover - typing only
    from ctranslate2.specs.transformer_spec import TransformerSpec

UNK_ID, BOS_ID, EOS_ID = 1, 2, 3  # aiayn's SentencePiece ids (pad is 0)


def _np(t: Tensor) -> np.ndarray:
    """A float32 numpy copy, detached from the model (quantization happens in ``spec.optimize``)."""
    return t.detach().float().cpu().contiguous().numpy().copy()


def _linear(spec: Any, weight: Tensor, bias: Tensor | None) -> None:
    spec.weight = _np(weight)
    if bias is not None:
        spec.bias = _np(bias)


def _norm(spec: Any, norm: nn.LayerNorm) -> None:
    spec.gamma = _np(norm.weight)
    spec.beta = _np(norm.bias)


def _positions(module: nn.Module, cfg: Any, rows: int | None) -> np.ndarray:
    """(rows, D) table of what is added to the embeddings at each position, 0-based: the model's own table
    (max_positions rows), or sinusoids of section 3.5 continued to ``rows`` positions (learned vectors cannot be
    continued: :func:`ctranslate2_spec` refuses that)."""
    if not hasattr(module, "table"):
        return _np(module.weight)
    if rows is None or rows <= module.table.shape[0]:
        return _np(module.table)
    return _np(sinusoidal_table(rows, cfg.d_model, cfg.positional_layout))


def _self_attention(spec: Any, mha: nn.Module, norm: nn.LayerNorm) -> None:
    _linear(spec.linear[0], mha.in_proj.weight, mha.in_proj.bias)  # fused Q|K|V, same row order
    _linear(spec.linear[1], mha.out_proj.weight, mha.out_proj.bias)
    _norm(spec.layer_norm, norm)


def _cross_attention(spec: Any, mha: nn.Module, norm: nn.LayerNorm) -> None:
    D = mha.d_model
    w, b = mha.in_proj.weight, mha.in_proj.bias
    _linear(spec.linear[0], w[:D], b[:D])  # queries from the decoder states
    _linear(spec.linear[1], w[D:], b[D:])  # fused K|V from the encoder memory
    _linear(spec.linear[2], mha.out_proj.weight, mha.out_proj.bias)
    _norm(spec.layer_norm, norm)


def _ffn(spec: Any, ffn: nn.Module, norm: nn.LayerNorm) -> None:
    _linear(spec.linear_0, ffn.fc1.weight, ffn.fc1.bias)
    _linear(spec.linear_1, ffn.fc2.weight, ffn.fc2.bias)
    _norm(spec.layer_norm, norm)


def _check_vocab(name: str, pieces: list[str], size: int, special: dict[str, int]) -> None:
    if len(pieces) != size:
        raise ValueError(f"{name} vocabulary has {len(pieces)} pieces but the model has {size} embeddings")
    if len(set(pieces)) != len(pieces):
        dup = next(p for i, p in enumerate(pieces) if p in pieces[:i])
        raise ValueError(f"{name} vocabulary repeats the piece {dup!r}: CTranslate2 maps pieces to ids by name")
    for role, i in special.items():
        if not 0 <= i < size:
            raise ValueError(f"{role} id {i} is outside the {name} vocabulary of {size}")


def ctranslate2_spec(
    model: Transformer,
    vocab: list[str],
    tgt_vocab: list[str] | None = None,
    *,
    unk_id: int = UNK_ID,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    add_source_eos: bool = True,
    positions: int | None = None,
) -> TransformerSpec:
    """A filled, validated ``ctranslate2.specs.TransformerSpec`` for ``model``.

    ``vocab`` / ``tgt_vocab`` are the id -> piece lists (``tgt_vocab`` None: the source one).
    The special ids must name the same pieces in both vocabularies (CTranslate2 stores them once,
    as strings). ``add_source_eos`` makes CTranslate2 append EOS to each source, as aiayn training
    does; set it False if your sources already end in EOS. ``positions``: rows of the position tables when
    more than the model's ``max_positions`` (CTranslate2 fails on a longer input or output); sinusoidal
    positions only, continued by the formula of section 3.5.
    """
    from ctranslate2.specs import common_spec

    _check_exportable(model, positions)
    cfg = model.cfg
    tgt_vocab = list(vocab if tgt_vocab is None else tgt_vocab)
    vocab = list(vocab)
    _check_vocabularies(cfg, vocab, tgt_vocab, {"unk": unk_id, "bos": bos_id, "eos": eos_id})
    activation = {
        "relu": common_spec.Activation.RELU,
        "gelu": common_spec.Activation.GELU,  # exact erf GELU, as torch.nn.functional.gelu
        "swish": common_spec.Activation.SWISH,
    }[cfg.activation]
    spec = _empty_spec(cfg, activation)

    _fill_weights(spec, model, positions)
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(tgt_vocab)
    config = spec.config
    config.unk_token = vocab[unk_id]
    config.bos_token = vocab[bos_id]
    config.eos_token = vocab[eos_id]
    config.decoder_start_token = vocab[bos_id]  # aiayn decoders start from BOS (Marian: a zero vector)
    config.add_source_bos = False
    config.add_source_eos = add_source_eos
    config.layer_norm_epsilon = cfg.layer_norm_eps
    spec.validate()
    return spec


def _check_exportable(model: nn.Module, positions: int | None) -> None:
    """What CTranslate2's Transformer cannot hold, refused before anything is built."""
    registry.check_model("ctranslate2", model, "export_ctranslate2 exports")
    cfg = model.cfg
    if cfg.n_encoder_layers == 0:
        raise ValueError("CTranslate2 needs at least one encoder layer (model.n_encoder_layers=0)")
    if not cfg.default_head_widths:
        raise ValueError(
            f"CTranslate2's Transformer heads are d_model / heads wide: model.d_k={cfg.key_width}, "
            f"model.d_v={cfg.value_width} with d_model={cfg.d_model} and {cfg.n_heads} heads cannot be exported"
        )
    if positions is not None and positions > cfg.max_positions and cfg.positional == "learned":
        raise ValueError(f"learned positions end at model.max_positions={cfg.max_positions}; {positions} "
                         "positions need sinusoidal ones (or a model trained with more)")


def _empty_spec(cfg: Any, activation: Any) -> TransformerSpec:
    """CTranslate2's Transformer for ``cfg``'s layers, heads and norms: with position tables added to the embeddings,
    or, for rotary positions, rotating each self-attention's queries and keys over the whole head width in halves
    (``rotary_interleave=False``: GPT-NeoX's pairs, as :class:`aiayn.model.positions.RotaryPositions`), base 10000;
    CTranslate2 does not rotate cross-attention either."""
    from ctranslate2.specs import transformer_spec

    layers = (cfg.n_encoder_layers, cfg.n_decoder_layers)
    if cfg.positional != "rotary":
        return transformer_spec.TransformerSpec.from_config(layers, cfg.n_heads, pre_norm=cfg.norm_first,
                                                            activation=activation)
    kw = dict(pre_norm=cfg.norm_first, activation=activation, rotary_dim=0, rotary_interleave=False, rotary_base=10000)
    encoder = transformer_spec.TransformerEncoderSpec(layers[0], cfg.n_heads, **kw)
    del encoder.position_encodings  # the encoder spec always makes a table; without it nothing is added
    return transformer_spec.TransformerSpec(encoder, transformer_spec.TransformerDecoderSpec(layers[1], cfg.n_heads,
                                                                                             **kw))


def _check_vocabularies(cfg: Any, vocab: list[str], tgt_vocab: list[str], special: dict[str, int]) -> None:
    """Both vocabularies fit the model, and each special id names the same piece in both (CTranslate2 stores the
    special tokens once, as strings)."""
    _check_vocab("source", vocab, cfg.vocab_size, special)
    _check_vocab("target", tgt_vocab, cfg.target_vocab_size, special)
    for role, i in special.items():
        if vocab[i] != tgt_vocab[i]:
            raise ValueError(
                f"the {role} piece differs between vocabularies ({vocab[i]!r} vs {tgt_vocab[i]!r}); "
                "CTranslate2 names each special token once"
            )


def _fill_weights(spec: Any, model: Transformer, positions: int | None) -> None:
    """Every weight of ``model`` into ``spec``: embeddings, position tables, each layer, the final norms, the
    output projection."""
    cfg = model.cfg
    enc, dec = model.encoder, model.decoder
    spec.encoder.embeddings[0].weight = _np(enc.embed.weight)
    spec.encoder.scale_embeddings = cfg.scale_embeddings  # bool: True = sqrt(D), False = none
    if hasattr(spec.encoder, "position_encodings"):  # none for rotary positions: the spec rotates (_empty_spec)
        spec.encoder.position_encodings.encodings = _positions(enc.positions, cfg, positions)
    for layer_spec, layer in zip(spec.encoder.layer, enc.layers):
        _self_attention(layer_spec.self_attention, layer.self_attn, layer.sub_attn.norm)
        _ffn(layer_spec.ffn, layer.ffn, layer.sub_ffn.norm)
    if enc.final_norm is not None:
        _norm(spec.encoder.layer_norm, enc.final_norm)

    spec.decoder.embeddings.weight = _np(dec.embed.weight)
    spec.decoder.scale_embeddings = cfg.scale_embeddings
    if hasattr(spec.decoder, "position_encodings"):
        spec.decoder.position_encodings.encodings = _positions(dec.positions, cfg, positions)
    for layer_spec, layer in zip(spec.decoder.layer, dec.layers):
        _self_attention(layer_spec.self_attention, layer.self_attn, layer.sub_self.norm)
        _cross_attention(layer_spec.attention, layer.cross_attn, layer.sub_cross.norm)
        _ffn(layer_spec.ffn, layer.ffn, layer.sub_ffn.norm)
    if dec.final_norm is not None:
        _norm(spec.decoder.layer_norm, dec.final_norm)
    # Tied weights are written twice here; spec.optimize() aliases identical tensors in model.bin.
    _linear(spec.decoder.projection, dec.output_proj.weight, dec.output_bias)


def export_ctranslate2(
    model: Transformer,
    vocab: list[str],
    out_dir: str | os.PathLike,
    tgt_vocab: list[str] | None = None,
    quantization: str | None = None,
    *,
    specials: SpecialIds = SpecialIds(),
    add_source_eos: bool = True,
    force: bool = False,
) -> Path:
    """Write ``model`` as a CTranslate2 model directory and return its path.

    ``vocab``: source id -> piece list (also the target's when ``tgt_vocab`` is None); ``specials``: the ids the
    model reserves (its decoder starts from ``specials.decoder_start``).
    ``quantization``: None (float32) or a CTranslate2 weight type (int8, int8_float32, int16,
    float16, bfloat16, ...). ``out_dir`` must not exist unless ``force`` (it is then replaced).
    Load it with ``ctranslate2.Translator(out_dir)`` and translate piece lists without ``</s>``.
    """
    out = Path(out_dir)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists (pass force=True to replace it)")
    spec = ctranslate2_spec(model, vocab, tgt_vocab, unk_id=specials.unk, bos_id=specials.decoder_start,
                            eos_id=specials.eos, add_source_eos=add_source_eos)
    spec.optimize(quantization=quantization)  # also validates the quantization name
    # Built next to the target and swapped in, so a failed save never leaves half a model behind.
    with staged_directory(out) as stage:
        spec.save(str(stage))
    return out


_README = """\
CTranslate2 export of the aiayn run {run}
(model: {layers} layers, d_model {d_model}; weights {weights}; quantization {quant})

Files: model.bin, config.json and the vocabularies are CTranslate2's; {tok_files}
are the run's tokenizer ({kind}, {vocab}), copied so that this directory is self-contained.

{moses_note}The source is the tokenizer's pieces WITHOUT {eos} (config.json adds it, as aiayn training did);
the decoder starts from {start} and stops at {eos}.{marian_note}

    import ctranslate2, sentencepiece as spm
    sp_src = spm.SentencePieceProcessor(model_file="{src_model}")
    sp_tgt = spm.SentencePieceProcessor(model_file="{tgt_model}")
    translator = ctranslate2.Translator("{out}", device="cpu")   # compute_type="int8" etc. also work
    pieces = [sp_src.encode(line, out_type=str) for line in ["{example}"]]
    results = translator.translate_batch(pieces, beam_size={beam}, length_penalty={alpha},
                                         max_decoding_length=256, min_decoding_length=0)
    print([sp_tgt.decode(r.hypotheses[0]).strip() for r in results])

Length penalty: CTranslate2 divides the score by |Y|^length_penalty (aiayn's 'power'). The run's
config decodes with length_penalty={lp!r}, alpha={alpha}{lp_note}.
To reproduce aiayn's beam_search(length_penalty='power', stop='exact') token for token,
also pass patience=1000 (CTranslate2 otherwise stops once beam_size hypotheses have finished:
aiayn's stop='first'),
return_end_token=True (|Y| counts the EOS step) and
max_decoding_length=int({a} * (len(pieces) + 1) + {b}) per sentence.
"""


_MOSES_NOTE = """\
This run's tokenizer is Moses-pretokenized (data.pretokenize: moses): before sp_src.encode, run each
source line through sacremoses as aiayn did in training, and detokenize the output after sp_tgt.decode:
    from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer
    line = MosesTokenizer("{src}").tokenize(MosesPunctNormalizer("{src}").normalize(line{lower}), escape=False,
                                            return_str=True)
    text = MosesDetokenizer("{tgt}").detokenize(sp_tgt.decode(hypothesis).split())

"""


_MARIAN_NOTE = """
This run came from a Hugging Face Marian directory: its pieces map to ids by name (vocab.json), as here.
MarianTokenizer also reads a leading >>lang<< code and special-token strings in the text as single tokens,
which plain sp_src.encode does not; the run bans {pad!r} while decoding (decode.ban_pad): pass
suppress_sequences=[[{pad!r}]] to translate_batch."""


def _moses_note(tok) -> str:
    if tok.pretokenize != "moses":
        return ""
    return _MOSES_NOTE.format(src=tok.src.lang, tgt=tok.tgt.lang, lower=".lower()" if tok.src.lowercases else "")


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, quantization: str | None = None,
               *, force: bool = False) -> Path:
    """``aiayn export ctranslate2 RUN OUT_DIR``: export a run's model with its vocabularies, copy its
    tokenizer files into ``out_dir`` and write a README.txt there; return ``out_dir``.

    User errors (not a run, ``out_dir`` already there, a bad quantization name) are one-line
    :class:`~aiayn.config.ConfigError` / :class:`~aiayn.errors.CheckpointError`; the tasks and model options it
    takes are checked first, by :mod:`aiayn.interop.registry`.
    The directory is assembled beside ``out_dir`` and renamed into place, so a failure leaves nothing.
    """
    from aiayn.errors import ConfigError, require
    from aiayn.run.directory import load_run
    from aiayn.run.weights import inference_weights_path

    require("ctranslate2", "ct2", "aiayn export ctranslate2")
    registry.check("ctranslate2", run_dir)  # a direct call refuses what aiayn export refuses
    out = Path(out_dir)
    check_output_dir(out, [run_dir], force)
    run = load_run(run_dir, "cpu")
    tok = run.tokenizers
    vocab = [tok.src.id_to_piece(i) for i in range(tok.src.vocab_size)]
    tgt_vocab = None if tok.shared else [tok.tgt.id_to_piece(i) for i in range(tok.tgt.vocab_size)]
    sp = tok.specials  # aiayn's ids, or those of an imported Marian run (eos 0, decoder start = pad)
    try:
        spec = ctranslate2_spec(run.model, vocab, tgt_vocab, unk_id=sp.unk, bos_id=sp.decoder_start, eos_id=sp.eos)
        spec.optimize(quantization=quantization)
    except ValueError as e:  # a bad quantization name, or a vocabulary that does not fit
        raise ConfigError(f"cannot export {run_dir}: {first_line(e)}") from None
    with locked(out), staged_directory(out) as stage:
        spec.save(str(stage))
        tdir = Path(run_dir) / "tokenizer"
        tok_files = sorted(p.name for p in tdir.iterdir() if p.is_file() and not p.name.startswith("."))
        for name in tok_files:
            if (stage / name).exists():
                raise ConfigError(f"tokenizer file {name} would overwrite a CTranslate2 file")
            shutil.copy2(tdir / name, stage / name)
        cfg, d = run.cfg, run.cfg.decode
        # Paths relative to the directory that holds the export: no path of this machine goes into the file.
        here = Path(out.name)
        src_model = str(here / ("shared.model" if tok.shared else "src.model"))
        tgt_model = str(here / ("shared.model" if tok.shared else "tgt.model"))
        if tok.src.kind == "marian":  # pieces of source.spm / target.spm; CTranslate2 maps them by name, as vocab.json
            src_model, tgt_model = str(here / "source.spm"), str(here / "target.spm")
        elif tok.src.kind != "bpe":
            src_model = tgt_model = "(a char tokenizer: split the text into characters instead of spm)"
        readme = _README.format(
            run=Path(run_dir).resolve().name, layers=f"{cfg.model.n_encoder_layers}+{cfg.model.n_decoder_layers}",
            d_model=cfg.model.d_model, weights=inference_weights_path(run_dir).name, quant=quantization or "none",
            tok_files=", ".join(tok_files), kind=tok.src.kind, vocab="shared" if tok.shared else "separate",
            src_model=src_model, tgt_model=tgt_model, out=here, example="A sentence to translate.",
            moses_note=_moses_note(tok), eos=vocab[sp.eos], start=vocab[sp.decoder_start],
            marian_note=_MARIAN_NOTE.format(pad=vocab[sp.pad]) if tok.src.kind == "marian" else "",
            beam=d.beam, alpha=d.alpha, lp=d.length_penalty, a=d.max_len_a, b=d.max_len_b,
            lp_note="" if d.length_penalty == "power" else " (not 'power': CTranslate2's beam ranks differently)",
        )
        (stage / "README.txt").write_text(readme, encoding="utf-8")
    return out
