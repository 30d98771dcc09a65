"""Batches: token-budget, length-bucketed batches for translation, contiguous blocks for LMs.

Shapes: B batch, S source length, T target length, L block size.

Translation examples become (fairseq / Marian convention, not spelled out in the paper)::

    src     = x_1 .. x_n  EOS          (S = n + 1: EOS tells the encoder where the sentence ends)
    tgt_in  = BOS  y_1 .. y_m          (T = m + 1: decoder input, shifted right)
    tgt_out = y_1 .. y_m  EOS          (what the decoder predicts at each position)

all right-padded with PAD. The paper batches "by approximate sequence length" with about 25,000
source and 25,000 target tokens per batch (section 5.1); like fairseq we bound the padded size:
``cost = B * max(S, T)``, the element count of the larger padded tensor, with the +1 above
included, so ``max_tokens`` is a true bound on memory per batch.

Bounded shapes (for GPUs: no per-shape re-planning or recompilation, tensor-core friendly sizes):
``pad_to_multiple`` rounds S and T of every batch up to a multiple (8 on GPUs), and ``buckets``
(increasing lengths) makes the shapes fixed: a batch whose longest side fits bucket L is padded to
S = T = L and to ``max_tokens // L`` rows (the missing rows all padding), one shape per bucket, as
CUDA graphs need. The cost of a batch is counted on its padded lengths, so the budget still holds.
Padding changes no loss and no gradient (padded keys are masked, padded targets ignored).
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from aiayn.errors import DataError

from .tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Batch:
    """One training or evaluation batch; ``src`` is None for language-model batches."""

    src: torch.Tensor | None  # (B, S) long
    tgt_in: torch.Tensor  # (B, T) long
    tgt_out: torch.Tensor  # (B, T) long
    ntokens: int  # non-pad tokens in tgt_out: the loss normaliser
    indices: list[int]  # example (or block) indices, to restore the input order

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(move(self.src), move(self.tgt_in), move(self.tgt_out), self.ntokens, self.indices)

    def pin_memory(self) -> Batch:
        """The same batch in page-locked host memory, so that ``to(cuda, non_blocking=True)`` is a real
        asynchronous copy (from pageable memory the host waits for it)."""
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return Batch(pin(self.src), pin(self.tgt_in), pin(self.tgt_out), self.ntokens, self.indices)

    def __len__(self) -> int:
        return self.tgt_in.size(0)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A DataLoader worker hands its batches over by pickle: host tensors go as numpy arrays, copied through the
        # pipe, instead of torch's shared-memory handover (one shared segment and file descriptor per tensor, dear
        # for batches of a few thousand tokens); the receiver wraps them without a copy.
        tensors = (self.src, self.tgt_in, self.tgt_out)
        if all(t is None or t.device.type == "cpu" for t in tensors):
            arrays = tuple(None if t is None else t.numpy() for t in tensors)
            return _batch_from_arrays, (*arrays, self.ntokens, self.indices)
        return Batch, (*tensors, self.ntokens, self.indices)


def _batch_from_arrays(src: np.ndarray | None, tgt_in: np.ndarray, tgt_out: np.ndarray, ntokens: int,
                       indices: list[int]) -> Batch:
    def wrap(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(a)

    return Batch(wrap(src), wrap(tgt_in), wrap(tgt_out), ntokens, indices)


def _rng(seed: int, epoch: int) -> random.Random:
    # A string seed is hashed with sha512 by `random`, so this is the same in every process
    # (unlike hash()), and different epochs give unrelated streams.
    return random.Random(f"aiayn:{seed}:{epoch}")


# From this many examples the tie-break permutation is numpy's (PCG64, seeded as _rng is): Python's shuffle of a
# WMT14-sized plan holds the interpreter about twice as long before every epoch's first update (benchmarks.data_scale,
# BENCHMARKS.md). Smaller corpora keep Python's shuffle, so their plans stay the batches recorded results used.
NUMPY_TIE_BREAK_FROM = 1 << 20


def _numpy_rng(seed: int, epoch: int) -> np.random.Generator:
    digest = hashlib.sha512(f"aiayn:{seed}:{epoch}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:32], "little")))


def padded_length(length: int, pad_to_multiple: int = 1, buckets: Sequence[int] = ()) -> int:
    """The padded size of a batch dimension whose longest sequence has ``length`` positions: the
    smallest bucket that holds it, else ``length`` rounded up to a multiple of ``pad_to_multiple``."""
    for b in buckets:
        if length <= b:
            return b
    return -(-length // pad_to_multiple) * pad_to_multiple


def batch_shape(src_widths: Sequence[int], tgt_widths: Sequence[int], max_tokens: int, pad_to_multiple: int = 1,
                buckets: Sequence[int] = ()) -> tuple[int | None, int, int]:
    """(rows, S, T) of the padded tensors of one batch, from its sequences' tensor widths (specials
    included). rows is None (as many as examples) unless the batch fits a bucket."""
    S, T = max(src_widths, default=0), max(tgt_widths, default=0)
    longest = max(S, T)
    if buckets and longest <= buckets[-1]:
        L = padded_length(longest, pad_to_multiple, buckets)
        return max(1, max_tokens // L), L, L
    return None, padded_length(S, pad_to_multiple), padded_length(T, pad_to_multiple)


def token_batches(
    src_lens: Sequence[int],
    tgt_lens: Sequence[int] | None,
    max_tokens: int,
    seed: int = 1,
    epoch: int = 0,
    shuffle: bool = True,
    pad_to_multiple: int = 1,
    buckets: Sequence[int] = (),
) -> list[list[int]]:
    """Group example indices into batches of similar length under a token budget.

    ``src_lens`` / ``tgt_lens`` are token counts without specials (``tgt_lens=None`` for
    one sequence per example, e.g. summarization's rows). A batch costs ``len(batch) * (max length + 1)``, the
    +1 being the EOS / BOS ``collate`` adds, and stays within ``max_tokens``, except that an
    example over the budget forms a batch of its own (it is never dropped here).

    Examples are sorted by length with a random tie-break, cut into batches, and the batch order
    is shuffled: deterministic for a given ``(seed, epoch)``, different across epochs. With
    ``shuffle=False`` ties keep index order and batches stay sorted (shortest first).
    Every index appears in exactly one batch. With ``pad_to_multiple`` / ``buckets`` (see the module
    docstring) the cost counts the padded length, ``padded_length(max length + 1)``.
    """
    return [b.tolist() for b in plan_batches(src_lens, tgt_lens, max_tokens, seed, epoch, shuffle,
                                             pad_to_multiple, buckets)]


def plan_batches(
    src_lens: Sequence[int] | np.ndarray,
    tgt_lens: Sequence[int] | np.ndarray | None,
    max_tokens: int,
    seed: int = 1,
    epoch: int = 0,
    shuffle: bool = True,
    pad_to_multiple: int = 1,
    buckets: Sequence[int] = (),
) -> list[np.ndarray]:
    """:func:`token_batches` as arrays of indices (int32 up to 2**31 examples): the same batches, planned in
    memory proportional to the corpus in 4-byte integers, not Python objects (an epoch of 4.5M pairs: seconds
    and tens of MB)."""
    n = len(src_lens)
    if tgt_lens is not None and len(tgt_lens) != n:
        raise ValueError(f"token_batches: {n} source lengths but {len(tgt_lens)} target lengths")
    if max_tokens <= 0:
        raise ValueError("token_batches: max_tokens must be positive")
    if pad_to_multiple < 1 or list(buckets) != sorted(set(buckets)) or any(b < 1 for b in buckets):
        raise ValueError("token_batches: pad_to_multiple must be >= 1 and buckets increasing positive lengths")
    src = np.asarray(src_lens, dtype=np.int32)
    true_len = _true_lengths(src, tgt_lens)
    padded = pad_to_multiple > 1 or bool(buckets)
    cost_len = _padded_lengths(true_len, pad_to_multiple, buckets) if padded else true_len
    # The tie-break: equal lengths come out in a seeded random order. random.shuffle on a compact array gives
    # the permutation it gives on list(range(n)) (the same draws), without n Python integers.
    code, dtype = ("i", np.int32) if n < 2**31 else ("q", np.int64)
    rng = _rng(seed, epoch)
    if shuffle and n >= NUMPY_TIE_BREAK_FROM:
        o = np.arange(n, dtype=dtype)
        _numpy_rng(seed, epoch).shuffle(o)  # permutation(n)'s order (the same draws) without its int64 array
    else:
        order = array(code, range(n))
        if shuffle:
            rng.shuffle(order)
        o = np.frombuffer(order, dtype=dtype) if n else np.zeros(0, dtype)
    # Sort by the padded length, then (padded batches) by the true length, then by source length so that source
    # padding is small too: a stable sort of the shuffled order, as list.sort would do, on one key that orders as
    # the tuple does (one int32 array where it fits, where np.lexsort would take a gathered copy of every column).
    o = o[np.argsort(_sort_key(o, cost_len, true_len if padded else None, src), kind="stable")]
    costs = cost_len[o]  # non-decreasing: a batch's longest member is its newest
    # Cut greedily: a batch takes the next example while (its size + 1) x that example's cost fits max_tokens.
    # The cost of m examples, m x costs[i + m - 1], only grows with m, so each batch's size is a binary search.
    cuts = []
    i = 0
    while i < n:
        lo, hi = 1, min(n - i, max(1, max_tokens // int(costs[i])))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mid * int(costs[i + mid - 1]) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        i += lo
        cuts.append(i)
    batches = np.split(o, cuts[:-1]) if n else []
    if shuffle:
        rng.shuffle(batches)
    return batches


def _sort_key(o: np.ndarray, *columns: np.ndarray | None) -> np.ndarray:
    """(n,) integers ordered as the tuples ``(c[o[i]] for c in columns)`` (None columns left out; every value
    >= 0): a mixed-radix number, int32 when it fits, else int64."""
    cols = [c for c in columns if c is not None]
    radix = [int(c.max()) + 1 if len(c) else 1 for c in cols]
    span = 1
    for r in radix:
        span *= r
    dtype = np.int32 if span < 2**31 else np.int64
    key = cols[0][o].astype(dtype)
    for c, r in zip(cols[1:], radix[1:]):
        key *= r
        key += c[o]
    return key


def _true_lengths(src: np.ndarray, tgt_lens: Sequence[int] | np.ndarray | None) -> np.ndarray:
    """(n,) int32: each example's longer side + 1 (the EOS / BOS ``collate`` adds)."""
    true_len = src.copy() if tgt_lens is None else np.maximum(src, np.asarray(tgt_lens, dtype=np.int32))
    true_len += 1  # in place: one array of n, not two
    return true_len


def pair_costs(src_lens: Sequence[int] | np.ndarray, tgt_lens: Sequence[int] | np.ndarray | None,
               pad_to_multiple: int = 1, buckets: Sequence[int] = ()) -> np.ndarray:
    """(n,) int32: what each example alone costs of a batch's token budget in :func:`token_batches` (its longer
    side + 1, padded as the batches are); an example that costs more than the budget forms a batch of its own."""
    true_len = _true_lengths(np.asarray(src_lens, dtype=np.int32), tgt_lens)
    return _padded_lengths(true_len, pad_to_multiple, buckets) if pad_to_multiple > 1 or buckets else true_len


def _padded_lengths(lengths: np.ndarray, pad_to_multiple: int, buckets: Sequence[int]) -> np.ndarray:
    """:func:`padded_length` of every length at once."""
    rounded = -(-lengths // pad_to_multiple) * pad_to_multiple
    if not buckets:
        return rounded
    b = np.asarray(buckets, dtype=np.int64)
    k = np.searchsorted(b, lengths, side="left")  # the first bucket >= length
    return np.where(k < len(b), b[np.minimum(k, len(b) - 1)], rounded)


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = PAD_ID, width: int | None = None,
              rows: int | None = None) -> torch.Tensor:
    """Right-pad id lists into a (rows, width) long tensor: by default (B, max_len); a larger ``width``
    or ``rows`` pads further (extra rows are all ``pad_id``)."""
    longest = max((len(s) for s in seqs), default=0)
    width = longest if width is None else width
    rows = len(seqs) if rows is None else rows
    if width < longest or rows < len(seqs):
        raise ValueError(f"pad_batch: {len(seqs)} sequences of up to {longest} ids do not fit ({rows}, {width})")
    out = torch.full((rows, width), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        if len(s):
            out[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


def collate(
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]],
    indices: Sequence[int],
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    shape: tuple[int | None, int, int] | None = None,
) -> Batch:
    """Build a :class:`Batch`: src = x + [EOS], tgt_in = [BOS] + y, tgt_out = y + [EOS], right-padded
    to the longest sequence, or to ``shape`` = (rows or None, S, T) from :func:`batch_shape`."""
    if not len(src_ids) == len(tgt_ids) == len(indices):
        raise ValueError("collate: src_ids, tgt_ids and indices must have the same length")
    rows, S, T = shape if shape is not None else (None, None, None)
    src = pad_batch([list(s) + [eos_id] for s in src_ids], pad_id, S, rows)  # (B, S)
    tgt_in = pad_batch([[bos_id] + list(t) for t in tgt_ids], pad_id, T, rows)  # (B, T)
    tgt_out = pad_batch([list(t) + [eos_id] for t in tgt_ids], pad_id, T, rows)  # (B, T)
    ntokens = int((tgt_out != pad_id).sum())
    return Batch(src, tgt_in, tgt_out, ntokens, list(indices))


def _pad_rows(flat: np.ndarray, lens: np.ndarray, rows: int, width: int, pad_id: int, before: int | None,
              after: int | None) -> np.ndarray:
    """(rows, width) int64: row b = [before] + flat's b-th run of lens[b] ids + [after], right-padded with
    ``pad_id`` (``before`` / ``after`` None: left out). One masked assignment for the whole batch."""
    lead = before is not None
    longest = int(lens.max()) + lead + (after is not None) if len(lens) else 0
    if width < longest or rows < len(lens):
        raise ValueError(f"collate: {len(lens)} sequences of up to {longest} ids do not fit ({rows}, {width})")
    out = np.full((rows, width), pad_id, dtype=np.int64)
    body = out[: len(lens), int(lead):]
    body[np.arange(body.shape[1]) < lens[:, None]] = flat  # row-major: each row's first lens[b] places, in order
    if lead:
        out[: len(lens), 0] = before
    if after is not None:
        out[np.arange(len(lens)), lens + lead] = after
    return out


def collate_flat(src: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray], indices: Sequence[int],
                 pad_id: int = PAD_ID, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
                 shape: tuple[int | None, int, int] | None = None) -> Batch:
    """:func:`collate` of sequences given flat: ``src`` = (ids back to back (N,), lengths (B,)), ``tgt`` the
    same; padded with numpy, a few array operations per batch whatever its size. The same Batch as
    :func:`collate` of the same id lists (tests/test_store.py)."""
    (s_ids, s_lens), (t_ids, t_lens) = src, tgt
    if not len(s_lens) == len(t_lens) == len(indices):
        raise ValueError("collate: src_ids, tgt_ids and indices must have the same length")
    rows, S, T = shape if shape is not None else (None, None, None)
    rows = len(indices) if rows is None else rows
    S = (int(s_lens.max()) + 1 if len(s_lens) else 0) if S is None else S
    T = (int(t_lens.max()) + 1 if len(t_lens) else 0) if T is None else T
    src_ = torch.from_numpy(_pad_rows(s_ids, s_lens, rows, S, pad_id, None, eos_id))  # (B, S)
    tgt_in = torch.from_numpy(_pad_rows(t_ids, t_lens, rows, T, pad_id, bos_id, None))  # (B, T)
    tgt_out = torch.from_numpy(_pad_rows(t_ids, t_lens, rows, T, pad_id, None, eos_id))  # (B, T)
    ntokens = int((tgt_out != pad_id).sum())
    return Batch(src_, tgt_in, tgt_out, ntokens, list(indices))


def lm_block_order(n: int, block_size: int, seed: int = 1, epoch: int = 0, shuffle: bool = True
                   ) -> tuple[int, np.ndarray]:
    """An epoch's blocks of a token stream of ``n`` tokens: (offset o, order (n_blocks,)), the k-th block trained on
    starting at ``o + order[k] * L``, L = ``block_size``.

    Block j is ``ids[o + j*L : o + j*L + L + 1]``: input ``block[:-1]``, target ``block[1:]``, so consecutive blocks
    share one boundary token and every target token after ``o`` is predicted once. With ``shuffle``, the offset
    ``o`` is drawn in [0, L) per (seed, epoch), so block boundaries move between epochs (nanoGPT draws random
    windows instead; this way one epoch still covers the stream once), and the blocks come in the order of a
    seeded ``torch.randperm``. With ``shuffle=False`` (evaluation), ``o = 0`` and blocks are in stream order.
    ``order`` is int32 while the blocks fit (4 bytes a block: the plan of a stream that stays on disk).
    """
    if block_size <= 0:
        raise ValueError("lm_blocks: block_size must be positive")
    if n < block_size + 1:
        raise ValueError(f"lm_blocks: a stream of {n} tokens is shorter than one block of {block_size + 1}")
    rng = _rng(seed, epoch)
    offset = min(rng.randrange(block_size), n - block_size - 1) if shuffle else 0
    n_blocks = (n - offset - 1) // block_size
    dtype = torch.int32 if n_blocks < 2**31 else torch.int64  # randperm gives the same order in either
    if shuffle:
        order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(rng.getrandbits(63)), dtype=dtype)
    else:
        order = torch.arange(n_blocks, dtype=dtype)
    return offset, order.numpy()


def lm_blocks(
    ids: torch.Tensor, block_size: int, seed: int = 1, epoch: int = 0, shuffle: bool = True
) -> torch.Tensor:
    """Cut a token stream (N,) held in memory into the blocks (n_blocks, L + 1) of :func:`lm_block_order`, in
    training order."""
    if ids.dim() != 1:
        raise ValueError(f"lm_blocks: expected a 1-D token stream, got shape {tuple(ids.shape)}")
    offset, order = lm_block_order(ids.numel(), block_size, seed, epoch, shuffle)
    starts = offset + torch.from_numpy(order).long() * block_size
    return ids[starts[:, None] + torch.arange(block_size + 1)].long()


def lm_batch(blocks: torch.Tensor, indices: list[int], pad_id: int = PAD_ID) -> Batch:
    """The batch of blocks (B, L + 1): ``tgt_in = block[:, :-1]``, ``tgt_out = block[:, 1:]``, both (B, L);
    ``src`` None; ``indices`` the blocks' places in their epoch."""
    tgt_out = blocks[:, 1:]
    return Batch(None, blocks[:, :-1], tgt_out, int((tgt_out != pad_id).sum()), indices)


def lm_batches(blocks: torch.Tensor, batch_size: int, pad_id: int = PAD_ID) -> list[Batch]:
    """Split blocks (n_blocks, L + 1) into batches of ``batch_size`` (the last may be smaller) (:func:`lm_batch`;
    ``indices`` are the rows of ``blocks``)."""
    if batch_size <= 0:
        raise ValueError("lm_batches: batch_size must be positive")
    return [lm_batch(blocks[s : s + batch_size], list(range(s, min(s + batch_size, blocks.size(0)))), pad_id)
            for s in range(0, blocks.size(0), batch_size)]


# Training on windows -----------------------------------------------------------------------------------------

ITER_BATCHES = 1024  # a block plan's batches made at a time when it is walked whole


class Stream(Protocol):
    """What windows are read from: a token stream of a store (:class:`aiayn.data.store.Stream`)."""

    def __len__(self) -> int: ...

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """(B, width) int64: row b is ids[starts[b] : starts[b] + width]."""
        ...


class BlockPlan(Sequence):
    """An epoch's batches of blocks, planned and not read: batch i is a (B, 2) int64 array, column 0 the blocks'
    places in the epoch's order, column 1 where each starts in the stream. Holds the epoch's block order
    (:func:`lm_block_order`: 4 bytes a block) and makes a batch's array when asked; a slice
    is a plan of fewer batches sharing that order, and a plan pickles as the list of its batches' arrays."""

    __slots__ = ("offset", "order", "block_size", "batch_size", "batches")

    def __init__(self, offset: int, order: np.ndarray, block_size: int, batch_size: int,
                 batches: range | None = None) -> None:
        self.offset, self.order, self.block_size, self.batch_size = offset, order, block_size, batch_size
        self.batches = range(-(-len(order) // batch_size)) if batches is None else batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return BlockPlan(self.offset, self.order, self.block_size, self.batch_size, self.batches[i])
        b = self.batches[i]
        return self._rows(b * self.batch_size, min((b + 1) * self.batch_size, len(self.order)))

    def _rows(self, first: int, stop: int) -> np.ndarray:
        """(stop - first, 2) int64: blocks ``first .. stop - 1`` of the epoch, their places and starts."""
        out = np.empty((stop - first, 2), dtype=np.int64)
        out[:, 0] = np.arange(first, stop)
        out[:, 1] = self.order[first:stop]
        out[:, 1] *= self.block_size
        out[:, 1] += self.offset
        return out

    def __iter__(self) -> Iterator[np.ndarray]:
        # a whole plan is walked once per epoch (each batch's tokens): its arrays made many batches at a time
        if self.batches.step != 1:
            yield from (self[i] for i in range(len(self)))
            return
        B, n = self.batch_size, len(self.order)
        for lo in range(self.batches.start, self.batches.stop, ITER_BATCHES):
            hi = min(lo + ITER_BATCHES, self.batches.stop)
            rows = self._rows(lo * B, min(hi * B, n))
            yield from (rows[k * B : (k + 1) * B] for k in range(hi - lo))

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)


def collate_windows(stream: Stream, item: np.ndarray, block_size: int) -> Batch:
    """The batch of a planned (B, 2) array: its blocks of ``block_size + 1`` ids read from ``stream``."""
    blocks = torch.from_numpy(stream.windows(item[:, 1], block_size + 1))  # (B, L + 1)
    return lm_batch(blocks, item[:, 0].tolist())


class WindowBatches(Sequence):
    """Batches of a :class:`BlockPlan` read when asked (validation of a long stream holds no ids in memory);
    a slice is another such sequence (each process evaluates every world-th batch)."""

    def __init__(self, stream: Stream, plan: BlockPlan, block_size: int) -> None:
        self.stream, self.plan, self.block_size = stream, plan, block_size

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return WindowBatches(self.stream, self.plan[i], self.block_size)
        return collate_windows(self.stream, self.plan[i], self.block_size)


@dataclass
class LMData:
    """A language model's training data: the store's train and valid streams cut into blocks of ``block_size + 1``
    ids (consecutive blocks share one boundary token), ``batch_size`` blocks a batch; each epoch at a new offset
    and in a new order (:func:`lm_block_order`), validation on fixed blocks from the start of
    the held-out stream. The batches of cutting the stream in memory (tests/test_lm_store.py); nothing of the
    stream in memory, and a pickle of file names."""

    train: Stream
    valid: Stream
    block_size: int
    batch_size: int
    seed: int

    def __post_init__(self) -> None:
        L = self.block_size
        if len(self.train) <= L + 1:
            raise DataError(f"the training text has {len(self.train)} tokens, fewer than one block of {L + 1}")
        if (len(self.valid) - 1) // L < 1:
            raise DataError(f"the validation text has {len(self.valid)} tokens, fewer than one block of {L + 1}")

    def epoch_plan(self, epoch: int) -> BlockPlan:
        """The epoch's batches as (B, 2) arrays of block places and starts (:class:`BlockPlan`)."""
        offset, order = lm_block_order(len(self.train), self.block_size, self.seed, epoch)
        return BlockPlan(offset, order, self.block_size, self.batch_size)

    def plan_tokens(self, item: np.ndarray) -> int:
        """The target tokens of a planned batch: every position of every block (no block holds padding)."""
        return len(item) * self.block_size

    def collate_plan(self, item: np.ndarray) -> Batch:
        return collate_windows(self.train, item, self.block_size)

    @property
    def valid_batches(self) -> WindowBatches:
        """Fixed, non-overlapping blocks from the start of the held-out stream: every validation token after the
        first is predicted once. Read when iterated."""
        offset, order = lm_block_order(len(self.valid), self.block_size, shuffle=False)
        return WindowBatches(self.valid, BlockPlan(offset, order, self.block_size, self.batch_size), self.block_size)
