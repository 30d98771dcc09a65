"""Rotary positions (``model.positional: rotary``; RoFormer, not in the paper) through the PositionScheme hook:
the rotation against the complex-number formula, a run trained with them (the loss falls), decoding with the KV
cache equal to decoding without it (greedy and beam, encoder-decoder and language model, left-padded batches
equal to each row alone), the Marian export refusing them in one line, CTranslate2 and Argos exporting them."""

from __future__ import annotations

import json
import math
import zipfile

import pytest
import torch
from conftest import (  # tests/ is on sys.path under pytest
    GREEDY_GAP,
    NO_EOS,
    REPO,
    assert_close_at_scale,
    greedy_gap,
    rescored,
    same_hypotheses,
    seq2seq_greedy_gap,
    spec_of,
)
from tiny_recipe import TINY_RUN_OVERRIDES

from aiayn.config import ConfigError, ModelConfig
from aiayn.model import DecoderOnlyLM, Transformer, build_model
from aiayn.model.positions import RotaryPositions, token_positions
from aiayn.search import beam_search, greedy_search, sample_list, sample_rows

pytestmark = pytest.mark.usefixtures("one_thread")

PAD, BOS, EOS = 0, 2, 3


def rotary_config(**kw) -> ModelConfig:
    base = dict(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                max_positions=64, positional="rotary")
    return ModelConfig(**{**base, **kw})


def complex_rotation(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoFormer's rotation as a complex product, in float64: the pair (x_i, x_{i+K/2}) is z_i = x_i + j x_{i+K/2},
    turned to z_i e^{j m theta_i}, theta_i = 10000^(-2i/K), at position m. x (..., T, K), positions (T,)."""
    K = x.size(-1)
    theta = 10000.0 ** (-torch.arange(0, K, 2, dtype=torch.float64) / K)  # (K/2,)
    turn = torch.polar(torch.ones(len(positions), K // 2, dtype=torch.float64),
                       positions.double()[:, None] * theta)  # (T, K/2)
    z = torch.complex(x[..., : K // 2].double(), x[..., K // 2:].double()) * turn
    return torch.cat((z.real, z.imag), dim=-1)


def test_rotation_is_the_complex_product_and_scores_depend_on_distance_only():
    torch.manual_seed(0)
    scheme = RotaryPositions(64, 16)
    q, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    pos = scheme.at(5, past=7)
    rq, rk = scheme.rotate(q, k, pos)
    assert_close_at_scale(rq, complex_rotation(q, torch.arange(7, 12)), 1e-6, "q")
    assert_close_at_scale(rk, complex_rotation(k, torch.arange(7, 12)), 1e-6, "k")
    # q at m, k at n: the score depends on m - n only (the same pair 20 positions later scores the same) ...
    later_q, later_k = scheme.rotate(q, k, scheme.at(5, past=27))
    assert_close_at_scale(later_q @ later_k.transpose(-1, -2), rq @ rk.transpose(-1, -2), 1e-5, "shifted")
    # ... and changes with it (a wrong offset would not go unnoticed)
    assert not torch.allclose(rq @ rk.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-2)
    # left-padded rows (each at its own positions) turn exactly as a row that starts there
    padded = scheme.at(5, past=7, left_pad=torch.tensor([0, 3]))
    pq, _ = scheme.rotate(q, k, padded)
    assert torch.equal(pq[0], rq[0])
    assert torch.equal(pq[1], scheme.rotate(q, k, scheme.at(5, past=4))[0][1])
    assert torch.equal(padded.index[1], token_positions(5, 7, torch.tensor([3])).index[0])


def test_rotary_models_hold_no_position_weights_and_are_not_permutation_equivariant():
    torch.manual_seed(0)
    rotary = Transformer(rotary_config()).eval()
    sinusoidal = Transformer(rotary_config(positional="sinusoidal"))
    assert rotary.state_dict().keys() == sinusoidal.state_dict().keys()  # the tables are not saved
    assert not any("positions" in name for name, _ in rotary.named_parameters())
    src = torch.randint(4, 50, (1, 6))
    perm = torch.tensor([5, 1, 2, 3, 4, 0])
    with torch.no_grad():  # without positions self-attention is permutation-equivariant; rotated, it is not
        assert not torch.allclose(rotary.encode(src[:, perm]), rotary.encode(src)[:, perm], atol=1e-3)
    with pytest.raises(ConfigError, match="rotary positions need an even"):
        rotary_config(d_model=36, n_heads=4)  # 9 dimensions per head: no pairs
    with pytest.raises(ValueError, match="max_positions=64"):
        DecoderOnlyLM(rotary_config())(torch.ones(1, 65, dtype=torch.long))


# Trained: a run of the tests' tiny recipe with rotary positions --------------------------------------------------


@pytest.fixture(scope="module")
def rotary_run(tmp_path_factory):
    """The tests' tiny reverse-task run (tests/tiny_recipe.py) with ``model.positional=rotary``, through the
    config, the trainer, the checkpoint and the loader. Not a quality model."""
    from aiayn.config import load_config
    from aiayn.train.run import train

    run_dir = tmp_path_factory.mktemp("rotary") / "run"
    cfg = load_config(REPO / "configs" / "tiny_reverse.yaml", [*TINY_RUN_OVERRIDES, "model.positional=rotary"])
    train(cfg, run_dir, progress=False)
    return run_dir


def test_a_rotary_run_trains_and_decodes_with_the_cache_as_without(rotary_run):
    import aiayn

    records = [json.loads(line) for line in (rotary_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses  # fixed seed; only that the loss went down
    translator = aiayn.load(rotary_run, device="cpu")
    assert translator.cfg.model.positional == "rotary"
    model = translator.model
    sources = ["a b c d", "hello world", "x"]
    src = [translator.tokenizers.src.encode(s) + [translator.tokenizers.specials.eos] for s in sources]
    batch = torch.full((len(src), max(map(len, src))), PAD)
    for i, s in enumerate(src):
        batch[i, : len(s)] = torch.tensor(s)
    spec = spec_of(max_len_b=5)
    assert greedy_search(model, batch, spec=spec) == greedy_search(model, batch, spec=spec, use_cache=False)
    assert len(translator.translate(sources)) == 3


# Cached = uncached, batch 1 = batch N (random tiny models whose outputs end at varied lengths) -------------------


@pytest.fixture(scope="module")
def rotary_mt():
    torch.manual_seed(1)
    m = build_model(rotary_config(output_bias=True)).eval()
    with torch.no_grad():
        m.decoder.output_bias[EOS] = 3.0  # a random model rarely ends; this one ends at varied lengths
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 16, (12,), generator=g)
    src = torch.full((12, int(lengths.max())), PAD)
    for i, n in enumerate(lengths.tolist()):
        src[i, :n] = torch.randint(4, 50, (n,), generator=g)
    return m, src, lengths


def test_encoder_decoder_cached_logits_equal_the_teacher_forced_ones(rotary_mt):
    m, src, _ = rotary_mt
    tgt = torch.randint(4, 50, (src.size(0), 9))
    with torch.no_grad():
        full = m(src, tgt)
        mask = m.src_mask(src)
        memory, cache = m.encode(src, mask), m.new_cache()
        steps = [m.decode(tgt[:, :4], memory, mask, cache)]  # a prefill of 4, then one step at a time
        steps += [m.decode(tgt[:, t: t + 1], memory, mask, cache) for t in range(4, 9)]
    assert_close_at_scale(torch.cat(steps, dim=1), full, 1e-5, "cached")


def test_encoder_decoder_greedy_and_beam_cached_equal_uncached_and_alone(rotary_mt):
    m, src, lengths = rotary_mt
    spec = spec_of(max_len_a=1.0, max_len_b=5)
    batched = greedy_search(m, src, spec=spec)
    limits = [n + 5 for n in lengths.tolist()]
    assert any(len(o) < lim for o, lim in zip(batched, limits)), "no sentence ended by EOS"
    assert any(len(o) == lim for o, lim in zip(batched, limits)), "no sentence cut at max_len"
    assert greedy_search(m, src, spec=spec, use_cache=False) == batched
    clear = [i for i, n in enumerate(lengths.tolist())
             if seq2seq_greedy_gap(m, src[i: i + 1, :n], batched[i], len(batched[i]) < limits[i]) > GREEDY_GAP]
    assert len(clear) >= 0.75 * len(batched)
    for i in clear:
        assert greedy_search(m, src[i: i + 1, : int(lengths[i])], spec=spec) == [batched[i]]
    beam_spec = spec_of(beam=4, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=2)
    beams = beam_search(m, src, spec=beam_spec)
    swaps = 0
    for i, n in enumerate(lengths.tolist()):
        found = [(h.tokens, h.score) for h in beams[i]]
        # cached (the search) = uncached (each hypothesis teacher-forced in one pass)
        swaps += same_hypotheses(found, rescored(m, src[i, :n].tolist(), [t for t, _ in found], beam_spec), i)
        alone = beam_search(m, src[i: i + 1, :n], spec=beam_spec)[0]
        swaps += same_hypotheses([(h.tokens, h.score) for h in alone], found, i)
    assert swaps <= len(beams) // 4


@pytest.fixture(scope="module")
def rotary_lm():
    torch.manual_seed(2)
    return build_model(rotary_config(), "lm").eval()


def test_lm_cached_equals_uncached_with_left_padding(rotary_lm, monkeypatch):
    lm = rotary_lm
    tokens = torch.randint(4, 50, (3, 12))
    left_pad = torch.tensor([0, 3, 7])
    # Rotary scores depend on distances only, so a row turned at the wrong (unpadded) positions would still match
    # its unpadded self up to rounding: the positions each forward hands the rotation are checked as well.
    seen = []
    rotation = lm.decoder.positions.rotation
    monkeypatch.setattr(lm.decoder.positions, "rotation", lambda pos: seen.append(pos) or rotation(pos))
    with torch.no_grad():
        cache = lm.new_cache()
        steps = [lm.decode(tokens[:, :8], cache=cache, left_pad=left_pad)]
        steps += [lm.decode(tokens[:, t: t + 1], cache=cache, left_pad=left_pad) for t in range(8, 12)]
        padded = torch.cat(steps, dim=1)
    assert [(p.start, p.end) for p in seen] == [(0, 8), (8, 9), (9, 10), (10, 11), (11, 12)]  # once per forward
    cols = torch.arange(12)
    assert torch.equal(torch.cat([p.index for p in seen], dim=1), (cols - left_pad[:, None]).clamp(min=0))
    with torch.no_grad():
        for b, p in enumerate(left_pad.tolist()):  # each row = the row alone without its padding, uncached
            assert_close_at_scale(padded[b, p:], lm(tokens[b: b + 1, p:])[0], 1e-5, b)


def test_lm_greedy_cached_equals_uncached_and_left_padded_rows_equal_each_alone(rotary_lm):
    lm = rotary_lm
    prompt = [BOS, 7, 8, 9]
    spec = spec_of(eos_id=NO_EOS, sample=True, temperature=0)
    cached = sample_list(lm, prompt, spec, 30)
    assert greedy_gap(lm, prompt, cached) > GREEDY_GAP
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(30):  # argmax of a full forward pass each step: no cache
            tokens.append(int(lm(torch.tensor([tokens]))[0, -1].argmax()))
    assert cached == tokens[len(prompt):] == sample_list(lm, prompt, spec, 30, use_cache=False)
    # past a context limit of 16 the model sees the last 16 tokens only (cached start, then windowed)
    windowed = list(prompt)
    with torch.no_grad():
        for _ in range(30):
            windowed.append(int(lm(torch.tensor([windowed[-16:]]))[0, -1].argmax()))
    assert sample_list(lm, prompt, spec, 30, context_limit=16) == windowed[len(prompt):]
    assert sample_list(lm, prompt, spec, 30, context_limit=16, use_cache=False) == windowed[len(prompt):]
    prompts = [[2, 5, 6, 7], [2, 9], [2, 11, 12, 13, 14, 15, 16, 17], [2]]
    limits, seeds = [10, 6, 12, 3], [11, 12, 13, 14]
    for opts in ({}, {"sample": True, "top_k": 5}):
        rows: list[list[int]] = [[] for _ in prompts]
        for step in sample_rows(lm, prompts, spec_of(**opts), limits, seeds):
            for r, t in enumerate(step):
                if t is not None:
                    rows[r].append(t)
        alone = [sample_list(lm, p, spec_of(**opts, seed=s), n) for p, s, n in zip(prompts, seeds, limits)]
        if not opts:
            assert min(greedy_gap(lm, p, a) for p, a in zip(prompts, alone)) > GREEDY_GAP
        assert rows == alone, opts


def test_training_steps_lower_the_loss_of_both_model_kinds():
    """A few optimizer steps on one fixed batch (fixed seed): the loss goes down, for the encoder-decoder and the
    language model (gradients reach every weight through the rotated attention)."""
    for task in ("translation", "lm"):
        torch.manual_seed(3)
        model = build_model(rotary_config(), task).train()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        seq = torch.randint(4, 50, (8, 10))
        losses = []
        for _ in range(15):
            logits = model(seq, seq[:, :-1]) if task == "translation" else model(seq[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert math.isfinite(losses[-1]) and losses[-1] < losses[0], (task, losses)


# Exports ---------------------------------------------------------------------------------------------------------


def test_marian_refuses_a_rotary_run_in_one_line_and_ctranslate2_and_argos_export_it(rotary_run, tmp_path, capsys):
    """HF Marian adds sinusoids to its embeddings: ``export hf`` refuses (exit 2, one line, nothing written).
    CTranslate2 rotates itself (tests/test_ctranslate2.py proves a rotary model's log-probs, greedy and beam equal
    there): ``export ctranslate2`` writes the run, whose beam search is aiayn's, and ``export argos`` packages it."""
    from aiayn import cli
    from aiayn.interop.marian import to_hf_marian

    with pytest.raises(ValueError, match="rotary"):
        to_hf_marian(Transformer(rotary_config(positional_layout="concat")))
    capsys.readouterr()
    assert cli.main(["export", "hf", str(rotary_run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aiayn: error: ") and "rotary" in err and "\n" not in err, err
    assert not (tmp_path / "hf").exists()

    ctranslate2 = pytest.importorskip("ctranslate2")
    import aiayn

    assert cli.main(["export", "ctranslate2", str(rotary_run), str(tmp_path / "ct2")]) == 0
    translator = aiayn.load(rotary_run, device="cpu")
    tok, d = translator.tokenizers, translator.cfg.decode
    piece_ids = {tok.tgt.id_to_piece(i): i for i in range(tok.tgt.vocab_size)}
    texts = ["a b c d", "hello world", "the cat", "x y"]
    pieces = [[tok.src.id_to_piece(i) for i in tok.src.encode(t)] for t in texts]
    ct2 = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", inter_threads=1, intra_threads=1)
    results = ct2.translate_batch(pieces, beam_size=d.beam, num_hypotheses=d.beam, length_penalty=d.alpha,
                                  patience=1000.0, return_end_token=True, max_decoding_length=12,
                                  min_decoding_length=0, return_scores=True)  # aiayn's exact stop, |Y| with EOS
    swaps = 0
    for text, r in zip(texts, results):
        src = tok.src.encode(text) + [tok.specials.eos]
        spec = spec_of(beam=d.beam, alpha=d.alpha, length_penalty="power", nbest=d.beam, max_len_a=0.0, max_len_b=12,
                       stop="exact")
        ours = beam_search(translator.model, torch.tensor([src]), spec=spec)[0]
        theirs = [[piece_ids[p] for p in h if p != "</s>"] for h in r.hypotheses]
        swaps += same_hypotheses([(h.tokens, h.score) for h in ours], list(zip(theirs, r.scores)), text)
    assert swaps <= len(texts) // 4
    pytest.importorskip("argostranslate")
    assert cli.main(["export", "argos", str(rotary_run), str(tmp_path / "en_de.argosmodel")]) == 0
    with zipfile.ZipFile(tmp_path / "en_de.argosmodel") as z:  # the package holds that very CTranslate2 model
        [model_bin] = [n for n in z.namelist() if n.endswith("/model/model.bin")]
        assert z.read(model_bin) == (tmp_path / "ct2" / "model.bin").read_bytes()
