"""Proofs for the model (issue 2): equivalence with torch's own attention, cached = uncached decoding,
padding invariance, causality, eq. 4-5 values and the paper's parameter count."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close_at_scale  # tests/ is on sys.path under pytest
from torch import nn

from aiayn import build_model, model_config
from aiayn.config import ConfigError
from aiayn.model import (
    MultiHeadAttention,
    count_parameters,
    scaled_dot_product_attention,
    sinusoidal_table,
)

torch.manual_seed(0)


def tiny(task: str = "translation", **over):
    values = dict(vocab_size=53, dropout=0.0)
    values.update(over)
    return build_model(model_config("tiny", **values), task).eval()


def copy_to_torch_mha(ours: MultiHeadAttention) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(ours.d_model, ours.n_heads, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.in_proj.weight)
        ref.in_proj_bias.copy_(ours.in_proj.bias)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref.eval()


# 1. MultiHeadAttention equals torch.nn.MultiheadAttention -------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
def test_self_attention_matches_torch_with_padding_and_causal_masks(need_weights):
    torch.manual_seed(1)
    ours = MultiHeadAttention(32, 4).eval()
    with torch.no_grad():  # non-zero biases so the bias layout is checked too
        ours.in_proj.bias.normal_()
        ours.out_proj.bias.normal_()
    ref = copy_to_torch_mha(ours)
    x = torch.randn(3, 7, 32)
    lengths = torch.tensor([7, 5, 2])
    keep = torch.arange(7)[None, :] < lengths[:, None]  # (B, T) True = real token
    causal = torch.tril(torch.ones(7, 7, dtype=torch.bool))
    # Ours: "may attend" masks; torch: True = masked out.
    mask = keep[:, None, None, :] & causal
    out, probs = ours(x, mask=mask, need_weights=need_weights)
    ref_out, ref_w = ref(x, x, x, key_padding_mask=~keep, attn_mask=~causal, average_attn_weights=False)
    assert_close_at_scale(out, ref_out, 1e-5, "output")
    if need_weights:
        assert_close_at_scale(probs, ref_w, 1e-5, "weights")


def test_cross_attention_matches_torch():
    torch.manual_seed(2)
    ours = MultiHeadAttention(24, 3).eval()
    with torch.no_grad():
        ours.in_proj.bias.normal_()
    ref = copy_to_torch_mha(ours)
    x, mem = torch.randn(2, 4, 24), torch.randn(2, 6, 24)
    keep = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    out, _ = ours(x, memory=mem, mask=keep[:, None, None, :])
    ref_out, _ = ref(x, mem, mem, key_padding_mask=~keep)
    assert_close_at_scale(out, ref_out, 1e-5, "cross-attention output")


def test_fast_and_explicit_attention_paths_agree_and_masked_rows_are_zero():
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.rand(2, 1, 5, 6) > 0.4
    mask[0, 0, 2] = False  # a query row that may attend to nothing
    fast, none = scaled_dot_product_attention(q, k, v, mask, fused=True)
    slow, probs = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert none is None
    assert torch.isfinite(fast).all() and torch.isfinite(slow).all()
    assert_close_at_scale(fast, slow, 1e-5, "fused vs explicit attention")
    assert fast[0, :, 2].abs().max().item() == 0.0 and probs[0, :, 2].abs().max().item() == 0.0
    # Rows with something to attend to are proper distributions with zero mass on masked keys.
    live = mask.any(-1).expand(2, 2, 5)
    torch.testing.assert_close(probs.sum(-1)[live], torch.ones(int(live.sum())))
    assert probs.masked_select(~mask.expand_as(probs)).abs().max().item() == 0.0
    # Eq. 1 by hand for one row.
    s = (q[1, 1, 0] @ k[1, 1].T) / math.sqrt(8)
    s[~mask[1, 0, 0]] = float("-inf")
    torch.testing.assert_close(slow[1, 1, 0], torch.softmax(s, -1) @ v[1, 1])


def test_attention_path_restores_the_length_rule_and_rejects_unknown_paths():
    from aiayn.engine import ATTENTION_RULE, attention_path

    model = build_model(model_config("tiny", vocab_size=50))
    rules = lambda: {id(m): m.explicit_max_keys for m in model.modules() if isinstance(m, MultiHeadAttention)}  # noqa: E731
    before = rules()
    assert len(before) == 6 and all(r == ATTENTION_RULE for r in before.values())  # build_model set the rule
    with pytest.raises(RuntimeError), attention_path(model, "fused"):
        assert all(r == {} for r in rules().values())
        raise RuntimeError("boom")
    assert rules() == before
    with attention_path(model, "explicit"):
        assert all(r["cpu"] >= 100_000 for r in rules().values())
    assert rules() == before
    with pytest.raises(ValueError, match="unknown attention path"), attention_path(model, "flash"):
        pass


@pytest.mark.parametrize("causal", [False, True])
def test_fused_and_explicit_paths_agree_in_values_and_gradients(causal):
    """CPU picks the explicit path for short keys and the fused kernel for long ones
    (aiayn.engine.ATTENTION_RULE): both must give the same outputs and gradients, causal flag included."""
    torch.manual_seed(5)
    B, H, T, K = 3, 2, 7, 8
    base = [torch.randn(B, H, T, K) for _ in range(3)]
    keep = torch.arange(T)[None, :] < torch.tensor([7, 4, 1])[:, None]
    mask = None if causal else keep[:, None, None, :]
    results = []
    for fused in (True, False):
        q, k, v = (t.clone().requires_grad_() for t in base)
        out, _ = scaled_dot_product_attention(q, k, v, mask, is_causal=causal, fused=fused)
        out.pow(2).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for name, fused, explicit in zip(("out", "dq", "dk", "dv"), *results):
        assert_close_at_scale(fused, explicit, 1e-5, name)
    if causal:  # the flag equals an explicit lower-triangular mask
        tril = torch.ones(T, T, dtype=torch.bool).tril()
        ref, _ = scaled_dot_product_attention(*base, tril)
        assert_close_at_scale(results[1][0], ref, 1e-5, "is_causal vs tril")


# 3. Cached incremental decoding equals teacher-forced decoding ---------------------------------------


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoding_equals_full_decoding_transformer(norm_first):
    torch.manual_seed(4)
    model = tiny(norm_first=norm_first)
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt = torch.tensor([[2, 11, 12, 13, 14, 15], [2, 16, 17, 18, 19, 20]])
    mask = model.src_mask(src)
    memory = model.encode(src, mask)
    full = model.decode(tgt, memory, mask)
    cache = model.new_cache()
    # First a 2-token prefix at once (prefill), then one token at a time.
    steps = [model.decode(tgt[:, :2], memory, mask, cache)]
    steps += [model.decode(tgt[:, t : t + 1], memory, mask, cache) for t in range(2, tgt.size(1))]
    assert cache.length == tgt.size(1)
    assert_close_at_scale(torch.cat(steps, 1), full, 1e-5, "cached steps")


@pytest.mark.parametrize("path", ["explicit", "fused"])
def test_beams_sharing_a_memory_row_equal_a_copy_per_beam(path):
    """Beam search keeps one memory row per sentence for its N beams (grouped cross-attention): the logits, cached
    or not, and the cross-attention probabilities equal those of a memory copied to every beam, on both attention
    paths (the fused one rests on PyTorch's kernel, the explicit one on the matmuls)."""
    from aiayn.engine import attention_path

    torch.manual_seed(7)
    model = tiny()
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    mask = model.src_mask(src)
    memory, G = model.encode(src, mask), 3
    tgt = torch.randint(4, 53, (2 * G, 5))  # rows 0-2: sentence 0's beams, rows 3-5: sentence 1's
    copied, copied_mask = memory.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    with attention_path(model, path):
        assert_close_at_scale(model.decode(tgt, memory, mask), model.decode(tgt, copied, copied_mask), 1e-5, "full")
        shared, per_beam = model.new_cache(), model.new_cache()
        for t in range(tgt.size(1)):
            got = model.decode(tgt[:, t: t + 1], memory, mask, shared)
            want = model.decode(tgt[:, t: t + 1], copied, copied_mask, per_beam)
            assert_close_at_scale(got, want, 1e-5, f"cached step {t}")
    _, _, cross = model.decoder(tgt, memory, mask, need_weights=True)
    _, _, cross_copied = model.decoder(tgt, copied, copied_mask, need_weights=True)
    for a, b in zip(cross, cross_copied):
        assert a.shape == b.shape == (2 * G, 4, 5, 5)
        assert_close_at_scale(a, b, 1e-5, "cross-attention probabilities")


def test_cached_decoding_equals_full_decoding_lm_and_reorder():
    torch.manual_seed(5)
    model = tiny("lm")
    tokens = torch.randint(4, 53, (3, 9))
    full = model(tokens)
    cache = model.new_cache()
    out = [model.decode(tokens[:, t : t + 1], cache=cache) for t in range(tokens.size(1))]
    assert_close_at_scale(torch.cat(out, 1), full, 1e-5, "cached steps")
    # reorder: keep rows 2 and 0 (as beam search does); the next step matches a fresh run of those rows.
    cache = model.new_cache()
    model.decode(tokens[:, :5], cache=cache)
    cache.reorder(torch.tensor([2, 0]))
    nxt = model.decode(tokens[[2, 0], 5:6], cache=cache)
    assert_close_at_scale(nxt, model(tokens[[2, 0], :6])[:, -1:], 1e-5, "after reorder")


# 4. Padding invariance ---------------------------------------------------------------------------------


def test_outputs_do_not_depend_on_padding_or_batch_neighbours():
    torch.manual_seed(6)
    model = tiny()
    srcs = [[5, 6, 7, 3], [8, 9, 10, 11, 12, 13, 3], [14, 3]]
    tgts = [[2, 20, 21], [2, 22, 23, 24, 25], [2, 26]]
    S, T = max(map(len, srcs)), max(map(len, tgts))
    src = torch.tensor([s + [0] * (S - len(s)) for s in srcs])
    tgt = torch.tensor([t + [0] * (T - len(t)) for t in tgts])
    batched = model(src, tgt)
    for i, (s, t) in enumerate(zip(srcs, tgts)):
        alone = model(torch.tensor([s]), torch.tensor([t]))
        assert_close_at_scale(batched[i, : len(t)], alone[0], 1e-5, f"row {i} batched vs alone")


# 5. Causality ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_future_tokens_do_not_change_earlier_logits(task):
    torch.manual_seed(7)
    model = tiny(task)
    tgt = torch.randint(4, 53, (2, 8))
    changed = tgt.clone()
    changed[:, 5:] = torch.randint(4, 53, (2, 3))
    if task == "lm":
        a, b = model(tgt), model(changed)
    else:
        src = torch.randint(4, 53, (2, 6))
        a, b = model(src, tgt), model(src, changed)
    assert (a[:, :5] - b[:, :5]).abs().max().item() == 0.0
    assert (a[:, 5:] - b[:, 5:]).abs().max().item() > 1e-3  # the change did reach later positions


# 6. Positional encodings equal eq. 4-5 -------------------------------------------------------------------


def test_sinusoidal_values_equal_equations_4_and_5():
    d = 64
    table = sinusoidal_table(200, d)
    concat = sinusoidal_table(200, d, "concat")
    g = torch.Generator().manual_seed(8)
    for pos, i in zip(torch.randint(0, 200, (50,), generator=g), torch.randint(0, d // 2, (50,), generator=g)):
        pos, i = int(pos), int(i)
        angle = pos / 10000 ** (2 * i / d)
        assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
        assert concat[pos, i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert concat[pos, d // 2 + i].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_model_adds_scaled_embedding_and_position():
    model = tiny()
    model.train(False)
    tok = torch.tensor([[7, 9]])
    emb = model.encoder.embed.weight[[7, 9]] * math.sqrt(64)
    x = model.encoder.embed(tok) + model.encoder.positions(2)
    torch.testing.assert_close(x[0], emb + sinusoidal_table(2, 64))


# 7. Parameter counts and sharing ---------------------------------------------------------------------------


def test_paper_base_has_about_65m_parameters():
    n = count_parameters(build_model(model_config("paper-base", vocab_size=37000)))
    assert 63_000_000 <= n <= 65_000_000, n


def test_embedding_sharing_switches():
    shared = tiny()
    assert shared.encoder.embed is shared.decoder.embed
    assert shared.decoder.output_proj.weight is shared.encoder.embed.weight
    sep = tiny(share_embeddings=False, tie_output=False)
    assert sep.encoder.embed is not sep.decoder.embed
    assert sep.decoder.output_proj.weight is not sep.decoder.embed.weight
    # Two extra V x D matrices when nothing is shared.
    assert count_parameters(sep) - count_parameters(shared) == 2 * 53 * 64


def test_post_ln_has_no_final_norm_and_pre_ln_has_one():
    assert tiny().encoder.final_norm is None and tiny().decoder.final_norm is None
    pre = tiny(norm_first=True)
    assert pre.encoder.final_norm is not None and pre.decoder.final_norm is not None


def test_xavier_initialisation_of_projections():
    torch.manual_seed(9)
    model = build_model(model_config("small", vocab_size=100))
    w = model.encoder.layers[0].ffn.fc1.weight  # (d_ff, D)
    bound = math.sqrt(6 / (w.size(0) + w.size(1)))
    assert w.abs().max().item() <= bound
    assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)  # uniform(-b, b) has std b/sqrt(3)
    q = model.encoder.layers[0].self_attn.in_proj.weight[:256]
    assert q.abs().max().item() <= math.sqrt(6 / 512)


def test_dropout_is_applied_only_in_training():
    torch.manual_seed(10)
    model = build_model(model_config("tiny", vocab_size=53, dropout=0.3))
    src, tgt = torch.randint(4, 53, (2, 5)), torch.randint(4, 53, (2, 4))
    model.train()
    assert not torch.equal(model(src, tgt), model(src, tgt))
    model.eval()
    assert torch.equal(model(src, tgt), model(src, tgt))


def test_learned_positions_and_activations_build():
    for over in (dict(positional="learned"), dict(activation="gelu"), dict(activation="swish")):
        model = tiny(**over)
        assert model(torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7]])).shape == (1, 2, 53)
    assert "decoder.positions.weight" in dict(tiny(positional="learned").named_parameters())


def test_too_long_input_is_a_clear_error():
    model = tiny(max_positions=8)
    with pytest.raises(ValueError, match="max_positions=8"):
        model(torch.randint(4, 53, (1, 9)), torch.tensor([[2]]))


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(d_model=30, n_heads=4), "not divisible"),
        (dict(activation="tanh"), "model.activation"),
        (dict(positional="alibi"), "model.positional"),
        (dict(positional="rotary", d_model=36, n_heads=4), "rotary positions need an even"),
        (dict(share_embeddings=True, tgt_vocab_size=10), "share_embeddings"),
        (dict(dropout=1.5), "dropout"),
    ],
)
def test_impossible_configs_are_rejected(over, message):
    with pytest.raises(ConfigError, match=message):
        model_config("tiny", **over)


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigError, match="unknown config key model.d_modle"):
        model_config("tiny", d_modle=64)
