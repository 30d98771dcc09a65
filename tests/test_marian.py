"""Hugging Face Marian <-> aiayn: copied weights give the same logits (padded batches included),
the round trip is bit-exact, and what Marian cannot represent is refused with the option to change.

Marian is an independent implementation of the same post-LN Transformer (concat sinusoids, sqrt(D)
embedding scale, final_logits_bias), so agreement to 1e-4 pins every weight's place and layout.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import MarianConfig, MarianMTModel  # noqa: E402

from aiayn.config import ModelConfig  # noqa: E402
from aiayn.interop.marian import (  # noqa: E402
    from_hf_marian,
    marian_config_from,
    model_config_from_marian,
    to_hf_marian,
)
from aiayn.model import DecoderOnlyLM, Transformer, sinusoidal_table  # noqa: E402

V, PAD, BOS, EOS = 96, 0, 2, 3
TOL = 1e-4


def hf_model(seed: int = 0, **over) -> MarianMTModel:
    """A random Marian configured like an aiayn model (relu, post-LN, sqrt(D) scale, shared vocab)."""
    torch.manual_seed(seed)
    values = dict(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        activation_function="relu", scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS, forced_eos_token_id=None,
        decoder_start_token_id=PAD, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )
    values.update(over)
    model = MarianMTModel(MarianConfig(**values)).eval()
    with torch.no_grad():  # HF initialises biases to 0 and LayerNorms to (1, 0): randomise everything
        for name, p in model.named_parameters():
            if "embed_positions" not in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def aiayn_model(seed: int = 0, **over) -> Transformer:
    torch.manual_seed(seed)
    values = dict(
        vocab_size=V, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
        dropout=0.0, max_positions=64, positional_layout="concat",
    )
    values.update(over)
    model = Transformer(ModelConfig(**values)).eval()
    with torch.no_grad():  # biases start at 0 and LayerNorms at (1, 0): randomise them too
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def padded_batch(src_vocab: int = V, tgt_vocab: int = V, start: int = PAD):
    """Right-padded sources ending in EOS (lengths 9, 5, 2) and decoder inputs (lengths 7, 3, 5)."""
    g = torch.Generator().manual_seed(1)
    src = torch.full((3, 9), PAD)
    for i, n in enumerate([9, 5, 2]):
        src[i, : n - 1] = torch.randint(4, src_vocab, (n - 1,), generator=g)
        src[i, n - 1] = EOS
    tgt_lengths = torch.tensor([7, 3, 5])
    tgt = torch.full((3, 7), PAD)
    for i, n in enumerate(tgt_lengths.tolist()):
        tgt[i, 0] = start
        tgt[i, 1:n] = torch.randint(4, tgt_vocab, (n - 1,), generator=g)
    tgt_keep = torch.arange(7)[None, :] < tgt_lengths[:, None]  # (B, T) real decoder positions
    return src, tgt, tgt_keep


def max_diff(ours: Transformer, hf: MarianMTModel, src, tgt, keep) -> float:
    with torch.no_grad():
        a = ours(src, tgt)
        b = hf(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=tgt).logits
    return (a - b)[keep].abs().max().item()


# (a) Marian -> aiayn ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "over",
    [
        {},  # shared vocabulary, tied output (the OPUS-MT layout)
        {"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 80},  # separate vocabularies
        {"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 80, "tie_word_embeddings": False},
        {"activation_function": "gelu", "scale_embedding": False},
        {"activation_function": "swish"},
    ],
    ids=["shared-tied", "separate-vocab", "untied", "gelu-unscaled", "swish"],
)
def test_from_hf_marian_matches_logits_on_padded_batch(over):
    hf = hf_model(**over)
    ours = from_hf_marian(hf)
    assert not ours.training
    src, tgt, keep = padded_batch(tgt_vocab=hf.config.decoder_vocab_size)
    diff = max_diff(ours, hf, src, tgt, keep)
    print(f"from_hf_marian max |logit diff| = {diff:.2e}")
    assert diff <= TOL, diff
    # The tolerance is meaningful: one bias entry moved by 1e-2 is seen far above it.
    with torch.no_grad():
        ours.decoder.layers[1].ffn.fc2.bias[5] += 1e-2
    assert max_diff(ours, hf, src, tgt, keep) > 10 * TOL


def test_from_hf_marian_reads_sharing_from_the_weights():
    shared = from_hf_marian(hf_model())
    assert shared.encoder.embed is shared.decoder.embed
    assert shared.decoder.output_proj.weight is shared.decoder.embed.weight
    # transformers 5 unties encoder and decoder embeddings when tie_word_embeddings is false, even
    # with share_encoder_decoder_embeddings: the converter follows the tensors, not the flag.
    hf = hf_model(tie_word_embeddings=False)
    ours = from_hf_marian(hf)
    src, tgt, keep = padded_batch()
    assert max_diff(ours, hf, src, tgt, keep) <= TOL


def test_final_logits_bias_is_carried_over():
    hf = hf_model()
    with torch.no_grad():
        hf.final_logits_bias.normal_(0.0, 1.0)
    ours = from_hf_marian(hf)
    assert ours.cfg.output_bias
    assert torch.equal(ours.decoder.output_bias, hf.final_logits_bias[0])
    src, tgt, keep = padded_batch()
    assert max_diff(ours, hf, src, tgt, keep) <= TOL
    with pytest.raises(ValueError, match="final_logits_bias is non-zero"):
        from_hf_marian(hf, output_bias=False)
    # A zero bias is dropped unless asked for.
    assert not from_hf_marian(hf_model()).cfg.output_bias
    assert from_hf_marian(hf_model(), output_bias=True).cfg.output_bias


# (b) aiayn -> Marian ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"output_bias": True},
        {"share_embeddings": False, "tgt_vocab_size": 80, "tie_output": False, "activation": "gelu"},
        {"tie_output": False, "scale_embeddings": False, "activation": "swish"},
    ],
    ids=["default", "output-bias", "separate-untied-gelu", "shared-untied-swish"],
)
def test_to_hf_marian_matches_logits(over):
    ours = aiayn_model(**over)
    hf = to_hf_marian(ours)
    assert not hf.training
    assert hf.config.decoder_start_token_id == BOS and hf.config.eos_token_id == EOS
    # Marian's own sinusoid table is ours in the concat layout (up to float rounding).
    table = sinusoidal_table(64, 32, "concat")
    assert (hf.model.encoder.embed_positions.weight - table).abs().max().item() < 1e-6
    src, tgt, keep = padded_batch(tgt_vocab=ours.cfg.target_vocab_size, start=BOS)
    diff = max_diff(ours, hf, src, tgt, keep)
    print(f"to_hf_marian max |logit diff| = {diff:.2e}")
    assert diff <= TOL, diff


def test_to_hf_marian_generate_equals_our_greedy_decoding():
    # Untied output and a raised EOS logit: varied tokens, and rows that end at different steps.
    ours = aiayn_model(seed=0, tie_output=False, output_bias=True)
    with torch.no_grad():
        ours.decoder.output_bias[EOS] += 2.0
    hf = to_hf_marian(ours)
    src, _, _ = padded_batch()
    out = hf.generate(input_ids=src, attention_mask=(src != PAD).long(), num_beams=1, do_sample=False,
                      max_new_tokens=12, min_length=0)
    with torch.no_grad():
        memory = ours.encode(src)
        ys = torch.full((3, 1), BOS)
        done = torch.zeros(3, dtype=torch.bool)
        for _ in range(12):
            nxt = ours.decode(ys, memory, src != PAD)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)  # HF pads finished rows
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            done |= nxt == EOS
            if done.all():
                break
    assert out.tolist() == ys.tolist()
    assert (ys == EOS).any(dim=1).tolist() == [False, True, True]  # the case mix this seed gives


# (c) round trip --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"output_bias": True},
        {"share_embeddings": False, "tgt_vocab_size": 80},
        {"share_embeddings": False, "tgt_vocab_size": 80, "tie_output": False, "output_bias": True},
        {"tie_output": False},
    ],
)
def test_round_trip_is_bit_identical(over):
    ours = aiayn_model(**over)
    back = from_hf_marian(to_hf_marian(ours))
    assert back.cfg == ours.cfg
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_config_round_trip():
    cfg = aiayn_model().cfg
    assert model_config_from_marian(marian_config_from(cfg)) == cfg


# (d) refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "over, option",
    [
        ({"norm_first": True}, "norm_first=false"),
        ({"positional": "learned"}, "positional=sinusoidal"),
        ({"positional_layout": "interleaved"}, "positional_layout=concat"),
        ({"layer_norm_eps": 1e-6}, "layer_norm_eps=1e-05"),
    ],
)
def test_to_hf_marian_refuses_what_marian_cannot_represent(over, option):
    with pytest.raises(ValueError, match=option.replace(".", r"\.")):
        to_hf_marian(aiayn_model(**over))


def test_refusals_on_the_marian_side():
    with pytest.raises(TypeError, match="encoder-decoder"):
        to_hf_marian(DecoderOnlyLM(ModelConfig(vocab_size=V, d_model=32, n_heads=4, d_ff=64)))
    with pytest.raises(ValueError, match="gelu_new"):
        from_hf_marian(hf_model(activation_function="gelu_new"))
    with pytest.raises(ValueError, match="one head count"):
        from_hf_marian(hf_model(decoder_attention_heads=2))
    with pytest.raises(ValueError, match="one d_ff"):
        from_hf_marian(hf_model(decoder_ffn_dim=32))
    with pytest.raises(TypeError, match="MarianMTModel"):
        from_hf_marian(aiayn_model())
