"""Shared fixtures: a tiny trained run directory (reverse-words task) built once per test session."""

from __future__ import annotations

import os
import random
import sys
import tempfile
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import rounding  # tests/ is on sys.path under pytest
import torch
from tiny_recipe import TINY_RUN_OVERRIDES  # (re-exported to tests)

from aiayn.data.tokenizer import SpecialIds
from aiayn.search import SearchSpec, score_tokens

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks/ (imported by tests) is not an installed package

# Two cores on CI, shared by the test processes (make test runs one per core with pytest-xdist): intra-op
# threads are the cores each process has to itself, so the processes never contend for a core.
def _threads_per_process(processes: int) -> int:
    return max(1, min(2, (os.cpu_count() or 1) // processes))


# AIAYN_TEST_PROCESSES: test processes started side by side without xdist (tests/alone.py).
_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or os.environ.get("AIAYN_TEST_PROCESSES") or 1)
torch.set_num_threads(_threads_per_process(_PROCESSES))

# Token stores a training prepares for itself go to $AIAYN_CACHE_DIR/stores: one directory for the whole test run
# (every xdist worker shares it, as concurrent runs of a user do), never the user's own ~/.cache/aiayn.
if "AIAYN_CACHE_DIR" not in os.environ:
    _run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    os.environ["AIAYN_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"aiayn-test-cache-{_run}")
# The native beam search compiles once per source, CPU and PyTorch (aiayn.search.native): kept between test runs, so
# that only a changed native.cpp costs a run its ~35 s build (tests that set AIAYN_CACHE_DIR of their own included).
os.environ.setdefault("AIAYN_NATIVE_DIR", os.path.join(tempfile.gettempdir(), "aiayn-test-native"))


# --precision auto stays fp32 on a CPU with native bf16 too (aiayn.cpu_probe): the suite's comparisons with fp32
# references (Hugging Face, CTranslate2, torch.nn.MultiheadAttention, cached = uncached) mean the same on every
# machine; tests/test_cpu_bf16.py asks for bf16 by name, and checks auto's choice with this unset.
os.environ.setdefault("AIAYN_CPU_BF16", "off")


# AIAYN_TEST_ROUNDING=SEED[:SCALE] (tests/rounding.py): another CPU's rounding, simulated, in this process and in
# every Python process a test starts.
if rounding.install():
    _site = str(Path(__file__).resolve().parent / "rounding_site")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_site, os.environ.get("PYTHONPATH")) if p)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The CPU kernels the run rounded with, beside its counts (the end of a log is what a CI failure shows): a
    failure that only one machine shows is read against them. PyTorch picks its kernels by the CPU's instruction
    sets unless ATEN_CPU_CAPABILITY lowers them; MKL picks its own unless MKL_CBWR pins them."""
    workers = getattr(config.option, "numprocesses", None) or _PROCESSES
    line = (
        f"cpu kernels: torch {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY="
        f"{os.environ.get('ATEN_CPU_CAPABILITY') or 'unset'}), MKL_CBWR={os.environ.get('MKL_CBWR') or 'unset'}, "
        f"{max(workers, 1)} process(es) x {_threads_per_process(max(workers, 1))} intra-op thread(s)"
    )
    got = rounding.settings()
    if got:
        line += f"; {rounding.ENV}: seed {got[0]}, scale {got[1]:g} (another CPU's rounding, simulated)"
    terminalreporter.write_line(line)
    terminalreporter.write_line(order_line(config))


def order_line(config: pytest.Config) -> str:
    """The order the tests ran in, and how to run them in it again: pytest-randomly shuffles the modules, the
    tests in each module and the parameters of each test, by a seed it draws per run (``-p no:randomly``: file
    order)."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is None or not config.pluginmanager.hasplugin("randomly"):
        return "test order: as written (pytest-randomly off)"
    return (f"test order: shuffled by pytest-randomly, seed {seed} "
            f"(this order again: -p randomly --randomly-seed={seed})")


@pytest.fixture(autouse=True)
def _seeded_global_rngs(request: pytest.FixtureRequest) -> None:
    """Every test starts with the global random generators (torch, numpy, ``random``) seeded from its own name, so
    what it draws without a generator of its own is the same alone, in any order and in any subset: a test may not
    depend on what ran before it in the same process (a batching test did: its lengths came from torch's global
    generator and it failed when run alone)."""
    import numpy as np

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pytest_configure(config: pytest.Config) -> None:
    """The CPU suite runs on the CPU on every machine. On a GPU machine, a test that leaves the device to "auto"
    (aiayn's default) would decode on the GPU and compare that with a CPU reference at the GPU's rounding (the
    likely cause of 6 failed decoding comparisons on an H200 machine, 2026-11-27). CUDA stays visible only to a run
    that selects the GPU tests (``pytest -m cuda tests/test_cuda.py``). Set before anything asks CUDA for its
    devices (PyTorch reads the variable then); processes the tests start inherit it."""
    # pytest-randomly reseeds `random` and numpy before each test by its run's seed, so a test's draws would change
    # from run to run; _seeded_global_rngs seeds them (and torch) by the test's name instead: the order is random,
    # what each test draws is not.
    if hasattr(config.option, "randomly_reset_seed"):
        config.option.randomly_reset_seed = False
    markexpr = config.getoption("markexpr") or ""
    if "cuda" not in markexpr.replace("not cuda", ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # The native beam search is compiled here, once, before any test runs (in xdist's controller, before it starts
    # the workers; a no-op when already built): else the first test to search builds it (~35 s) while the others
    # wait on its lock, and a server a test starts spends its first request, and that test's time limit, on it.
    if not hasattr(config, "workerinput"):
        from aiayn.search import native

        native.module()


def shared_data_dir() -> Path | None:
    """$AIAYN_DATA_DIR or ../shared/data beside the repo, if present."""
    env = os.environ.get("AIAYN_DATA_DIR")
    for cand in ([Path(env)] if env else []) + [REPO.parent / "shared" / "data"]:
        if cand.is_dir():
            return cand
    return None


def loopback_port() -> int:
    """A free TCP port on 127.0.0.1 for a server that another process binds later (torchrun's ``--master-port``,
    a process group's ``MASTER_PORT``), picked below the kernel's ephemeral range. A port from ``bind(0)`` is in
    that range, where the kernel hands ports to every other process's ``bind(0)`` and outgoing connections (gloo's
    sockets, TCP stores of the torchrun jobs other tests start alongside): between this probe and the server's bind
    it may become a stranger's socket, which the job's clients would then reach. Below the range only a port that is
    asked for by number can be taken."""
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; elsewhere a taken port fails the bind below and another is tried
    candidates = [p for p in range(max(1024, low - 10000), low) if p != 29500]  # 29500: torchrun's default
    for port in random.Random().sample(candidates, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range on 127.0.0.1")


# Summed log-probabilities (beam scores of -40 and more) compared across code paths: float32 sums of many
# terms in another order differ by a few ulps of the sum, so the tolerance is relative to it (1e-5 of -42.9
# is 4e-4; a wrong token or a wrong length penalty moves a score by 1e-1 or more).
SUM_TOL = dict(rel=1e-5, abs=1e-6)


def assert_close_at_scale(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: object = "") -> None:
    """max |actual - expected| <= ``rel`` x max |expected|: for tensors whose elements are sums of many float terms
    computed in another order (another shape, another kernel, another CPU). An element near zero then carries the
    rounding of its terms' magnitude, not of its own, so an element-wise relative tolerance fails on it and an
    absolute one is a guess at the scale; this one is relative to the tensor's scale. A wrong mask, padding or
    cache moves a result by a large fraction of that scale, so it still fails."""
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
    scale = expected.detach().double().abs().max().item()
    assert diff <= rel * scale, f"{what}: max |difference| {diff:.3g} > {rel:g} x max |expected| {scale:.3g}"


# Two hypotheses whose length-penalized scores are this close may come in either order from two paths that sum
# floats in another order (batched and padded vs alone, aiayn vs Hugging Face or CTranslate2, another CPU's
# kernels): those move a score by ~1e-6 of it. A wrong token, a wrong length penalty or a broken cache moves a
# score by 1e-2 or more, so it still fails the comparisons below.
TIE = dict(rel=1e-4, abs=1e-4)


def same_hypotheses(ours: Sequence[tuple[Sequence[int], float]], theirs: Sequence[tuple[Sequence[int], float]],
                    what: object = "") -> int:
    """Assert that two paths' hypotheses for one source, best first, as ``(ids, score)``, agree: rank by rank the
    scores within :data:`TIE`, and the ids equal except at a rank whose two candidates tie within it (a swap of
    near-equal candidates, not an error). The number of ranks whose ids differ (callers bound it, so that a test
    cannot pass on ties alone)."""
    assert len(ours) == len(theirs), (what, ours, theirs)
    for k, ((a, sa), (b, sb)) in enumerate(zip(ours, theirs)):
        assert sa == pytest.approx(sb, **TIE), (what, k, list(a), list(b), sa, sb)
    return sum(list(a) != list(b) for (a, _), (b, _) in zip(ours, theirs))


def rescored(model: torch.nn.Module, src: Sequence[int], found: Sequence[Sequence[int]], spec: SearchSpec
             ) -> list[tuple[list[int], float]]:
    """``found`` (token lists for source ids ``src``, EOS included) with the model's teacher-forced scores under
    ``spec``'s length penalty: for comparing with a path that gives ids without scores."""
    batch = torch.tensor([list(src)] * len(found))
    return [(h.tokens, h.score) for h in score_tokens(model, batch, batch != spec.pad, found, spec)]


def agree_up_to_ties(translator: Any, texts: Sequence[str], ours: Sequence[Sequence[int]],
                     theirs: Sequence[Sequence[int]], options: Any = None) -> int:
    """Assert that two paths' best outputs (ids) for ``texts`` are equal, except for a text whose two outputs tie
    within :data:`TIE` in the translator's own scores under ``options`` (a DecodeOptions; the run's by default);
    at most a quarter of the texts (or one) may differ so. The number that differ."""
    spec = SearchSpec(options or translator.cfg.decode, translator.tokenizers.specials)
    differ = 0
    for text, a, b in zip(texts, ours, theirs, strict=True):
        if list(a) != list(b):
            src = translator.tokenizers.src.encode(text) + [spec.eos]
            differ += same_hypotheses(rescored(translator.model, src, [a], spec),
                                      rescored(translator.model, src, [b], spec), text)
    assert differ <= max(1, len(texts) // 4), f"{differ} of {len(texts)} outputs differ (each a tie)"
    return differ


# A greedy pick this far above its runner-up (in logits) is the same for any float summation order (batched
# and left-padded vs alone, another CPU's kernels: those move a logit by ~1e-5); checked by greedy_gap before a
# test compares two decoding paths token for token, so that the exact comparison holds by construction.
GREEDY_GAP = 1e-3


def pick_gaps(logits: torch.Tensor, picks: Sequence[int]) -> torch.Tensor:
    """The margin by which each of ``picks`` beat every other id in its row of ``logits`` (T, V), one pick per row
    (negative where one was not the argmax): (len(picks),)."""
    index = torch.tensor(list(picks))[:, None]
    logits = logits[: len(picks)].float()
    return logits.gather(1, index)[:, 0] - logits.scatter(1, index, float("-inf")).max(dim=1).values


def pick_gap(logits: torch.Tensor, picks: Sequence[int]) -> float:
    """The smallest of :func:`pick_gaps`; ``inf`` for no picks."""
    return float(pick_gaps(logits, picks).min()) if picks else float("inf")


def _lm_pick_logits(model: torch.nn.Module, prompt: list[int], new: list[int]) -> torch.Tensor:
    """A decoder-only LM's logits (len(new), V) at the positions that picked ``new`` after ``prompt``, teacher-forced
    in one pass."""
    with torch.no_grad():
        return model(torch.tensor([prompt + new]))[0, len(prompt) - 1:]


def greedy_gap(model: torch.nn.Module, prompt: list[int], new: list[int]) -> float:
    """:func:`pick_gap` of the ids ``new`` a decoder-only LM chose after ``prompt`` (teacher-forced in one pass)."""
    return pick_gap(_lm_pick_logits(model, prompt, new), new) if new else float("inf")


def greedy_clear_picks(model: torch.nn.Module, prompt: list[int], new: list[int]) -> int:
    """How many of the ids ``new`` a decoder-only LM chose greedily after ``prompt`` come before the first pick
    within :data:`GREEDY_GAP` of its runner-up (``len(new)`` when none is; teacher-forced in one pass). Up to there
    any float summation order picks the same ids, so two decoding paths must agree; at that pick they may part.
    For a trained model, whose margins depend on the CPU that trained it, where :func:`greedy_gap` as a
    precondition could fail on another machine."""
    if not new:
        return 0
    close = (pick_gaps(_lm_pick_logits(model, prompt, new), new) <= GREEDY_GAP).nonzero()
    return int(close[0, 0]) if len(close) else len(new)


def _seq2seq_pick_logits(model: torch.nn.Module, src: torch.Tensor, picks: Sequence[int], bos: int) -> torch.Tensor:
    """An encoder-decoder's logits (len(picks), V) at the positions that picked ``picks`` for one source ``src``
    (1, S), teacher-forced in one pass."""
    with torch.no_grad():
        return model(src, torch.tensor([[bos] + list(picks)[:-1]], device=src.device))[0]


def seq2seq_greedy_gap(model: torch.nn.Module, src: torch.Tensor, tokens: Sequence[int], ended: bool,
                       bos: int = 2, eos: int = 3) -> float:
    """:func:`pick_gap` of an encoder-decoder's greedy output ``tokens`` for one source ``src`` (1, S), EOS
    included as the last pick when the output ``ended`` with it (teacher-forced in one pass)."""
    picks = list(tokens) + ([eos] if ended else [])
    if not picks:
        return float("inf")
    return pick_gap(_seq2seq_pick_logits(model, src, picks, bos), picks)


def seq2seq_clear_picks(model: torch.nn.Module, src: torch.Tensor, tokens: Sequence[int], ended: bool,
                        gap: float = GREEDY_GAP, bos: int = 2, eos: int = 3) -> int:
    """How many of an encoder-decoder's greedy picks for ``src`` (1, S), ``tokens`` and then EOS when the output
    ``ended``, come before the first pick within ``gap`` of its runner-up (all of them when none is): the prefix
    that any other rounding smaller than ``gap`` (another CPU's kernels, a GPU, a lower precision) must decode
    the same. For a trained model, whose margins are its training's, never a precondition."""
    picks = list(tokens) + ([eos] if ended else [])
    if not picks:
        return 0
    close = (pick_gaps(_seq2seq_pick_logits(model, src, picks, bos), picks) <= gap).nonzero()
    return int(close[0, 0]) if len(close) else len(picks)


# An EOS id that no model produces: a language model's sample() then runs to its max_new_tokens.
NO_EOS = -1


def spec_of(bos_id: int = 2, eos_id: int = 3, pad_id: int = 0, **options) -> SearchSpec:
    """A SearchSpec from decoding options and the special ids by name (``bos_id`` is the decoder's start)."""
    return SearchSpec.of(SpecialIds(pad=pad_id, bos=bos_id, eos=eos_id, decoder_start=bos_id), **options)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A run directory trained for a few seconds on the reverse task: config, tokenizer, checkpoints,
    model.safetensors, metrics.jsonl. Good enough to exercise every command; not a quality model."""
    from aiayn.config import load_config
    from aiayn.train.run import train

    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    cfg = load_config(REPO / "configs" / "tiny_reverse.yaml", TINY_RUN_OVERRIDES)
    train(cfg, run_dir, progress=False)
    return run_dir


@pytest.fixture(scope="session")
def lm_run(tmp_path_factory) -> Path:
    """A character language model (context 32) trained a few updates on a small text: the serving tests' LM (the
    protocol, not the text, is tested)."""
    from aiayn.train.run import train_from_config

    d = tmp_path_factory.mktemp("lm")
    (d / "text.txt").write_text("the cat sat on the mat. the dog sat on the log.\n" * 200, encoding="utf-8")
    (d / "lm.yaml").write_text(f"""task: lm
model: {{d_model: 32, n_heads: 2, d_ff: 64, n_decoder_layers: 2, dropout: 0.0, max_positions: 64}}
data: {{train_src: {d / 'text.txt'}, tokenizer: char, block_size: 32, batch_size: 8}}
train: {{max_updates: 30, warmup: 10, eval_every: 30, save_every: 30, log_every: 10, threads: 1}}
""", encoding="utf-8")
    train_from_config(d / "lm.yaml", d / "run", progress=False)
    return d / "run"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for modules of tiny matrices: on a 2-core machine extra threads only contend
    (up to 10x slower when the cores are shared), and float results stop depending on the core count."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def post_held(app: Any, client: Any, requests: list[tuple[str, dict]], queued: int | None = None) -> list:
    """Post each ``(path, json body)`` from its own thread while ``app``'s batcher is held, and release it once
    ``queued`` of them (by default all) wait in its queue: the batcher then sees them together, whatever the
    threads' timing, so a test of merging races no wait window. The responses, in the order of ``requests``."""
    batcher = app.state.service.batcher
    with ThreadPoolExecutor(len(requests)) as pool:
        with batcher.hold():
            futures = [pool.submit(client.post, path, json=body) for path, body in requests]
            all_queued = batcher.wait_queued(len(requests) if queued is None else queued)
        responses = [f.result() for f in futures]
    assert all_queued, [r.text for r in responses]
    return responses


def side_of(directory: Path, name: str, seqs: Sequence[Sequence[int]]):
    """A token store's :class:`~aiayn.data.store.Side` holding ``seqs`` (id lists), written into ``directory``: what
    training data is read from, for tests that build their pairs by hand."""
    import numpy as np

    from aiayn.data.store import Side

    ids, idx = directory / f"{name}.bin", directory / f"{name}.idx"
    np.fromiter((i for s in seqs for i in s), dtype="<u4").tofile(ids)
    offsets = np.zeros(len(seqs) + 1, dtype="<i8")
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    offsets.tofile(idx)
    return Side(ids, idx, np.dtype(np.uint32), len(seqs))


# A small model that has learned these sentences by heart: its translations end (EOS) where the data's do, so
# Argos' decoding (up to 256 tokens) and aiayn's (its max_len) see the same hypotheses. The reverse-task fixture
# is too young for that: its beams run to whatever limit they are given.
PAIRS = [
    ("The cat sleeps.", "Die Katze schläft."), ("The dog runs.", "Der Hund rennt."),
    ("A man reads a book.", "Ein Mann liest ein Buch."), ("Two children play.", "Zwei Kinder spielen."),
    ("The woman sings.", "Die Frau singt."), ("A bird flies.", "Ein Vogel fliegt."),
    ("The boy eats bread.", "Der Junge isst Brot."), ("It is raining.", "Es regnet."),
    ("Where is the station?", "Wo ist der Bahnhof?"), ("The sun shines!", "Die Sonne scheint!"),
    ("We drink water.", "Wir trinken Wasser."), ("The girl laughs.", "Das Mädchen lacht."),
]


@pytest.fixture(scope="session")
def learned_run(tmp_path_factory) -> Path:
    """A translation run that has learned :data:`PAIRS` by heart (tests of Argos packages and LibreTranslate)."""
    from aiayn.config import load_config
    from aiayn.train.run import train

    root = tmp_path_factory.mktemp("argos_run")
    for side, k in (("en", 0), ("de", 1)):
        (root / f"train.{side}").write_text("".join(p[k] + "\n" for p in PAIRS * 8), encoding="utf-8")
        (root / f"valid.{side}").write_text("".join(p[k] + "\n" for p in PAIRS), encoding="utf-8")
    cfg = load_config(REPO / "configs" / "tiny_reverse.yaml", [
        "data.dataset=null", f"data.train_src={root}/train.en", f"data.train_tgt={root}/train.de",
        f"data.valid_src={root}/valid.en", f"data.valid_tgt={root}/valid.de", "data.vocab_size=360",
        "data.max_tokens=1024", "model.d_model=64", "model.d_ff=128", "model.n_heads=2", "model.dropout=0.0",
        "train.max_updates=150", "train.warmup=30", "train.lr_scale=0.5", "train.label_smoothing=0.0",
        "train.eval_every=150", "train.save_every=150", "train.threads=1", "train.log_every=50",
    ])
    train(cfg, root / "run", progress=False)
    return root / "run"
