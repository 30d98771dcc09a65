"""The GPU-shaped search equals the search it replaced, token for token: the preallocated KV cache
(written in place, reordered by one gather) against a cache that grows by ``torch.cat``; beam and greedy
search with their bookkeeping on tensors against the former Python-loop implementations kept below
(and against decoding without any cache); one wait for the device per step; models in fp16."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import SUM_TOL, assert_close_at_scale, spec_of  # tests/ is on sys.path under pytest
from torch import Tensor

from aiayn import build_model, model_config
from aiayn.model.cache import KVCache
from aiayn.search import (
    NEG_INF,
    Hypothesis,
    beam_search,
    greedy_search,
    length_penalty_denominator,
    penalized_score,
    repeated_ngram_bans,
    sample_search,
    score_tokens,
)
from aiayn.search import beam as search_beam
from aiayn.search import common as search_common
from aiayn.search.beam import _Finished

PAD, BOS, EOS = 0, 2, 3

pytestmark = pytest.mark.usefixtures("one_thread")


# The former implementations (the reference) -------------------------------------------------------------


def max_lengths(model, src_mask: Tensor, max_len_a: float, max_len_b: float) -> list[int]:
    """The former step limits: int(a * src_len + b), at least 1, at most the model's positions."""
    cap = model.cfg.max_positions
    return [max(1, min(int(max_len_a * n + max_len_b), cap)) for n in src_mask.sum(dim=1).tolist()]


class CatKVCache:
    """The former cache: per-layer tensors grown by ``torch.cat`` every step, reordered by index_select."""

    def __init__(self, n_layers: int) -> None:
        self.self_k: list[Tensor | None] = [None] * n_layers
        self.self_v: list[Tensor | None] = [None] * n_layers
        self.cross_k: list[Tensor | None] = [None] * n_layers
        self.cross_v: list[Tensor | None] = [None] * n_layers

    @property
    def length(self) -> int:
        return 0 if self.self_k[0] is None else self.self_k[0].size(2)

    def append_self(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.self_k[layer] is not None:
            k = torch.cat([self.self_k[layer], k], dim=2)
            v = torch.cat([self.self_v[layer], v], dim=2)
        self.self_k[layer], self.self_v[layer] = k, v
        return k, v

    def reorder(self, indices: Tensor, cross: bool = True) -> None:
        stores = (self.self_k, self.self_v) + ((self.cross_k, self.cross_v) if cross else ())
        for store in stores:
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, indices)

    def reorder_cross(self, indices: Tensor) -> None:
        for store in (self.cross_k, self.cross_v):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, indices)


def ban_ngrams(scores: Tensor, produced: Tensor, n: int) -> None:
    if produced.size(1) < max(n - 1, 1):
        return
    for r, seq in enumerate(produced.tolist()):
        banned = repeated_ngram_bans(seq, n)
        if banned:
            scores[r, banned] = NEG_INF


def offer(pool: list[Hypothesis], hyp: Hypothesis, size: int) -> None:
    """Insert into a best-first pool of at most ``size``; after equal scores (earlier ones win ties)."""
    if len(pool) >= size and hyp.score <= pool[-1].score:
        return
    i = len(pool)
    while i > 0 and pool[i - 1].score < hyp.score:
        i -= 1
    pool.insert(i, hyp)
    del pool[size:]


def best_possible(best_live: float, length: int, limit: int, alpha: float, kind: str, stop: str) -> float:
    if stop == "hf":
        return best_live / length_penalty_denominator(length, alpha, kind)
    ends = (length + 1, max(limit, length + 1))
    return max(best_live / length_penalty_denominator(n, alpha, kind) for n in ends)


@torch.no_grad()
def reference_beam(model, src, beam=4, alpha=0.6, length_penalty="gnmt", max_len_a=1.0, max_len_b=50, nbest=1,
                   min_len=0, stop="exact", bos_id=BOS, eos_id=EOS, pad_id=PAD, no_repeat_ngram=0, cache="cat"):
    """The former beam search, step for step: Python pools, several transfers per step. ``cache``:
    "cat" (the former cache) or None (every step re-decodes the whole prefix)."""
    src_mask = src != pad_id
    B, N = src.size(0), beam
    limits = max_lengths(model, src_mask, max_len_a, max_len_b)
    memory = model.encode(src, src_mask)
    rows = torch.arange(B).repeat_interleave(N)
    memory, mem_mask = memory.index_select(0, rows), src_mask.index_select(0, rows)
    kv = CatKVCache(len(model.decoder.layers)) if cache == "cat" else None
    tokens = torch.full((B * N, 1), bos_id, dtype=torch.long)
    scores = torch.full((B, N), NEG_INF)
    scores[:, 0] = 0.0
    sent = list(range(B))
    pools: list[list[Hypothesis]] = [[] for _ in range(B)]
    t = 0
    while sent:
        n = len(sent)
        logits = model.decode(tokens[:, -1:] if kv is not None else tokens, memory, mem_mask, kv)[:, -1]
        lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        if t < min_len:
            lprobs[:, eos_id] = NEG_INF
        if no_repeat_ngram > 0:
            ban_ngrams(lprobs, tokens[:, 1:], no_repeat_ngram)
        V = lprobs.size(-1)
        cand = (scores.unsqueeze(-1) + lprobs.view(n, N, V)).view(n, N * V)
        top_lp, top_idx = cand.topk(min(2 * N, N * V), dim=-1)
        top_beam, top_tok = top_idx // V, top_idx % V
        length = t + 1
        is_eos = top_tok == eos_id
        lp_l, beam_l, tok_l, eos_l = top_lp.tolist(), top_beam.tolist(), top_tok.tolist(), is_eos.tolist()
        for i, s in enumerate(sent):
            for j in range(min(N, len(lp_l[i]))):
                if lp_l[i][j] == NEG_INF:
                    break
                if eos_l[i][j] or length >= limits[s]:
                    prefix = tokens[i * N + beam_l[i][j], 1:].tolist()
                    seq = prefix if eos_l[i][j] else prefix + [tok_l[i][j]]
                    offer(pools[s], Hypothesis(seq, penalized_score(lp_l[i][j], length, alpha, length_penalty),
                                               lp_l[i][j]), N)
        live_lp = top_lp.masked_fill(is_eos, NEG_INF)
        order = live_lp.sort(dim=-1, descending=True, stable=True).indices[:, :N]
        new_scores = live_lp.gather(1, order)
        src_rows = torch.arange(n)[:, None] * N + top_beam.gather(1, order)
        new_tok = top_tok.gather(1, order)
        best_live = new_scores[:, 0].tolist()
        keep = [i for i, s in enumerate(sent) if not (
            length >= limits[s] or best_live[i] == NEG_INF
            or (len(pools[s]) == N
                and best_possible(best_live[i], length, limits[s], alpha, length_penalty, stop) <= pools[s][-1].score))]
        if not keep:
            break
        k = torch.tensor(keep)
        next_rows = src_rows.index_select(0, k).reshape(-1)
        if kv is not None:
            kv.reorder(next_rows, cross=False)
        if len(keep) < n:
            sent_rows = (k[:, None] * N + torch.arange(N)).reshape(-1)
            if kv is not None:
                kv.reorder_cross(sent_rows)
            memory, mem_mask = memory[sent_rows], mem_mask[sent_rows]
        tokens = torch.cat([tokens[next_rows], new_tok.index_select(0, k).reshape(-1, 1)], dim=1)
        scores = new_scores.index_select(0, k)
        sent = [sent[i] for i in keep]
        t += 1
    return [pool[:nbest] for pool in pools]


@torch.no_grad()
def reference_greedy(model, src, max_len_a=1.0, max_len_b=50, min_len=0, no_repeat_ngram=0, cache="cat"):
    """The former greedy search: a transfer and a Python loop over the rows every step."""
    src_mask = src != PAD
    limits = max_lengths(model, src_mask, max_len_a, max_len_b)
    memory, mem_mask = model.encode(src, src_mask), src_mask
    B = src.size(0)
    sent = list(range(B))
    tokens = torch.full((B, 1), BOS, dtype=torch.long)
    kv = CatKVCache(len(model.decoder.layers)) if cache == "cat" else None
    out: list[list[int]] = [[] for _ in range(B)]
    t = 0
    while sent:
        logits = model.decode(tokens[:, -1:] if kv is not None else tokens, memory, mem_mask, kv)[:, -1].float()
        if t < min_len:
            logits[:, EOS] = NEG_INF
        if no_repeat_ngram > 0:
            ban_ngrams(logits, tokens[:, 1:], no_repeat_ngram)
        nxt = logits.argmax(dim=-1)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        ended = (nxt == EOS).tolist()
        keep = []
        for i, s in enumerate(sent):
            if ended[i] or t + 1 >= limits[s]:
                seq = tokens[i, 1:].tolist()
                out[s] = seq[:-1] if ended[i] else seq
            else:
                keep.append(i)
        if not keep:
            break
        if len(keep) < len(sent):
            idx = torch.tensor(keep)
            tokens, memory, mem_mask = tokens[idx], memory[idx], mem_mask[idx]
            if kv is not None:
                kv.reorder(idx)
            sent = [sent[i] for i in keep]
        t += 1
    return out


# A random model whose outputs end at varied lengths --------------------------------------------------------


def random_mt(eos_bias: float):
    """A tiny random model (vocabulary 50) and 24 sources of 1-13 tokens; the EOS bias sets how often
    outputs end before their step limit."""
    torch.manual_seed(1)
    m = build_model(model_config("tiny", vocab_size=50, dropout=0.0, output_bias=True)).eval()
    with torch.no_grad():
        m.decoder.output_bias[EOS] = eos_bias
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 14, (24,), generator=g)
    src = torch.full((24, int(lengths.max())), PAD)
    for i, n in enumerate(lengths.tolist()):
        src[i, :n] = torch.randint(4, 50, (n,), generator=g)
    return m, src


@pytest.fixture(scope="module")
def mt():
    return random_mt(2.6)


def ended_early_and_cut(outputs: list[list[int]], src: Tensor) -> tuple[int, int]:
    """How many outputs ended by EOS before the step limit int(0.5 * len + 6), and how many were cut."""
    limits = [int(0.5 * n + 6) for n in (src != PAD).sum(1).tolist()]
    return sum(len(o) < lim for o, lim in zip(outputs, limits)), sum(len(o) == lim for o, lim in zip(outputs, limits))


def same(got: list[list[Hypothesis]], want: list[list[Hypothesis]], exact: bool) -> None:
    assert [[h.tokens for h in hs] for hs in got] == [[h.tokens for h in hs] for hs in want]
    flat = lambda hs, f: [getattr(h, f) for h_ in hs for h in h_]  # noqa: E731
    for f in ("score", "logprob"):
        if exact:
            assert flat(got, f) == flat(want, f)
        else:
            assert flat(got, f) == pytest.approx(flat(want, f), **SUM_TOL)


BEAM_CASES = [
    dict(length_penalty="gnmt", alpha=0.6, stop="exact", nbest=1),
    dict(length_penalty="power", alpha=0.6, stop="hf", nbest=4),
    dict(length_penalty="power", alpha=-0.5, stop="exact", nbest=2),
    dict(length_penalty="none", alpha=0.0, stop="exact", nbest=3, min_len=3),
    dict(length_penalty="gnmt", alpha=2.0, stop="hf", nbest=2, no_repeat_ngram=2),
]


@pytest.mark.parametrize("case", BEAM_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_beam_equals_the_former_search_with_the_former_cache_and_without_cache(mt, case):
    m, src = mt
    kw = dict(beam=4, max_len_a=0.5, max_len_b=6, **case)
    got = beam_search(m, src, spec=spec_of(**kw))
    early, cut = ended_early_and_cut([hs[0].tokens for hs in got], src)
    assert early >= 5 and cut >= 5  # sentences leave the batch at varied steps
    same(got, reference_beam(m, src, **kw), exact=False)
    same(got, reference_beam(m, src, cache=None, **kw), exact=False)


def test_beam_equals_the_former_search_bit_for_bit_on_a_scripted_model(mt):
    """With logits that do not depend on the cache layout, every score is the same float as before."""
    m, src = mt
    table = torch.randn(40, 40, generator=torch.Generator().manual_seed(3)) * 2.0
    table[:, EOS] -= 1.0

    class Scripted:
        decoder = m.decoder
        cfg = m.cfg

        def encode(self, src, mask):
            return src[:, :1, None].float()

        def new_cache(self):
            return CatKVCache(1)

        def decode(self, tgt, memory, mask, cache=None):  # logits from the last token and the source
            last = tgt[:, -1]
            memory = memory.repeat_interleave(tgt.size(0) // memory.size(0), 0)  # a sentence's beams share a row
            return (table[last] + 0.1 * memory[:, 0, :1])[:, None, :]

    for kind, alpha, stop in (("gnmt", 0.6, "exact"), ("power", 1.0, "hf"), ("none", 0.0, "exact")):
        kw = dict(beam=4, alpha=alpha, length_penalty=kind, stop=stop, nbest=4, max_len_a=0.5, max_len_b=6)
        same(beam_search(Scripted(), src, spec=spec_of(**kw)), reference_beam(Scripted(), src, **kw), exact=True)


@pytest.mark.parametrize("kw", [dict(), dict(min_len=2, no_repeat_ngram=2)])
def test_greedy_equals_the_former_search(kw):
    m, src = random_mt(3.0)
    got = greedy_search(m, src, spec=spec_of(max_len_a=0.5, max_len_b=6, **kw))
    assert got == reference_greedy(m, src, max_len_a=0.5, max_len_b=6, **kw)
    assert got == reference_greedy(m, src, max_len_a=0.5, max_len_b=6, cache=None, **kw)
    early, cut = ended_early_and_cut(got, src)
    assert early >= 2 and cut >= 5


def test_scores_are_float64_except_on_mps():
    dtype = search_common.score_dtype
    assert dtype(torch.device("cpu")) == torch.float64 == dtype(torch.device("cuda"))
    assert search_common.score_dtype(torch.device("mps")) == torch.float32  # MPS has no float64


def test_finished_pool_keeps_the_n_best_with_earlier_ties_first():
    """_Finished.offer on tensors == inserting one hypothesis at a time into sorted Python lists."""
    rng = random.Random(0)
    for trial in range(40):
        n, N, steps = 3, rng.randint(1, 4), 6
        pools: list[list[Hypothesis]] = [[] for _ in range(n)]
        fin = _Finished(n, N, steps, torch.device("cpu"))
        for t in range(steps):
            scores = [[rng.choice([NEG_INF, -1.0, -2.0, -0.5, rng.uniform(-3, 0)]) for _ in range(N)]
                      for _ in range(n)]
            seqs = torch.tensor([[[rng.randrange(4, 9) for _ in range(t + 1)] for _ in range(N)] for _ in range(n)])
            lengths = torch.full((n, N), t + 1)
            lp = torch.tensor(scores, dtype=torch.float32).clamp(min=-10.0)
            fin.offer(torch.tensor(scores, dtype=torch.float64), lp, seqs, lengths)
            for i in range(n):
                for j in range(N):
                    if scores[i][j] != NEG_INF:
                        offer(pools[i], Hypothesis(seqs[i, j].tolist(), scores[i][j], float(lp[i, j])), N)
        fin.save_and_keep(torch.arange(n), torch.arange(n))
        assert fin.hypotheses(N) == pools, trial


# The preallocated cache equals one grown by torch.cat --------------------------------------------------------


def test_kv_cache_equals_the_cat_cache_through_appends_reorders_and_growth():
    g = torch.Generator().manual_seed(0)
    L, H, K = 3, 2, 4
    ours, ref = KVCache(L, capacity=3), CatKVCache(L)
    rows = 5

    def step(t: int) -> None:
        for layer in range(L):
            k, v = torch.randn(rows, H, t, K, generator=g), torch.randn(rows, H, t, K, generator=g)
            got, want = ours.append_self(layer, k, v), ref.append_self(layer, k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert ours.length == ref.length

    step(2)  # a prefill of two steps
    for t, idx in enumerate([[4, 4, 0, 1, 2], [3, 1], [0, 0, 1, 1, 0, 1, 0], None, None, [6, 5, 4, 3, 2, 1, 0], None]):
        if idx is not None:
            ours.reorder(torch.tensor(idx), cross=False)
            ref.reorder(torch.tensor(idx), cross=False)
            rows = len(idx)
        step(3 if t == 5 else 1)  # past the reserved 3 steps it grows; a 3-step chunk after a reorder
    assert ours.length == ref.length == 11
    with pytest.raises(ValueError, match="reorder it first"):
        ours.append_self(0, torch.zeros(2, H, 1, K), torch.zeros(2, H, 1, K))


def test_kv_cache_storage_grows_by_doubling_up_to_the_reserve():
    L, H, K, rows = 2, 2, 4, 3
    kv = lambda: (torch.zeros(rows, H, 1, K), torch.zeros(rows, H, 1, K))  # noqa: E731

    def steps(cache: KVCache, n: int, reorder: bool) -> set[int]:
        storages = set()
        for _ in range(n):
            for layer in range(L):
                cache.append_self(layer, *kv())
            if reorder:
                cache.reorder(torch.arange(rows), cross=False)
            storages |= {cache._store.data_ptr(), cache._spare.data_ptr()}
        return storages

    per_step = L * 2 * rows * H * K
    cache = KVCache(L, capacity=100)
    steps(cache, 1, False)
    assert cache._store.numel() == 64 * per_step  # room for 64 steps first, not the whole reserve
    assert len(steps(cache, 69, False)) <= 4 and cache._store.numel() == 100 * per_step  # doubled, capped
    steps(cache, 31, False)
    assert cache._store.numel() == 200 * per_step  # past the reserve it still doubles
    small = KVCache(L, capacity=10)
    storages = steps(small, 40, True)  # beam search: a reorder every step
    assert len(storages) <= 8 and small.length == 40 and small._buf.size(4) == 41  # compact: room for one more


def test_cached_decoding_with_reorders_equals_the_cat_cache(mt):
    m, src = mt
    mask = src != PAD
    memory = m.encode(src, mask)
    g = torch.Generator().manual_seed(1)
    ours, ref = m.new_cache(capacity=4), CatKVCache(len(m.decoder.layers))
    tok = torch.full((src.size(0), 1), BOS)
    with torch.no_grad():
        for _ in range(7):
            a, b = m.decode(tok, memory, mask, ours), m.decode(tok, memory, mask, ref)
            assert_close_at_scale(a, b, 1e-5, "preallocated vs concatenated cache")
            idx = torch.randint(0, tok.size(0), (tok.size(0),), generator=g)
            ours.reorder(idx)
            ref.reorder(idx)
            memory, mask = memory[idx], mask[idx]
            tok = a[:, -1].argmax(-1, keepdim=True)


# One wait for the device per step ------------------------------------------------------------------------


def test_beam_greedy_and_sampling_wait_for_the_device_once_per_step(mt, monkeypatch):
    """As on a GPU (no free host reads): the search's only transfer inside its loop is one ``nonzero``
    per step, and the model's forward passes read nothing back (attention masks empty rows without asking
    whether there are any). The PyTorch search's (the native loop, which a CPU batch this small would take, runs on
    the host by construction)."""
    m, src = mt
    monkeypatch.setattr(search_beam, "waits_are_free", lambda device: False)
    monkeypatch.setattr(search_beam.native, "chosen", lambda *a: False)
    calls: dict[str, int] = {}
    state = {"steps": 0, "in_model": False}
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            key = f"model.{_name}" if state["in_model"] else _name
            calls[key] = calls.get(key, 0) + 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def in_model(fn, step: bool):
        def wrapped(*a, **k):
            state["steps"] += step
            state["in_model"] = True
            try:
                return fn(*a, **k)
            finally:
                state["in_model"] = False
        return wrapped

    monkeypatch.setattr(m, "decode", in_model(m.decode, True))
    monkeypatch.setattr(m, "encode", in_model(m.encode, False))
    for run in (lambda: beam_search(m, src, spec=spec_of(beam=4, max_len_b=6, nbest=2)),
                lambda: greedy_search(m, src, spec=spec_of(max_len_b=6)),
                lambda: sample_search(m, src, spec=spec_of(sample=True, nbest=2, max_len_b=6, seed=1))):
        calls.clear()
        state["steps"] = 0
        run()
        assert state["steps"] > 3
        assert calls.pop("nonzero") == state["steps"]  # which rows are done: one wait per step
        # the step limits before the loop (one transfer) and the results after it (one per field)
        assert calls.pop("tolist") <= 5 and not calls, calls


# Models in half precision: log-softmax and scores in fp32 ------------------------------------------------


FP16_PROBE = """
import torch, torch.nn.functional as F
x = torch.randn(8, 3, 32, dtype=torch.float16)
w = torch.randn(64, 32, dtype=torch.float16)
F.layer_norm(F.linear(x, w), (64,)).softmax(-1)
torch.matmul(x, x.transpose(1, 2))
"""


@pytest.fixture(scope="module")
def fp16_ok() -> None:
    """fp16 matmul on this CPU, tried in a child process (an unsupported CPU may die on an instruction)."""
    if subprocess.run([sys.executable, "-c", FP16_PROBE], capture_output=True, timeout=120).returncode != 0:
        pytest.skip("fp16 matmul does not run on this CPU")


def test_half_precision_model_decodes_with_fp32_scores(mt, fp16_ok):
    m32, src = mt
    m16 = build_model(m32.cfg).eval()
    m16.load_state_dict(m32.state_dict())
    m16 = m16.to(torch.float16)
    kw = dict(beam=4, alpha=0.6, length_penalty="power", max_len_a=0.5, max_len_b=6, nbest=2)
    calls = []
    log_softmax = F.log_softmax

    def spy(x, dim=None, dtype=None, **k):
        calls.append((x.dtype, dtype))
        return log_softmax(x, dim=dim, dtype=dtype, **k)

    search_beam.F.log_softmax = spy
    try:
        half = beam_search(m16, src, spec=spec_of(**kw))
    finally:
        search_beam.F.log_softmax = log_softmax
    assert calls and all(c == (torch.float16, torch.float32) for c in calls)  # fp16 logits, fp32 log-softmax
    full = beam_search(m32, src, spec=spec_of(**kw))
    assert sum(a[0].tokens == b[0].tokens for a, b in zip(half, full)) >= 0.75 * len(full)
    # the scores are fp32 sums: equal to a teacher-forced fp32 pass over the fp16 model's logits
    rescored = score_tokens(m16, src, src != PAD, [h[0].tokens for h in half], spec_of(**kw))
    assert [h[0].logprob for h in half] == pytest.approx([r.logprob for r in rescored], abs=2e-2)
    cache = m16.new_cache()
    m16.decode(torch.full((2, 1), BOS), m16.encode(src[:2], src[:2] != PAD), src[:2] != PAD, cache)
    assert cache.self_kv(0)[0].dtype == torch.float16  # the cache stores the model's dtype
    greedy16 = greedy_search(m16, src, spec=spec_of(max_len_a=0.5, max_len_b=6))
    assert sum(a == b for a, b in zip(greedy16, greedy_search(m32, src, spec=spec_of(max_len_a=0.5,
                                                                                     max_len_b=6)))) >= 18


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_search_equals_cpu_search(mt, dtype):
    m, src = mt
    gpu = build_model(m.cfg).eval()
    gpu.load_state_dict(m.state_dict())
    gpu = gpu.to("cuda", dtype)
    kw = dict(beam=4, alpha=0.6, length_penalty="power", max_len_a=0.5, max_len_b=6, nbest=2)
    got = beam_search(gpu, src.cuda(), spec=spec_of(**kw))
    want = beam_search(m, src, spec=spec_of(**kw))
    if dtype == torch.float32:
        same(got, want, exact=False)
        assert greedy_search(gpu, src.cuda(), spec=spec_of(max_len_b=6)) == greedy_search(m, src,
                                                           spec=spec_of(max_len_b=6))
    else:
        assert sum(a[0].tokens == b[0].tokens for a, b in zip(got, want)) >= 0.75 * len(want)
