"""The one id-level "decode these sources": token-budget batches sorted by length, the search the options
name, results in input order. The translator, training's validation BLEU and the attention explorer all
decode through :func:`decode_ids`, so they agree (banned ids, lengths, n-gram blocking included).

The batches are the search's own, not training's: a source costs the row the encoder reads (its ids and the
EOS appended to it) once per row of the search (each beam, or each draw when sampling), and nothing else.

On a CPU with several intra-op threads, batches may be searched side by side (:func:`cpu_workers`): W worker threads,
each running its batch's operations on T / W of the process's T threads, as CTranslate2's ``inter_threads`` does. A
beam step's operations are too small to keep several threads busy (the PyTorch search, batches of 64 sentences at 2
threads: one at a time 1.32x one thread's speed, two side by side 1.75x, fp32; BENCHMARKS.md, section 2d). The native
search splits a batch's sentences over its threads itself (1.78x-1.85x at 2 threads, level with its batches side by
side: section 2i). PyTorch and the native search release the GIL, so the workers' arithmetic runs at once. A batch
is searched the same way whichever worker takes it, so the outputs do not depend on the scheduling.

Shapes: B batch, S source length.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType

import torch
from torch import Tensor, nn

from aiayn.config import DecodeOptions
from aiayn.device import model_device
from aiayn.search.beam import Beam
from aiayn.search.common import pad_rows
from aiayn.search.greedy import Greedy
from aiayn.search.sampling import Sampling
from aiayn.search.spec import SearchSpec
from aiayn.search.strategy import Hypothesis, Strategy

# The decoding strategies by name, in the order they are asked whether a call's options choose them: a new
# strategy is its class (beside its search) and one entry here, before any it specializes.
STRATEGIES: Mapping[str, Strategy] = MappingProxyType({s.name: s for s in (Sampling(), Greedy(), Beam())})


def strategy_for(options: DecodeOptions) -> Strategy:
    """The strategy ``options`` choose: the first of :data:`STRATEGIES` that says so."""
    return next(s for s in STRATEGIES.values() if s.chosen(options))


def rows_per_source(options: DecodeOptions) -> int:
    """The rows a source costs a search of ``options`` (the beam, or the draws when sampling): a batch's cost
    is its sources' ids and EOS times this."""
    return strategy_for(options).rows(options)


def search_batch(model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec, scores: bool = True
                 ) -> list[list[Hypothesis]]:
    """The hypotheses of one padded batch, best first: src (B, S) ids (EOS included), src_mask (B, S), by the
    strategy the options choose (``scores=False``: greedy search spares the teacher-forced pass, scores NaN)."""
    return strategy_for(spec.options).search(model, src, src_mask, spec, scores)


def decode_batches(widths: Sequence[int], opts: DecodeOptions, device_type: str) -> list[list[int]]:
    """The batches (lists of indices) :func:`decode_ids` searches, for source rows of ``widths`` ids each (a
    source and its EOS: what a sentence costs): sorted by width, equal widths in input order, each within
    ``len(batch) * widest * rows <= opts.batch_tokens(device_type)`` (rows: the beam, or the draws when
    sampling; a single wider source forms its own batch). The budget is per device (``DEFAULT_DECODE_TOKENS``:
    a GPU gets batches 8x the CPU's, so the search's matmuls fill it)."""
    rows_each, budget = rows_per_source(opts), opts.batch_tokens(device_type)
    batches: list[list[int]] = []
    for i in sorted(range(len(widths)), key=widths.__getitem__):  # stable: equal widths keep input order
        # sorted, so the newest source is the widest: the padded batch would be (len + 1) x widths[i]
        if batches and (len(batches[-1]) + 1) * widths[i] * rows_each <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


# How much faster k intra-op threads search one batch than one thread, at most: 0.8 k (measured at 2 threads on
# batches of 64 sentences: 1.32x fp32, 1.60x int8; BENCHMARKS.md section 2d). Workers are chosen where the batches'
# predicted time side by side beats it, so the guess errs toward the threads.
INTRA_OP_GAIN = 0.8


def _intra_op_speedup(threads: int) -> float:
    return 1.0 if threads == 1 else INTRA_OP_GAIN * threads


def _makespan(costs: Sequence[int], workers: int) -> int:
    """When the last of ``workers`` workers ends, each taking the next batch (in order) when it is free."""
    free = [0] * workers
    for cost in costs:
        free[free.index(min(free))] += cost
    return max(free)


def cpu_workers(device: torch.device, costs: Sequence[int], options: DecodeOptions) -> tuple[int, int]:
    """(workers, intra-op threads each) with which :func:`search_batches` searches batches of ``costs`` (each its
    padded ids: sentences x the widest) on a CPU whose PyTorch runs T intra-op threads (``--threads``): of W workers
    of T // W threads (W dividing T), the W whose predicted time is least, the batches taken in order by whichever
    worker is free (a time of ``sum(costs)`` for one thread; k threads on a batch :func:`_intra_op_speedup` times
    faster). So two equal batches on two threads go side by side, a large and a small one do not. (1, T) elsewhere: a
    GPU, one thread or batch, or sampling (whose draws follow one generator from batch to batch, so their order must
    not depend on the scheduling)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or options.sample or threads < 2 or len(costs) < 2:
        return 1, threads
    ways = [(w, threads // w) for w in range(1, min(threads, len(costs)) + 1) if threads % w == 0]
    return min(ways, key=lambda way: _makespan(costs, way[0]) / _intra_op_speedup(way[1]))


def _searched_side_by_side(model: nn.Module, batches: list[Tensor], spec: SearchSpec, scores: bool,
                           workers: tuple[int, int]) -> Iterator[list[list[Hypothesis]]]:
    """Each padded batch's hypotheses, in order, searched by ``workers`` = (W, threads each) worker threads. The
    first error (or the caller's stop) stops every worker at its next step; that error is raised, after all have
    stopped. The process's intra-op thread count is restored at the end."""
    count, each = workers
    failed: list[BaseException] = []  # in the order they happened: the first is the one to raise
    halt = threading.Event()
    asked = spec.stop
    spec = dataclasses.replace(spec, stop=lambda: halt.is_set() or (asked is not None and asked()))

    @torch.no_grad()
    def search(src: Tensor) -> list[list[Hypothesis]]:
        torch.set_num_threads(each)  # this worker's own (OpenMP's count is per thread)
        try:
            return search_batch(model, src, src != spec.pad, spec, scores)
        except BaseException as err:
            failed.append(err)
            halt.set()
            raise

    before = torch.get_num_threads()
    torch.set_num_threads(each)  # what a new thread starts with
    try:
        with ThreadPoolExecutor(count, thread_name_prefix="aiayn-search") as pool:
            futures = [pool.submit(search, src) for src in batches]
            try:
                for fut in futures:
                    yield fut.result()
            except BaseException:
                halt.set()
                for fut in futures:
                    fut.cancel()
                raise
    except BaseException as err:
        raise (failed[0] if failed and not isinstance(err, (KeyboardInterrupt, GeneratorExit)) else err) from None
    finally:
        torch.set_num_threads(before)


def search_batches(model: nn.Module, batches: Sequence[Tensor], spec: SearchSpec, scores: bool = True
                   ) -> Iterator[list[list[Hypothesis]]]:
    """The hypotheses of each padded batch (B, S) of ids (EOS included, ``spec.pad`` padding), in order: on a CPU
    searched side by side by :func:`cpu_workers`'s workers, elsewhere one after the other."""
    workers = cpu_workers(model_device(model), [src.numel() for src in batches], spec.options)
    if workers[0] > 1:
        return _searched_side_by_side(model, list(batches), spec, scores, workers)
    return (search_batch(model, src, src != spec.pad, spec, scores) for src in batches)


def decode_ids(model: nn.Module, sources: Sequence[Sequence[int]], spec: SearchSpec, scores: bool = True,
               progress: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
    """Search every source (ids without EOS; the spec's EOS is appended) and return its hypotheses, best first,
    in input order, in the token-budget batches of :func:`decode_batches`. The model must be in eval mode.
    ``scores=False`` spares greedy search the teacher-forced pass that scores its outputs; ``progress`` is
    called with the number of sources each batch decoded. On a CPU, batches may be searched side by side
    (:func:`cpu_workers`)."""
    device = model_device(model)
    out: list[list[Hypothesis]] = [[] for _ in sources]
    if not sources:
        return out
    rows = [[*s, spec.eos] for s in sources]  # what the encoder reads
    batches = decode_batches([len(r) for r in rows], spec.options, device.type)
    padded = [pad_rows([rows[i] for i in idx], spec.pad).to(device) for idx in batches]  # each (B, S)
    for idx, hyps in zip(batches, search_batches(model, padded, spec, scores)):
        for i, h in zip(idx, hyps):
            out[i] = h
        if progress is not None:
            progress(len(idx))
    return out
