"""Proofs for search (greedy, beam, sampling): a scripted stub model pins beam search by hand
arithmetic, a brute-force reference proves the exact stopping rule, batch-1 = batch-32, cached =
uncached, and token-for-token equality with Hugging Face ``generate`` on a random Marian model."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import replace

import pytest
import torch
from conftest import (  # tests/ is on sys.path under pytest
    GREEDY_GAP,
    NO_EOS,
    SUM_TOL,
    same_hypotheses,
    seq2seq_greedy_gap,
    spec_of,
)

from aiayn import build_model, model_config
from aiayn.linear import use_linear
from aiayn.model.cache import StaticKVCache
from aiayn.search import (
    Hypothesis,
    beam_search,
    filter_top_k,
    filter_top_p,
    greedy_search,
    length_penalty_denominator,
    repeated_ngram_bans,
)
from aiayn.search import sample as sample_stream

PAD, BOS, EOS = 0, 2, 3
A, B, C = 4, 5, 6  # ordinary tokens of the stub vocabulary
V_STUB = 8


def sample(model, prompt, max_new_tokens, use_cache=True, context_limit=None, eos_id=NO_EOS, **options):
    """The language-model token stream with its options as keywords (a sampling spec; temperature 0: greedy)."""
    spec = spec_of(eos_id=eos_id, sample=True, **options)
    return sample_stream(model, prompt, spec, max_new_tokens, context_limit=context_limit, use_cache=use_cache)


def sample_list(*args, **kwargs) -> list[int]:
    return list(sample(*args, **kwargs))


pytestmark = pytest.mark.usefixtures("one_thread")


# A scripted stub model --------------------------------------------------------------------------------


class StubCache:
    """Remembers each row's tokens (BOS first); ``reorder`` selects rows like the real KV cache."""

    def __init__(self) -> None:
        self.rows: list[list[int]] | None = None

    def reorder(self, indices: torch.Tensor, cross: bool = True) -> None:  # the stub has no cross K/V
        self.rows = [list(self.rows[i]) for i in indices.tolist()]

    def reorder_cross(self, indices: torch.Tensor) -> None:
        pass


class StubModel:
    """Next-token probabilities scripted as a function of the prefix (the tokens after BOS).

    ``scripts[k]`` drives source sentence ``[[k + 4]]`` (see :func:`stub_src`): a dict
    prefix tuple -> {token: probability} (unscripted prefixes get ``default``, EOS with probability 1),
    or a callable prefix -> such a dict. Tokens not listed have probability 0. ``decoded`` records
    every prefix the search asked about, to prove when it stopped.
    """

    def __init__(self, *scripts, default=None) -> None:
        self.scripts = scripts
        self.default = default or {EOS: 1.0}
        self.decoded: list[tuple[int, ...]] = []
        self.calls = 0

    def encode(self, src, src_mask=None):
        return (src[:, :1] - 4).float().unsqueeze(-1)  # (B, 1, 1): which script

    def new_cache(self) -> StubCache:
        return StubCache()

    def distribution(self, k: int, prefix: tuple[int, ...]) -> dict[int, float]:
        script = self.scripts[k]
        return script(prefix) if callable(script) else script.get(prefix, self.default)

    def decode(self, tgt, memory, memory_mask, cache=None):
        self.calls += 1
        rows = tgt.tolist()
        if cache is not None:
            cache.rows = rows if cache.rows is None else [r + n for r, n in zip(cache.rows, rows)]
            rows = cache.rows
        logits = torch.zeros(len(rows), tgt.size(1), V_STUB)  # only the last position is read
        for i, row in enumerate(rows):
            prefix = tuple(row[1:])
            self.decoded.append(prefix)
            # memory: one row per G consecutive rows (beam search: a sentence's beams share it)
            k = int(memory[i // (len(rows) // memory.size(0)), 0, 0]) if memory is not None else 0
            probs = torch.zeros(V_STUB, dtype=torch.float64)
            for tok, p in self.distribution(k, prefix).items():
                probs[tok] = p
            logits[i, -1] = probs.log().float()
        return logits

    def max_decoded(self) -> int:
        return max(len(p) for p in self.decoded)


def stub_src(*ks: int) -> torch.Tensor:
    return torch.tensor([[k + 4] for k in ks])


def hyps(model, src, **kw) -> list[list[Hypothesis]]:
    kw.setdefault("max_len_a", 0.0)
    kw.setdefault("max_len_b", 10)
    return beam_search(model, src, spec=spec_of(nbest=kw.pop("nbest", kw.get("beam", 4)), **kw))


def check(got: list[Hypothesis], expected: list[tuple[list[int], float, float]]) -> None:
    assert [h.tokens for h in got] == [e[0] for e in expected]
    for h, (_, score, logprob) in zip(got, expected):
        assert h.score == pytest.approx(score, abs=1e-5)
        assert h.logprob == pytest.approx(logprob, abs=1e-5)


def gnmt(n: int, alpha: float = 1.0) -> float:
    return ((5 + n) / 6) ** alpha


ln = math.log

# Case 1: beam finds what greedy misses. Greedy: A (.5) then EOS (.4) -> [A], probability .20.
SCRIPT_1 = {
    (): {A: 0.5, B: 0.4, EOS: 0.1},
    (A,): {EOS: 0.4, C: 0.35, B: 0.25},
    (B,): {EOS: 0.9, A: 0.1},
}
# Case 2: the empty hypothesis finished at step 1 (.30) stays best under `none` although a live beam
# (A C, .40) was more probable at step 2: none of its continuations can end above .30.
SCRIPT_2 = {
    (): {A: 0.5, EOS: 0.3, B: 0.2},
    (A,): {C: 0.8, EOS: 0.2},
    (B,): {EOS: 0.9, C: 0.1},
    (A, C): {EOS: 0.6, C: 0.4},
}
# Case 3: B C C C C (probability .07 at step 2, then certain) wins only with the power penalty, only
# if the search does not stop at step 2, where Hugging Face's default heuristic gives up.
SCRIPT_3 = {
    (): {A: 0.4, B: 0.35, C: 0.25},
    (A,): {EOS: 0.9, C: 0.1},
    (B,): {EOS: 0.8, C: 0.2},
    (B, C): {C: 1.0},
    (B, C, C): {C: 1.0},
    (B, C, C, C): {C: 1.0},
}


# 1. Beam search pinned by hand ------------------------------------------------------------------------


def test_case1_greedy_and_beam2_differ():
    m = StubModel(SCRIPT_1)
    assert greedy_search(m, stub_src(0), spec=spec_of(max_len_a=0, max_len_b=10)) == [[A]]
    # Beam 2. Step 1 (|Y| = 1): A .5, B .4 live; EOS (.1) ranks 3rd > N = 2, so it is dropped.
    # Step 2 (|Y| = 2): B EOS .36, A EOS .20 (both in the first 2: finished), A C .175, A B .125 live.
    # none: best live ln .175 <= worst finished ln .20: stop.
    check(
        hyps(m, stub_src(0), beam=2, length_penalty="none")[0],
        [([B], ln(0.36), ln(0.36)), ([A], ln(0.2), ln(0.2))],
    )
    assert m.max_decoded() == 1  # never expanded A C or A B
    # power, alpha 1: finished [B] ln .36 / 2, [A] ln .20 / 2; bound ln .175 / 10 (max_len) is higher,
    # so go on. Step 3 (|Y| = 3, unscripted -> EOS): A C EOS ln .175 / 3 = -0.581 beats [A] (-0.805);
    # A B EOS ln .125 / 3 = -0.693 does not. No live beam left: stop.
    check(
        hyps(m, stub_src(0), beam=2, length_penalty="power", alpha=1.0)[0],
        [([B], ln(0.36) / 2, ln(0.36)), ([A, C], ln(0.175) / 3, ln(0.175))],
    )
    # gnmt, alpha 1: denominators (5 + |Y|) / 6: [B] ln .36 / (7/6) = -0.876, [A] -1.380; bound
    # ln .175 / (15/6) = -0.697 > -1.380; step 3: A C EOS ln .175 / (8/6) = -1.307 replaces [A].
    check(
        hyps(m, stub_src(0), beam=2, length_penalty="gnmt", alpha=1.0)[0],
        [([B], ln(0.36) / gnmt(2), ln(0.36)), ([A, C], ln(0.175) / gnmt(3), ln(0.175))],
    )
    # The paper's alpha 0.6: same trace, ((5 + |Y|) / 6) ** 0.6.
    check(
        hyps(m, stub_src(0), beam=2, length_penalty="gnmt", alpha=0.6)[0],
        [([B], ln(0.36) / gnmt(2, 0.6), ln(0.36)), ([A, C], ln(0.175) / gnmt(3, 0.6), ln(0.175))],
    )


def test_case2_beam3_finished_hypothesis_is_not_beaten_by_a_live_one_that_cannot_improve():
    m = StubModel(SCRIPT_2)
    assert greedy_search(m, stub_src(0), spec=spec_of(max_len_a=0, max_len_b=10)) == [[A, C]]
    # Beam 3. Step 1: A .5, EOS .3, B .2 in the first 3 -> [] finished (|Y| = 1, ln .3); A, B live.
    # Step 2: A C .40, B EOS .18, A EOS .10, B C .02 -> [B], [A] finished; A C, B C live.
    #   The pool is full, but live A C (ln .40) is above every finished logprob: go on.
    # Step 3: A C EOS .24 finished (replaces [A]); A C C .16 live; B C EOS .02 finished, too low.
    #   none: best live ln .16 <= worst finished ln .18: stop. [] stays first.
    check(
        hyps(m, stub_src(0), beam=3, length_penalty="none")[0],
        [([], ln(0.3), ln(0.3)), ([A, C], ln(0.24), ln(0.24)), ([B], ln(0.18), ln(0.18))],
    )
    assert m.max_decoded() == 2  # A C was expanded, A C C never
    # power, alpha 1: [] ln .3 / 1, [B] ln .18 / 2, [A] ln .1 / 2; step 3: A C ln .24 / 3 = -0.476;
    # bound ln .16 / 10 > worst, so step 4: A C C EOS ln .16 / 4 = -0.458 wins (longest first).
    check(
        hyps(m, stub_src(0), beam=3, length_penalty="power", alpha=1.0)[0],
        [([A, C, C], ln(0.16) / 4, ln(0.16)), ([A, C], ln(0.24) / 3, ln(0.24)), ([B], ln(0.18) / 2, ln(0.18))],
    )
    # gnmt, alpha 1: [] -1.204, [B] ln .18 / (7/6) = -1.470, [A] -1.974; step 3: A C ln .24 / (8/6)
    # = -1.070 (first); bound ln .16 / (15/6) = -0.733 > -1.470; step 4: A C C ln .16 / (9/6) = -1.222
    # replaces [B].
    check(
        hyps(m, stub_src(0), beam=3, length_penalty="gnmt", alpha=1.0)[0],
        [([A, C], ln(0.24) / gnmt(3), ln(0.24)), ([], ln(0.3), ln(0.3)), ([A, C, C], ln(0.16) / gnmt(4), ln(0.16))],
    )


def test_case3_longer_hypothesis_wins_only_by_length_penalty_and_exact_stopping():
    # Step 1: A .4, B .35 live. Step 2 (|Y| = 2): A EOS .36, B EOS .28 finished; B C .07, A C .04 live.
    m = StubModel(SCRIPT_3)
    # none: best live ln .07 <= ln .28: stop at once.
    check(
        hyps(m, stub_src(0), beam=2, length_penalty="none")[0],
        [([A], ln(0.36), ln(0.36)), ([B], ln(0.28), ln(0.28))],
    )
    assert m.max_decoded() == 1
    # power, alpha 1, exact: bound ln .07 / 10 = -0.266 > worst ln .28 / 2 = -0.637: go on; B C C C C
    # EOS ends at |Y| = 6 with ln .07 / 6 = -0.443 > ln .36 / 2 = -0.511: the long one wins.
    check(
        hyps(m, stub_src(0), beam=2, length_penalty="power", alpha=1.0)[0],
        [([B, C, C, C, C], ln(0.07) / 6, ln(0.07)), ([A], ln(0.36) / 2, ln(0.36))],
    )
    # power, alpha 1, Hugging Face's heuristic: ln .07 / 2 (current length) = -1.330 < -0.637: stop.
    m = StubModel(SCRIPT_3)
    check(
        hyps(m, stub_src(0), beam=2, length_penalty="power", alpha=1.0, stop="hf")[0],
        [([A], ln(0.36) / 2, ln(0.36)), ([B], ln(0.28) / 2, ln(0.28))],
    )
    assert m.max_decoded() == 1
    # gnmt, alpha 1: bound ln .07 / (15/6) = -1.064 > worst ln .28 / (7/6) = -1.091, so the search
    # follows B C C C C, whose ln .07 / (11/6) = -1.450 does not make the cut.
    m = StubModel(SCRIPT_3)
    check(
        hyps(m, stub_src(0), beam=2, length_penalty="gnmt", alpha=1.0)[0],
        [([A], ln(0.36) / gnmt(2), ln(0.36)), ([B], ln(0.28) / gnmt(2), ln(0.28))],
    )
    assert m.max_decoded() == 5


# Case 4: the pool fills at step 2 with two unlikely hypotheses ([] .3, [B] .18) while A C (.45) is still live.
SCRIPT_4 = {
    (): {A: 0.5, EOS: 0.3, B: 0.2},
    (A,): {C: 0.9, EOS: 0.1},
    (B,): {EOS: 0.9, C: 0.1},
    (A, C): {EOS: 1.0},
}


def test_case4_first_stops_once_the_pool_is_full():
    # Beam 2. Step 1: A .5 live, EOS .3 among the first 2 -> [] finished (ln .3); A, B live.
    # Step 2: A C .45 live, B EOS .18 finished -> the pool ([] ln .3, [B] ln .18) is full.
    #   first (HF early_stopping=True, CTranslate2's default): done, A C never expanded.
    m = StubModel(SCRIPT_4)
    check(hyps(m, stub_src(0), beam=2, length_penalty="none", stop="first")[0],
          [([], ln(0.3), ln(0.3)), ([B], ln(0.18), ln(0.18))])
    assert m.max_decoded() == 1
    #   hf and exact: A C (ln .45) may still beat the worst (ln .18): step 3 finishes A C EOS, the best.
    for stop in ("hf", "exact"):
        m = StubModel(SCRIPT_4)
        check(hyps(m, stub_src(0), beam=2, length_penalty="none", stop=stop)[0],
              [([A, C], ln(0.45), ln(0.45)), ([], ln(0.3), ln(0.3))])
        assert m.max_decoded() == 2


def test_stub_cases_batched_together_equal_alone():
    alone = [hyps(StubModel(s), stub_src(0), beam=2, length_penalty="power", alpha=1.0)[0]
             for s in (SCRIPT_1, SCRIPT_2, SCRIPT_3)]
    together = hyps(StubModel(SCRIPT_1, SCRIPT_2, SCRIPT_3), stub_src(0, 1, 2, 1, 0), beam=2,
                    length_penalty="power", alpha=1.0)
    assert together == [alone[0], alone[1], alone[2], alone[1], alone[0]]


def test_max_len_is_per_sentence_and_cut_hypotheses_are_finalized():
    never_ends = StubModel({}, default={A: 0.5, B: 0.5 - 1e-3, EOS: 1e-3})
    src = torch.tensor([[4, 9, 0, 0, 0], [4, 9, 9, 9, 9]])  # real lengths 2 and 5 (pad 0)
    # int(0.5 * 2 + 2) = 3 and int(0.5 * 5 + 2) = 4 decoding steps.
    assert greedy_search(never_ends, src, spec=spec_of(max_len_a=0.5, max_len_b=2)) == [[A] * 3, [A] * 4]
    out = beam_search(never_ends, src, spec=spec_of(beam=2, alpha=1.0, length_penalty="power", max_len_a=0.5,
                                                    max_len_b=2, nbest=2))
    # Unfinished beams are finalized at the limit without EOS, |Y| = max_len.
    assert out[0][0].tokens == [A] * 3 and out[1][0].tokens == [A] * 4
    assert out[0][0].score == pytest.approx(3 * ln(0.5) / 3, abs=1e-4)
    # The runner-up is one B among three tokens (A A B, A B A and B A A tie; which one is unspecified).
    assert sorted(out[0][1].tokens) == [A, A, B]
    assert out[0][1].score == pytest.approx((2 * ln(0.5) + ln(0.499)) / 3, abs=1e-4)
    # min_len: EOS is forbidden until min_len tokens exist.
    eager = StubModel({}, default={EOS: 0.9, A: 0.1})
    assert greedy_search(eager, stub_src(0), spec=spec_of(max_len_b=10, min_len=2)) == [[A, A]]
    assert beam_search(eager, stub_src(0), spec=spec_of(beam=2, max_len_b=10, min_len=2))[0][0].tokens == [A, A]


# 2. The exact stopping rule equals running to max_len (brute force) --------------------------------


def reference_beam(dist, beam: int, alpha: float, kind: str, max_len: int) -> list[tuple[list[int], float]]:
    """Beam search by definition: same candidate rules, no early stop, every step to max_len."""
    live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    pool: list[tuple[float, list[int]]] = []
    for step in range(1, max_len + 1):
        cands = [(lp + ln(p), prefix, tok) for prefix, lp in live for tok, p in dist(prefix).items() if p > 0]
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * beam]
        for lp, prefix, tok in cands[:beam]:
            if tok == EOS or step == max_len:
                seq = list(prefix) if tok == EOS else [*prefix, tok]
                pool.append((lp / length_penalty_denominator(step, alpha, kind), seq))
        live = [((*prefix, tok), lp) for lp, prefix, tok in cands if tok != EOS][:beam]
        if not live:
            break
    pool.sort(key=lambda h: -h[0])
    return [(seq, score) for score, seq in pool[:beam]]


def random_script(seed: int):
    def dist(prefix: tuple[int, ...]) -> dict[int, float]:
        rng = random.Random(f"{seed}/{prefix}")
        weights = [rng.random() ** 2 for _ in range(4)]  # EOS, A, B, C; squared: peakier
        total = sum(weights)
        return {tok: w / total for tok, w in zip((EOS, A, B, C), weights)}

    return dist


@pytest.mark.parametrize("kind,alpha", [("none", 0.0), ("gnmt", 0.6), ("gnmt", 2.0), ("power", 1.0),
                                        ("power", -0.5)])
def test_exact_stop_equals_brute_force(kind, alpha):
    max_len, stopped_early, sooner = 7, 0, 0
    for seed in range(6):
        for beam in (1, 2, 3, 4):
            m = StubModel(random_script(seed))
            got = beam_search(m, stub_src(0), spec=spec_of(beam=beam, alpha=alpha, length_penalty=kind, max_len_a=0,
                                                           max_len_b=max_len, nbest=beam))[0]
            max_decoded = m.max_decoded()
            want = reference_beam(random_script(seed), beam, alpha, kind, max_len)
            assert [h.tokens for h in got] == [w[0] for w in want], (seed, beam)
            assert [h.score for h in got] == pytest.approx([w[1] for w in want], abs=1e-5)
            stopped_early += m.max_decoded() < max_len - 1
            for nbest in range(1, beam):  # fewer returned: the search may stop sooner, with the same best ones
                m = StubModel(random_script(seed))
                few = beam_search(m, stub_src(0), spec=spec_of(beam=beam, alpha=alpha, length_penalty=kind,
                                                               max_len_a=0, max_len_b=max_len, nbest=nbest))[0]
                assert [(h.tokens, h.score) for h in few] == [(h.tokens, h.score) for h in got[:nbest]], (seed, nbest)
                sooner += m.max_decoded() < max_decoded
    assert stopped_early > 0  # the stopping rule was exercised, not just the step limit
    assert sooner > 0  # and the nbest-th rule stopped sooner than the pool's worst did, somewhere


# 3. Batch 1 = batch 32, cached = uncached (random tiny models) ---------------------------------------


@pytest.fixture(scope="module", params=["plain", "packed"])
def tiny_mt(request):
    """A random model whose outputs end at varied lengths, its linear layers computed by each fp32 kernel in turn
    (aiayn.linear: PyTorch's and oneDNN's prepacked): the search's contracts hold for both. int8's, within its
    quantization: tests/test_linear.py."""
    torch.manual_seed(1)
    m = build_model(model_config("tiny", vocab_size=50, dropout=0.0, output_bias=True)).eval()
    use_linear(m, request.param)
    with torch.no_grad():
        m.decoder.output_bias[EOS] = 3.0  # a random model rarely ends; this one ends at varied lengths
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 16, (32,), generator=g)
    src = torch.full((32, int(lengths.max())), PAD)
    for i, n in enumerate(lengths.tolist()):
        src[i, :n] = torch.randint(4, 50, (n,), generator=g)
    return m, src, lengths


def test_greedy_batch_of_32_equals_one_at_a_time_and_uncached(tiny_mt):
    m, src, lengths = tiny_mt
    batched = greedy_search(m, src, spec=spec_of(max_len_a=1.0, max_len_b=5))
    limits = [n + 5 for n in lengths.tolist()]
    assert any(len(o) < lim for o, lim in zip(batched, limits)), "no sentence ended by EOS"
    assert any(len(o) == lim for o, lim in zip(batched, limits)), "no sentence cut at max_len"
    # Batched (padded) vs alone sums floats in another order: compared where every pick is clear of its
    # runner-up (a random model has a few near-ties; at most a quarter of the sentences may be set aside so).
    clear = [i for i, n in enumerate(lengths.tolist())
             if seq2seq_greedy_gap(m, src[i: i + 1, :n], batched[i], len(batched[i]) < limits[i]) > GREEDY_GAP]
    assert len(clear) >= 0.75 * len(batched)
    for i in clear:
        n = int(lengths[i])
        assert greedy_search(m, src[i : i + 1, :n], spec=spec_of(max_len_a=1.0, max_len_b=5)) == [batched[i]]
    # the same batch without the cache: the same computation, exactly
    assert greedy_search(m, src, spec=spec_of(max_len_a=1.0, max_len_b=5), use_cache=False) == batched


@pytest.mark.parametrize("kind", ["gnmt", "power"])
def test_beam_batch_of_32_equals_one_at_a_time(tiny_mt, kind):
    m, src, lengths = tiny_mt
    kw = dict(beam=4, alpha=0.6, length_penalty=kind, max_len_a=1.0, max_len_b=5, nbest=2)
    batched = beam_search(m, src, spec=spec_of(**kw))
    assert len({len(h[0].tokens) for h in batched}) > 3  # varied lengths: some end early
    swaps = 0
    for i, n in enumerate(lengths.tolist()):
        alone = beam_search(m, src[i : i + 1, :n], spec=spec_of(**kw))[0]
        # the same hypotheses, but for two whose scores tie (batched and alone sum floats in another order)
        swaps += same_hypotheses([(h.tokens, h.score) for h in alone], [(h.tokens, h.score) for h in batched[i]], i)
        for a, b in zip(alone, batched[i]):
            if a.tokens == b.tokens:
                assert (a.score, a.logprob) == pytest.approx((b.score, b.logprob), **SUM_TOL)
    assert swaps <= len(batched) // 4


def test_beam_1_equals_greedy(tiny_mt):
    m, src, _ = tiny_mt
    greedy = greedy_search(m, src, spec=spec_of(max_len_b=5))
    assert [h[0].tokens for h in beam_search(m, src, spec=spec_of(beam=1, max_len_b=5,
                                                                  length_penalty="none"))] == greedy


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(2)
    return build_model(model_config("tiny", vocab_size=50, dropout=0.0, max_positions=64), "lm").eval()


def greedy_reference(lm, prompt: list[int], n: int, window: int) -> list[int]:
    """Argmax of a full forward pass over the last ``window`` tokens, n times (no cache)."""
    tokens = list(prompt)
    for _ in range(n):
        logits = lm(torch.tensor([tokens[-window:]]))[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def test_lm_cached_equals_uncached_and_sliding_window(tiny_lm):
    prompt = [BOS, 7, 8, 9]
    ref = greedy_reference(tiny_lm, prompt, 30, window=64)
    assert sample_list(tiny_lm, prompt, 30, temperature=0) == ref
    assert sample_list(tiny_lm, prompt, 30, temperature=0, use_cache=False) == ref
    # Past the context limit the model sees the last 16 tokens only (cached start, then windowed).
    ref16 = greedy_reference(tiny_lm, prompt, 30, window=16)
    assert sample_list(tiny_lm, prompt, 30, temperature=0, context_limit=16) == ref16
    assert sample_list(tiny_lm, prompt, 30, temperature=0, context_limit=16, use_cache=False) == ref16
    # The default limit is the model's max_positions (64): 100 tokens do not overflow the table.
    assert len(sample_list(tiny_lm, prompt, 100, seed=0)) == 100


# n-gram blocking -------------------------------------------------------------------------------------


def has_repeated_ngram(seq: list[int], n: int) -> bool:
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return len(grams) != len(set(grams))


def brute_force_bans(seq: list[int], n: int, vocab: int) -> list[int]:
    """Tokens t for which seq + [t] holds an n-gram twice (the definition, checked exhaustively)."""
    return [t for t in range(vocab) if has_repeated_ngram(seq + [t], n) and not has_repeated_ngram(seq, n)]


def test_repeated_ngram_bans_is_the_definition():
    assert repeated_ngram_bans([A, B, C, A, B], 3) == [C]
    assert repeated_ngram_bans([A, B, A], 2) == [B]
    assert repeated_ngram_bans([A, B, A, C, A], 2) == [B, C]
    assert repeated_ngram_bans([C, A, C], 1) == [A, C]
    assert repeated_ngram_bans([A, B, C], 0) == [] and repeated_ngram_bans([A], 3) == []
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 4)
        seq = [rng.randrange(4) for _ in range(rng.randint(0, 12))]
        while has_repeated_ngram(seq, n):  # searches only ever extend sequences without a repeat
            seq.pop()
        assert repeated_ngram_bans(seq, n) == brute_force_bans(seq, n, 4), (seq, n)


def stutter(prefix: tuple[int, ...]) -> dict[int, float]:
    """A model that loves to stutter: A B A B ... unless something forbids it."""
    if not prefix:
        return {A: 0.6, B: 0.3, C: 0.1}
    nxt = B if prefix[-1] == A else A
    return {nxt: 0.55, C: 0.25, EOS: 0.2} if len(prefix) < 8 else {EOS: 1.0}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_in_greedy_beam_and_sampling(n):
    m = StubModel(stutter)
    src = stub_src(0)
    plain = greedy_search(m, src, spec=spec_of(max_len_a=0, max_len_b=10))[0]
    assert plain[:4] == [A, B, A, B]  # without blocking it stutters
    greedy = greedy_search(m, src, spec=spec_of(max_len_a=0, max_len_b=10, no_repeat_ngram=n))[0]
    assert not has_repeated_ngram(greedy, n) and greedy != plain
    beams = hyps(m, src, beam=3, no_repeat_ngram=n)[0]
    assert beams and all(not has_repeated_ngram(h.tokens, n) for h in beams)
    lm = StubModel(stutter)
    drawn = sample_list(lm, [BOS], 10, temperature=0, eos_id=EOS, no_repeat_ngram=n)
    assert drawn == greedy  # the same rule in the LM sampler (greedy at temperature 0)
    for seed in range(5):
        assert not has_repeated_ngram(sample_list(lm, [BOS], 10, seed=seed, eos_id=EOS, no_repeat_ngram=n), n)


def test_no_repeat_ngram_zero_changes_nothing(tiny_mt):
    m, src, _ = tiny_mt
    assert greedy_search(m, src, spec=spec_of(max_len_b=8, no_repeat_ngram=0)) == greedy_search(m, src,
                                              spec=spec_of(max_len_b=8))
    a = [h[0].tokens for h in beam_search(m, src, spec=spec_of(beam=4, max_len_b=8))]
    assert [h[0].tokens for h in beam_search(m, src, spec=spec_of(beam=4, max_len_b=8, no_repeat_ngram=0))] == a


# 4. Sampling ------------------------------------------------------------------------------------------


def test_sampling_is_seeded_and_degenerates_to_greedy(tiny_lm):
    prompt = [BOS, 11]
    greedy = greedy_reference(tiny_lm, prompt, 20, window=64)
    a = sample_list(tiny_lm, prompt, 20, temperature=1.0, seed=123)
    assert sample_list(tiny_lm, prompt, 20, temperature=1.0, seed=123) == a
    assert a != greedy  # sampling at temperature 1 actually samples (fixed seed: deterministic)
    assert sample_list(tiny_lm, prompt, 20, temperature=0.0) == greedy
    assert sample_list(tiny_lm, prompt, 20, temperature=1e-6, seed=5) == greedy
    assert sample_list(tiny_lm, prompt, 20, top_k=1, seed=5) == greedy
    assert sample_list(tiny_lm, torch.tensor([prompt]), 20, top_p=1e-9, seed=5) == greedy


def test_sample_streams_and_stops_at_eos():
    m = StubModel({}, default={A: 0.5, EOS: 0.5})
    stream = sample(m, [BOS], 100, seed=0)
    assert m.calls == 0  # lazy: nothing runs before the first token is asked for
    first = next(stream)
    assert m.calls == 1 and first in (A, EOS)
    rest = list(stream)
    out = [first, *rest]
    assert EOS in out and len(out) == 100  # without eos_id, EOS is just another token
    ended = sample_list(m, [BOS], 100, seed=0, eos_id=EOS)
    assert ended == out[: out.index(EOS)]  # same draws; EOS ends the stream and is not yielded


def test_top_p_sampling_stays_in_the_nucleus():
    m = StubModel({}, default={A: 0.5, B: 0.3, C: 0.15, EOS: 0.05})
    draws = sample_list(m, [BOS], 400, top_p=0.75, seed=0)
    assert set(draws) == {A, B}
    assert abs(draws.count(A) / 400 - 0.5 / 0.8) < 0.08  # renormalized inside the nucleus


def test_filter_top_p_keeps_smallest_set_with_enough_mass():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5 (id 1), 0.3 (id 3), 0.15 (id 0), 0.05 (id 2)
    logits = probs.log()
    kept = lambda p: set(torch.isfinite(filter_top_p(logits, p)).nonzero().flatten().tolist())
    assert kept(0.4) == {1}  # 0.5 >= 0.4 alone
    assert kept(0.7) == {1, 3}  # 0.5 < 0.7 <= 0.8
    assert kept(0.9) == {1, 3, 0}  # 0.8 < 0.9 <= 0.95
    assert kept(0.99) == {0, 1, 2, 3}
    assert kept(1.0) == {0, 1, 2, 3}
    assert torch.equal(filter_top_p(logits, 0.7)[[1, 3]], logits[[1, 3]])  # kept logits unchanged
    batch = torch.stack([logits, logits.flip(0)])  # (2, V): filters each row
    assert torch.isfinite(filter_top_p(batch, 0.7)).tolist() == [[False, True, False, True], [True, False, True, False]]


def test_filter_top_k():
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0])
    assert torch.isfinite(filter_top_k(logits, 2)).tolist() == [False, True, False, True]
    assert torch.equal(filter_top_k(logits, None), logits)
    assert torch.equal(filter_top_k(logits, 10), logits)


def test_bad_arguments_are_refused():
    m = StubModel(SCRIPT_1)
    with pytest.raises(ValueError, match="length_penalty"):
        beam_search(m, stub_src(0), spec=spec_of(length_penalty="wu"))
    with pytest.raises(ValueError, match="stop"):
        beam_search(m, stub_src(0), spec=spec_of(stop="never"))
    with pytest.raises(ValueError, match="nbest"):
        beam_search(m, stub_src(0), spec=spec_of(beam=2, nbest=3))
    with pytest.raises(ValueError, match="temperature"):
        next(sample(m, [BOS], 3, temperature=-1))


# 5. Token for token with Hugging Face generate() ------------------------------------------------------

L_HF = 12  # decoding steps; HF's max_length counts the decoder start token: L_HF + 1


@pytest.fixture(scope="module")
def marian():
    transformers = pytest.importorskip("transformers")
    marian_interop = pytest.importorskip("aiayn.interop.marian")
    cfg = transformers.MarianConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, activation_function="relu",
        scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=EOS, decoder_start_token_id=0, forced_eos_token_id=None,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=128,
        init_std=0.2,  # the default 0.02 gives a model that ignores its source
    )
    torch.manual_seed(6)
    hf = transformers.MarianMTModel(cfg).eval()
    with torch.no_grad():
        hf.final_logits_bias[0, EOS] = 1.5  # outputs end at varied lengths (seed and bias chosen so)
    g = torch.Generator().manual_seed(6)
    lengths = [9, 5, 12, 3, 7, 10]
    src = torch.full((len(lengths), max(lengths)), 0)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, 64, (n - 1,), generator=g)
        src[i, n - 1] = EOS
    return hf, marian_interop.from_hf_marian(hf).eval(), src


def hf_generate(hf, src, **kw):
    # Everything that could change the search is pinned, whatever the generation config says.
    kw = dict(attention_mask=src != 0, max_length=L_HF + 1, min_length=0, do_sample=False,
              no_repeat_ngram_size=0, bad_words_ids=None, forced_eos_token_id=None, forced_bos_token_id=None,
              repetition_penalty=1.0, output_scores=True, return_dict_in_generate=True, **kw)
    with torch.no_grad():
        return hf.generate(src, **kw)


def hf_tokens(seq: torch.Tensor) -> list[int]:
    """Drop the start token; cut at the first EOS (the rest is padding)."""
    s = seq[1:].tolist()
    return s[: s.index(EOS)] if EOS in s else s


# Marian starts decoding from its pad id (0) and pads the source with 0.
MARIAN_IDS = dict(bos_id=0, eos_id=EOS, pad_id=0, max_len_a=0.0, max_len_b=L_HF)


def test_greedy_equals_hf_generate(marian):
    hf, ours, src = marian
    want = [hf_tokens(s) for s in hf_generate(hf, src, num_beams=1).sequences]
    assert greedy_search(ours, src, spec=spec_of(**MARIAN_IDS)) == want
    assert any(0 < len(w) < L_HF for w in want) and any(len(w) == L_HF for w in want)


@pytest.mark.parametrize("early_stopping,stop", [(False, "hf"), ("never", "exact"), (True, "first")])
def test_beam_equals_hf_generate(marian, early_stopping, stop):
    hf, ours, src = marian
    out = hf_generate(hf, src, num_beams=4, num_return_sequences=4, length_penalty=1.0,
                      early_stopping=early_stopping)
    want = [hf_tokens(s) for s in out.sequences]
    got = beam_search(ours, src, spec=spec_of(beam=4, alpha=1.0, length_penalty="power", nbest=4, stop=stop,
                                              **MARIAN_IDS))
    assert [h.tokens for hs in got for h in hs] == want
    assert [h.score for hs in got for h in hs] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
    best = want[::4]
    assert any(0 < len(w) < L_HF for w in best)
    # sentences cut at the limit are among them, but under "first", which stops once 4 have ended (early here)
    assert any(len(w) == L_HF for w in best) or stop == "first"


def test_the_three_stop_rules_differ_on_this_model(marian):
    # So the test above pins three different behaviours, each to its Hugging Face counterpart.
    hf, ours, src = marian
    kw = dict(beam=4, alpha=1.0, length_penalty="power", nbest=4, **MARIAN_IDS)
    got = {stop: [[h.tokens for h in hs] for hs in beam_search(ours, src, spec=spec_of(stop=stop, **kw))]
           for stop in ("exact", "hf", "first")}
    assert got["hf"] != got["exact"] and got["first"] != got["hf"] and got["first"] != got["exact"]


# 6. The per-step logits processing, step by step ----------------------------------------------------------


def test_logits_processing_steps_on_hand_made_logits():
    from aiayn.search import LogitsProcessor

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    inf = float("-inf")
    # ban: only with ban_pad, the pad id (here 1) at -inf, a new tensor; nothing else changes
    plain = LogitsProcessor(spec_of(pad_id=1), torch.device("cpu"))
    assert plain.ban(logits) is logits
    banned = LogitsProcessor(spec_of(pad_id=1, ban_pad=True), torch.device("cpu")).ban(logits)
    assert banned[:, 1].tolist() == [inf, inf] and torch.equal(banned[:, [0, 2, 3, 4, 5]], logits[:, [0, 2, 3, 4, 5]])
    # min_len: EOS (3) at -inf while fewer than min_len tokens exist, in place
    proc = LogitsProcessor(spec_of(min_len=2), torch.device("cpu"))
    produced = torch.tensor([[4], [5]])
    assert proc.constrain(logits.clone(), produced, 1)[:, 3].tolist() == [inf, inf]
    assert torch.equal(proc.constrain(logits.clone(), produced, 2), logits)
    # n-gram blocking (n = 2): each row's own bigrams, after its last token
    proc = LogitsProcessor(spec_of(no_repeat_ngram=2), torch.device("cpu"))
    out = proc.constrain(logits.clone(), torch.tensor([[4, 5, 4], [4, 2, 0]]), 3)
    assert out[0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, inf] and torch.equal(out[1], logits[1])
    # sampling filters: temperature, then top-k, then top-p
    proc = LogitsProcessor(spec_of(sample=True, temperature=2.0, top_k=3), torch.device("cpu"))
    assert proc.filtered(logits)[0].tolist() == [inf, inf, inf, 1.5, 2.0, 2.5]
    proc = LogitsProcessor(spec_of(sample=True, top_p=0.5), torch.device("cpu"))
    assert torch.isfinite(proc.filtered(logits)).sum(1).tolist() == [1, 1]  # the top token alone holds 0.63


@pytest.mark.parametrize("V", [2048, 2049, 8000])
def test_top_k_by_chunks_equals_topk(V):
    """The beam search's per-row top-k (by chunk maxima, for wide vocabularies) finds what ``Tensor.topk`` does:
    a row whose best values share a chunk, a row whose best sit in the columns after the last whole chunk, a row
    with -inf (banned ids)."""
    from aiayn.search.common import TOPK_CHUNK, top_k

    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g).log_softmax(-1)
    x[1, 64:72] = 5.0 + torch.arange(8.0)  # all 8 best in one chunk
    x[2, -(V % TOPK_CHUNK or 3):] = 9.0 + torch.arange(float(V % TOPK_CHUNK or 3))  # the best in the tail
    x[3, ::2] = float("-inf")
    values, cols = top_k(x, 8)
    expected = x.topk(8, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(cols, expected.indices)


def test_beam_search_by_chunks_equals_plain_topk(tiny_mt, monkeypatch):
    """The whole search with the chunked top-k (forced onto the tiny vocabulary: chunks of 3 of 50 ids, two left
    over) returns what it returns with the plain one."""
    import aiayn.search.common as common

    m, src, _ = tiny_mt
    spec = spec_of(beam=2, alpha=0.6, max_len_a=1.0, max_len_b=5, nbest=2)
    plain = beam_search(m, src, spec=spec)
    monkeypatch.setattr(common, "TOPK_CHUNK", 3)
    assert [[(h.tokens, h.score) for h in hs] for hs in beam_search(m, src, spec=spec)] == \
        [[(h.tokens, h.score) for h in hs] for hs in plain]


# Strategies by name ---------------------------------------------------------------------------------------


def test_the_table_chooses_as_the_options_say():
    from aiayn.search import STRATEGIES, rows_per_source, strategy_for

    assert list(STRATEGIES) == ["sample", "greedy", "beam"]
    o = spec_of().options
    assert strategy_for(o.replace(beam=1)).name == "greedy" and rows_per_source(o.replace(beam=1)) == 1
    assert strategy_for(o.replace(beam=4)).name == "beam" and rows_per_source(o.replace(beam=4)) == 4
    drawn = o.replace(beam=4, sample=True, nbest=3)
    assert strategy_for(drawn).name == "sample" and rows_per_source(drawn) == 3


def test_a_new_strategy_is_one_entry_of_the_table(tiny_mt, lm_run, monkeypatch):
    """A strategy added to the table (and nowhere else) is what decode_ids searches with, what its batches and the
    server's cost count per source, and what a language model's generation streams with."""
    from aiayn.decode.generate import generate_text
    from aiayn.run.directory import load_run
    from aiayn.search import Greedy, decode_batches, decode_ids, rows_per_source, sources

    streamed = []

    class Reversed(Greedy):  # greedy's tokens backwards: an output no other strategy gives
        name = "reversed"

        def chosen(self, options):
            return not options.sample and options.beam == 3

        def rows(self, options):
            return 5

        def search(self, model, src, src_mask, spec, scores):
            return [[Hypothesis(h[0].tokens[::-1], h[0].score, h[0].logprob)]
                    for h in super().search(model, src, src_mask, spec, scores)]

        def stream(self, model, prompt, spec, max_new_tokens, context_limit):
            streamed.append(max_new_tokens)
            return iter(())

    monkeypatch.setattr(sources, "STRATEGIES", {"reversed": Reversed(), **sources.STRATEGIES})
    m, src, lengths = tiny_mt
    rows = [src[i, :n].tolist() for i, n in enumerate(lengths.tolist()[:4])]
    greedy = decode_ids(m, rows, spec_of(beam=1, max_len_b=5), scores=False)
    found = decode_ids(m, rows, spec_of(beam=3, nbest=1, max_len_b=5), scores=False)
    assert [h[0].tokens for h in found] == [h[0].tokens[::-1] for h in greedy]
    opts = spec_of(beam=3, max_tokens=49).options
    assert rows_per_source(opts) == 5
    assert decode_batches([5, 5, 5], opts, "cpu") == [[0], [1], [2]]  # 2 sources x 5 ids x 5 rows > 49 (x 3 beams: 30)
    run = load_run(lm_run, "cpu")
    assert "".join(generate_text(run, "a", run.cfg.decode.replace(beam=3, max_new_tokens=4))) == ""
    assert streamed == [4]


@pytest.fixture
def threads():
    """Set the process's intra-op threads for one test (restored after)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_cpu_batches_are_searched_side_by_side_only_where_that_is_sound():
    """Side by side where the batches' predicted time says so: equal batches, one a thread or more; not a large and a
    small one (the large one would run on one thread of two), nor on a GPU, nor when sampling."""
    from aiayn.config import DecodeOptions
    from aiayn.search.sources import cpu_workers

    cpu, cuda, beam = torch.device("cpu"), torch.device("cuda"), DecodeOptions(beam=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_workers(cpu, [960, 960], beam) == (2, 1)
        assert cpu_workers(cpu, [960, 960, 960, 400], beam) == (2, 1)
        assert cpu_workers(cpu, [960, 30], beam) == (1, 2)  # a large batch and a small one: both threads on each
        assert cpu_workers(cpu, [960], beam) == (1, 2)
        torch.set_num_threads(4)
        assert cpu_workers(cpu, [960] * 8, beam) == (4, 1)
        assert cpu_workers(cpu, [960] * 4, beam) == (4, 1)
        assert cpu_workers(cpu, [960] * 3, beam) == (1, 4)  # a fourth worker would have nothing to search
        assert cpu_workers(cuda, [960] * 8, beam) == (1, 4)
        assert cpu_workers(cpu, [960] * 8, DecodeOptions(sample=True, seed=1)) == (1, 4)  # one generator, in turn
        torch.set_num_threads(1)
        assert cpu_workers(cpu, [960] * 8, beam) == (1, 1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("beam", [1, 4])
def test_batches_searched_side_by_side_equal_those_searched_in_turn(tiny_mt, threads, beam):
    """Two workers of one thread each give every sentence the hypotheses (ids, scores) one thread gives searching the
    batches in turn, in input order, with progress counted batch by batch; the thread count is restored."""
    from aiayn.search import decode_batches, decode_ids
    from aiayn.search.sources import cpu_workers

    m, src, lengths = tiny_mt
    rows = [src[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
    spec = spec_of(beam=beam, nbest=1, max_len_a=1.0, max_len_b=5, max_tokens=48 * beam)
    batches = decode_batches([len(r) + 1 for r in rows], spec.options, "cpu")
    threads(2)
    assert cpu_workers(torch.device("cpu"), [len(b) * (1 + int(lengths[b].max())) for b in batches],
                       spec.options) == (2, 1)  # what decode_ids does with them at 2 threads
    threads(1)
    in_turn = decode_ids(m, rows, spec)
    threads(2)
    counted: list[int] = []
    side_by_side = decode_ids(m, rows, spec, progress=counted.append)
    assert torch.get_num_threads() == 2
    assert counted == [len(b) for b in batches]
    assert [[(h.tokens, h.score, h.logprob) for h in x] for x in side_by_side] == \
        [[(h.tokens, h.score, h.logprob) for h in x] for x in in_turn]


def test_a_batch_that_fails_stops_the_other_workers_and_its_error_is_raised(tiny_mt, threads):
    """The error of a batch searched side by side is what the caller gets (not the others' stop), once every worker
    has stopped; a caller's stop ends the search with SearchStopped. The thread count is restored either way."""
    from aiayn.search import SearchStopped, decode_batches, decode_ids
    from aiayn.search.sources import cpu_workers

    m, src, lengths = tiny_mt
    rows = [src[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
    spec = spec_of(beam=4, max_len_a=1.0, max_len_b=5, max_tokens=192)
    calls = {"n": 0}

    class Failing(torch.nn.Module):  # the model, but its 5th decoder step fails
        def __init__(self) -> None:
            super().__init__()
            self.inner = m
            self.cfg = m.cfg

        def encode(self, *a, **k):
            return m.encode(*a, **k)

        def new_cache(self, *a, **k):
            return m.new_cache(*a, **k)

        def decode(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 5:
                raise ValueError("the fifth step")
            return m.decode(*a, **k)

    threads(2)
    batches = decode_batches([len(r) + 1 for r in rows], spec.options, "cpu")
    assert cpu_workers(torch.device("cpu"), [len(b) * (1 + int(lengths[b].max())) for b in batches],
                       spec.options) == (2, 1)  # searched side by side
    with pytest.raises(ValueError, match="the fifth step"):
        decode_ids(Failing().eval(), rows, spec)
    assert torch.get_num_threads() == 2
    with pytest.raises(SearchStopped):
        decode_ids(m, rows, replace(spec, stop=lambda: True))
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("stop,nbest", [("exact", 2), ("hf", 1), ("first", 3)])
def test_fixed_shape_steps_equal_the_usual_path(tiny_mt, stop, nbest):
    """``cuda_graphs`` (aiayn.search.fixed): all B * N rows kept, the cache at fixed shapes, positions on the device;
    off CUDA no graph is recorded, so this is the computation a graph replays. The usual path's hypotheses, ids and
    scores, up to near-ties (attention also sums the masked positions' zeros: another order of float sums, as
    another CPU's kernels), while sentences end at different steps and beams move; in float64 and float32."""
    m, src, _ = tiny_mt
    kw = dict(beam=4, alpha=0.6, length_penalty="power", max_len_a=1.0, max_len_b=5, nbest=nbest, stop=stop)
    for model in (copy.deepcopy(m).double(), m):
        usual = beam_search(model, src, spec=spec_of(**kw))
        fixed = beam_search(model, src, spec=spec_of(cuda_graphs=True, **kw))
        assert len({len(h[0].tokens) for h in usual}) > 3  # sentences end at varied steps
        swaps = 0
        for i, (a, b) in enumerate(zip(usual, fixed)):
            swaps += same_hypotheses([(h.tokens, h.score) for h in a], [(h.tokens, h.score) for h in b], i)
            for x, y in zip(a, b):
                if x.tokens == y.tokens:
                    assert x.logprob == pytest.approx(y.logprob, **SUM_TOL)
        assert swaps <= len(src) // 4


def test_static_cache_steps_equal_the_growing_cache():
    """StaticKVCache (one step at its device-side position, all C positions read, the later ones masked, rows
    reordered in place) gives the decoder the logits KVCache gives it, step by step, through beam-like reorders."""
    torch.manual_seed(3)
    m = build_model(model_config("tiny", vocab_size=50, dropout=0.0)).eval().double()
    memory_src = torch.randint(4, 50, (3, 7))
    memory = m.encode(memory_src)
    mask = memory_src != PAD
    grow, fixed = m.new_cache(), StaticKVCache(len(m.decoder.layers), 6, memory.device)
    g = torch.Generator().manual_seed(3)
    for t in range(6):
        tok = torch.randint(4, 50, (3, 1), generator=g)
        with torch.no_grad():
            a = m.decode(tok, memory, mask, grow)
            b = m.decode(tok, memory, mask, fixed)
        fixed.advance()
        assert b.shape == a.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5), t  # C keys read, not t + 1
        rows = torch.randint(0, 3, (3,), generator=g)  # rows continue (and repeat) others, as beams do
        grow.reorder(rows, cross=False)
        fixed.reorder_rows(rows)
    assert int(fixed.pos) == 6


def test_a_fixed_shape_step_never_waits_for_the_device(tiny_mt):
    """What a CUDA graph needs of the step it records (aiayn.search.fixed): no value read back to the host (item,
    nonzero, a bool of a tensor...), so the same kernels run every step. Checked here on every op the steps after the
    first dispatch, across a whole search."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from aiayn.search.fixed import FixedShapeSteps

    waits = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item", "masked_select", "unique"}
    seen: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func._schema.name.split("::")[-1])
            return func(*args, **(kwargs or {}))

    step, steps = FixedShapeSteps._step, []

    def watched(self):
        if self.logits is None:  # the first step runs unwatched
            return step(self)
        with Ops():
            out = step(self)
        steps.append(1)
        return out

    m, src, _ = tiny_mt
    FixedShapeSteps._step = watched
    try:
        beam_search(m, src, spec=spec_of(beam=4, max_len_a=1.0, max_len_b=5, cuda_graphs=True))
    finally:
        FixedShapeSteps._step = step
    assert len(steps) > 5 and seen
    assert not waits & set(seen), sorted(waits & set(seen))
