"""CTranslate2 export: the exported model scores, greedy-decodes and beam-searches exactly like ours.

CTranslate2 is an independent C++ implementation, so token-for-token agreement on several
architectures (paper post-LN with interleaved sinusoids; pre-LN with concat sinusoids, gelu and an
output bias; learned positions, swish, unscaled embeddings and separate vocabularies) pins every
weight, the position tables and the special-token conventions (source + EOS, decoder starts at BOS).
"""

from __future__ import annotations

import copy
import json
import string

import pytest
import torch
from conftest import GREEDY_GAP, pick_gap, same_hypotheses, spec_of  # tests/ is on sys.path under pytest

ctranslate2 = pytest.importorskip("ctranslate2")

from aiayn.config import ModelConfig  # noqa: E402
from aiayn.interop.ctranslate2 import export_ctranslate2  # noqa: E402
from aiayn.model import DecoderOnlyLM, Transformer  # noqa: E402
from aiayn.search import beam_search  # noqa: E402

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
LETTERS = list(string.ascii_lowercase) + [a + b for a in "xyz" for b in string.ascii_lowercase]
V, TGT_V = 48, 40
SRC_PIECES = SPECIALS + LETTERS[: V - 4]
TGT_PIECES = SPECIALS + [p.upper() for p in LETTERS[: TGT_V - 4]]  # a distinct target vocabulary
MAX_LEN = 12
TOL = 1e-4

CONFIGS = {
    # The paper: post-LN, relu, interleaved sinusoids (eq. 4-5), one shared and tied vocabulary.
    "paper": dict(),
    "preln-concat-gelu-bias": dict(
        norm_first=True, positional_layout="concat", activation="gelu", tie_output=False, output_bias=True
    ),
    "learned-swish-separate": dict(
        positional="learned", activation="swish", scale_embeddings=False, share_embeddings=False,
        tgt_vocab_size=TGT_V, tie_output=False, output_bias=True,
    ),
    # Rotary positions (not the paper): CTranslate2 rotates the self-attentions itself.
    "rotary-preln-bias": dict(positional="rotary", norm_first=True, tie_output=False, output_bias=True),
}
# A raised EOS logit (through the output bias) so hypotheses end at varied lengths, not all at MAX_LEN.
EOS_BOOST = {"preln-concat-gelu-bias": 1.0, "learned-swish-separate": 2.0, "rotary-preln-bias": 2.0}
# Sources as ids, without EOS (CTranslate2 appends it: add_source_eos), of different lengths.
SOURCES = [[4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 30, 31]]


def make_model(name: str) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=V, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2,
        dropout=0.0, max_positions=64, **CONFIGS[name],
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():  # biases start at 0 and LayerNorms at (1, 0): randomise them too
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        if model.decoder.output_bias is not None:
            model.decoder.output_bias[EOS] += EOS_BOOST[name]
    return model


def tgt_pieces(model: Transformer) -> list[str]:
    return SRC_PIECES if model.cfg.share_embeddings else TGT_PIECES


@pytest.fixture(scope="module", params=list(CONFIGS))
def exported(request, tmp_path_factory):
    """(model, translator) for each architecture, exported once per module."""
    model = make_model(request.param)
    tgt = None if model.cfg.share_embeddings else TGT_PIECES
    out = export_ctranslate2(model, SRC_PIECES, tmp_path_factory.mktemp(request.param) / "ct2", tgt_vocab=tgt)
    return model, ctranslate2.Translator(str(out), device="cpu", inter_threads=1, intra_threads=1)


def as_pieces(ids: list[int], pieces: list[str]) -> list[str]:
    return [pieces[i] for i in ids]


def as_ids(tokens: list[str], pieces: list[str]) -> list[int]:
    return [pieces.index(t) for t in tokens]


def hypotheses_as_ids(result, pieces: list[str]) -> list[list[int]]:
    """CTranslate2's n-best of one sentence as aiayn's token ids (its ``return_end_token`` ``</s>`` dropped)."""
    return [as_ids(h[:-1] if h and h[-1] == "</s>" else h, pieces) for h in result.hypotheses]


def src_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids + [EOS]])  # aiayn's source convention: tokens + EOS


@torch.no_grad()
def our_greedy(model: Transformer, ids: list[int], max_len: int) -> tuple[list[int], float, float]:
    """Argmax decoding re-running the decoder on the whole prefix (no cache): (tokens, summed logprob, the
    smallest margin of a pick over its runner-up, see conftest.pick_gap)."""
    src = src_tensor(ids)
    memory, mask = model.encode(src), src != PAD
    ys, logprob, gap = [BOS], 0.0, float("inf")
    for _ in range(max_len):
        lp = torch.log_softmax(model.decode(torch.tensor([ys]), memory, mask)[0, -1].float(), dim=-1)
        tok = int(lp.argmax())
        logprob += float(lp[tok])
        gap = min(gap, pick_gap(lp[None], [tok]))
        ys.append(tok)
        if tok == EOS:
            break
    out = ys[1:]
    return (out[:-1] if out and out[-1] == EOS else out), logprob, gap


def test_teacher_forced_log_probs_match(exported):
    """score_batch (BOS + target -> target + EOS) gives our per-token log-probabilities, padded batch."""
    model, translator = exported
    pieces = tgt_pieces(model)
    g = torch.Generator().manual_seed(5)
    targets = [torch.randint(4, len(pieces), (n,), generator=g).tolist() for n in (6, 1, 9, 3, 4)]
    results = translator.score_batch(
        [as_pieces(s, SRC_PIECES) for s in SOURCES], [as_pieces(t, pieces) for t in targets]
    )

    def worst_diff(model: Transformer) -> float:
        worst = 0.0
        with torch.no_grad():
            for s, t, r in zip(SOURCES, targets, results):
                logits = model(src_tensor(s), torch.tensor([[BOS] + t]))[0]  # (T, V)
                ours = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(t + [EOS])[:, None])[:, 0]
                assert r.tokens == as_pieces(t, pieces) + ["</s>"]
                worst = max(worst, (ours - torch.tensor(r.log_probs)).abs().max().item())
        return worst

    worst = worst_diff(model)
    print(f"max |log-prob diff| vs CTranslate2 = {worst:.2e}")
    assert worst <= TOL
    # The tolerance is meaningful: one bias entry moved by 1e-2 is seen far above it.
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.decoder.layers[1].ffn.fc2.bias[5] += 1e-2
    assert worst_diff(moved) > 10 * TOL


def test_greedy_matches_token_for_token(exported):
    model, translator = exported
    pieces = tgt_pieces(model)
    results = translator.translate_batch(
        [as_pieces(s, SRC_PIECES) for s in SOURCES],
        beam_size=1,
        max_decoding_length=MAX_LEN,
        min_decoding_length=0,  # CT2's default 1 forbids EOS at the first step; plain greedy does not
        length_penalty=0,  # CT2's default 1 divides the score by the length; we compare sums
        return_scores=True,
    )
    lengths = []
    for s, r in zip(SOURCES, results):
        tokens, logprob, gap = our_greedy(model, s, MAX_LEN)
        assert gap > GREEDY_GAP  # every pick clear of its runner-up: CTranslate2's float order cannot swap it
        assert as_ids(r.hypotheses[0], pieces) == tokens
        assert abs(r.scores[0] - logprob) <= TOL, (r.scores[0], logprob)
        lengths.append(len(tokens))
    assert len(set(lengths)) > 1 or model.decoder.output_bias is None  # the EOS boost varies lengths


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_beam_search_matches_aiayn_beam_search(exported, alpha):
    """CT2 beam 4 + length_penalty alpha == aiayn beam_search(beam=4, alpha, 'power'), all 4 hypotheses.

    CTranslate2 conventions mirrored with its own options:
    * Early stop: with a length penalty CT2 stops a sentence once beam*patience hypotheses have
      finished (fairseq's rule), which can miss a longer, better-normalized hypothesis (see
      test_ct2_default_early_stop_can_miss_the_best_hypothesis); aiayn's ``stop='exact'`` stops only
      when no live beam can still win, i.e. returns what running to max length returns. A huge
      ``patience`` makes CT2 run to max length, so both return that.
    * |Y| in score / |Y|^alpha counts the EOS step in aiayn (fairseq, HF). CTranslate2 4.8 does too;
      the C++ source of some versions divides by the hypothesis length without EOS unless
      ``return_end_token=True``, so we pass it (and strip the EOS piece) to pin the convention.
    * min_decoding_length=0: CT2's default 1 forbids EOS at the first step; aiayn's min_len is 0.
    """
    model, translator = exported
    pieces = tgt_pieces(model)
    results = translator.translate_batch(
        [as_pieces(s, SRC_PIECES) for s in SOURCES],
        beam_size=4,
        num_hypotheses=4,
        length_penalty=alpha,
        patience=1000.0,
        return_end_token=True,
        max_decoding_length=MAX_LEN,
        min_decoding_length=0,
        return_scores=True,
    )
    swaps = 0
    for s, r in zip(SOURCES, results):
        ours = beam_search(model, src_tensor(s), spec=spec_of(beam=4, alpha=alpha, length_penalty="power", nbest=4,
                                                              max_len_a=0.0, max_len_b=MAX_LEN, stop="exact"))[0]
        theirs = hypotheses_as_ids(r, pieces)
        # the same 4 hypotheses, but for two whose scores tie (conftest.TIE), which may come in either order
        swaps += same_hypotheses([(h.tokens, h.score) for h in ours], list(zip(theirs, r.scores)), s)
        for score, h, t in zip(r.scores, ours, theirs):
            if t == h.tokens:
                assert abs(score - h.score) <= TOL, (score, h.score)
    assert swaps <= len(SOURCES)  # of 4 ranks x len(SOURCES)


def test_export_writes_the_conventions(tmp_path):
    model = make_model("learned-swish-separate")
    out = export_ctranslate2(model, SRC_PIECES, tmp_path / "m", tgt_vocab=TGT_PIECES)
    config = json.loads((out / "config.json").read_text())
    assert config["add_source_eos"] is True and config["add_source_bos"] is False
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert config["decoder_start_token"] == "<s>"
    assert config["layer_norm_epsilon"] == pytest.approx(1e-5)
    assert json.loads((out / "source_vocabulary.json").read_text()) == SRC_PIECES
    assert json.loads((out / "target_vocabulary.json").read_text()) == TGT_PIECES
    shared = export_ctranslate2(make_model("paper"), SRC_PIECES, tmp_path / "shared")
    assert json.loads((shared / "shared_vocabulary.json").read_text()) == SRC_PIECES


def test_int8_export_loads_and_translates(tmp_path):
    model = make_model("preln-concat-gelu-bias")
    out = export_ctranslate2(model, SRC_PIECES, tmp_path / "int8", quantization="int8")
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="int8")
    results = translator.translate_batch([as_pieces(s, SRC_PIECES) for s in SOURCES], beam_size=4,
                                         max_decoding_length=MAX_LEN)
    assert len(results) == len(SOURCES)
    for r in results:
        hyp = r.hypotheses[0]
        assert len(hyp) <= MAX_LEN and all(t in SRC_PIECES for t in hyp)


def test_export_refusals(tmp_path):
    model = make_model("paper")
    with pytest.raises(ValueError, match="has 47 pieces but the model has 48"):
        export_ctranslate2(model, SRC_PIECES[:-1], tmp_path / "a")
    with pytest.raises(ValueError, match="repeats the piece 'a'"):
        export_ctranslate2(model, SRC_PIECES[:-1] + ["a"], tmp_path / "b")
    separate = make_model("learned-swish-separate")
    with pytest.raises(ValueError, match="eos piece differs"):
        export_ctranslate2(separate, SRC_PIECES, tmp_path / "c", tgt_vocab=TGT_PIECES[:3] + ["<eos>"] + TGT_PIECES[4:])
    with pytest.raises(ValueError, match="not a valid quantization"):
        export_ctranslate2(model, SRC_PIECES, tmp_path / "d", quantization="int3")
    assert not (tmp_path / "d").exists()
    (tmp_path / "e").mkdir()
    with pytest.raises(FileExistsError, match="force=True"):
        export_ctranslate2(model, SRC_PIECES, tmp_path / "e")
    assert export_ctranslate2(model, SRC_PIECES, tmp_path / "e", force=True) == tmp_path / "e"
    with pytest.raises(TypeError, match="encoder-decoder"):
        export_ctranslate2(DecoderOnlyLM(ModelConfig(vocab_size=V, d_model=32, n_heads=4, d_ff=64)), SRC_PIECES,
                           tmp_path / "f")


def test_ct2_default_early_stop_is_aiayns_first_and_can_miss_the_best_hypothesis(tmp_path):
    """Why the test above raises ``patience``: with CT2's default (stop once 4 hypotheses finished)
    the search is a prefix of the full one, so its best normalized score can only be lower, and on
    this model it is strictly lower for some sources (a longer hypothesis wins after the stop).
    That default is aiayn's ``stop='first'``: the same 4 hypotheses (Argos Translate decodes so)."""
    model = make_model("preln-concat-gelu-bias")
    translator = ctranslate2.Translator(str(export_ctranslate2(model, SRC_PIECES, tmp_path / "m")), device="cpu")
    results = translator.translate_batch(
        [as_pieces(s, SRC_PIECES) for s in SOURCES], beam_size=4, num_hypotheses=4, length_penalty=1.0,
        return_end_token=True, max_decoding_length=MAX_LEN, min_decoding_length=0, return_scores=True,
    )
    pieces = tgt_pieces(model)
    missed = swaps = 0
    for s, r in zip(SOURCES, results):
        kw = dict(beam=4, nbest=4, alpha=1.0, length_penalty="power", max_len_a=0.0, max_len_b=MAX_LEN)
        best = beam_search(model, src_tensor(s), spec=spec_of(**kw))[0][0]
        assert best.score >= r.scores[0] - TOL
        missed += best.score > r.scores[0] + TOL
        first = beam_search(model, src_tensor(s), spec=spec_of(stop="first", **kw))[0]
        theirs = hypotheses_as_ids(r, pieces)
        swaps += same_hypotheses([(h.tokens, h.score) for h in first], list(zip(theirs, r.scores)), s)
    assert missed > 0
    assert swaps <= len(SOURCES)  # of 4 ranks x len(SOURCES): only ties may swap
