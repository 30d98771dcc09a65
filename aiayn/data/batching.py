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
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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

    def __len__(self) -> int:
        return self.tgt_in.size(0)


def _rng(seed: int, epoch: int) -> random.Random:
    # A string seed is hashed with sha512 by `random`, so this is the same in every process
    # (unlike hash()), and different epochs give unrelated streams.
    return random.Random(f"aiayn:{seed}:{epoch}")


def token_batches(
    src_lens: Sequence[int],
    tgt_lens: Sequence[int] | None,
    max_tokens: int,
    seed: int = 1,
    epoch: int = 0,
    shuffle: bool = True,
) -> list[list[int]]:
    """Group example indices into batches of similar length under a token budget.

    ``src_lens`` / ``tgt_lens`` are token counts without specials (``tgt_lens=None`` for
    source-only batches, e.g. inference). A batch costs ``len(batch) * (max length + 1)``, the
    +1 being the EOS / BOS ``collate`` adds, and stays within ``max_tokens``, except that an
    example over the budget forms a batch of its own (it is never dropped here).

    Examples are sorted by length with a random tie-break, cut into batches, and the batch order
    is shuffled: deterministic for a given ``(seed, epoch)``, different across epochs. With
    ``shuffle=False`` ties keep index order and batches stay sorted (shortest first).
    Every index appears in exactly one batch.
    """
    n = len(src_lens)
    if tgt_lens is not None and len(tgt_lens) != n:
        raise ValueError(f"token_batches: {n} source lengths but {len(tgt_lens)} target lengths")
    if max_tokens <= 0:
        raise ValueError("token_batches: max_tokens must be positive")
    cost_len = [s + 1 for s in src_lens] if tgt_lens is None else [
        max(s, t) + 1 for s, t in zip(src_lens, tgt_lens)
    ]
    order = list(range(n))
    rng = _rng(seed, epoch)
    if shuffle:
        rng.shuffle(order)  # the tie-break: equal lengths come out in a seeded random order
    # Sort by the padded length, then by source length so that source padding is small too.
    order.sort(key=lambda i: (cost_len[i], src_lens[i]))

    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        new_max = max(cur_max, cost_len[i])
        if cur and (len(cur) + 1) * new_max > max_tokens:
            batches.append(cur)
            cur, new_max = [], cost_len[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    if shuffle:
        rng.shuffle(batches)
    return batches


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = PAD_ID) -> torch.Tensor:
    """Right-pad id lists into a (B, max_len) long tensor."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.long)
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
) -> Batch:
    """Build a :class:`Batch`: src = x + [EOS], tgt_in = [BOS] + y, tgt_out = y + [EOS], right-padded."""
    if not len(src_ids) == len(tgt_ids) == len(indices):
        raise ValueError("collate: src_ids, tgt_ids and indices must have the same length")
    src = pad_batch([list(s) + [eos_id] for s in src_ids], pad_id)  # (B, S)
    tgt_in = pad_batch([[bos_id] + list(t) for t in tgt_ids], pad_id)  # (B, T)
    tgt_out = pad_batch([list(t) + [eos_id] for t in tgt_ids], pad_id)  # (B, T)
    ntokens = int((tgt_out != pad_id).sum())
    return Batch(src, tgt_in, tgt_out, ntokens, list(indices))


def lm_blocks(
    ids: torch.Tensor, block_size: int, seed: int = 1, epoch: int = 0, shuffle: bool = True
) -> torch.Tensor:
    """Cut a token stream (N,) into contiguous blocks (n_blocks, L + 1), L = ``block_size``.

    Block k is ``ids[o + k*L : o + k*L + L + 1]``: input ``block[:-1]``, target ``block[1:]``,
    so consecutive blocks share one boundary token and every target token after ``o`` is
    predicted once. With ``shuffle``, the offset ``o`` is drawn in [0, L) per (seed, epoch), so
    block boundaries move between epochs (nanoGPT draws random windows instead; this way one
    epoch still covers the stream once), and the block order is shuffled. With ``shuffle=False``
    (evaluation), ``o = 0`` and blocks are in stream order.
    """
    if ids.dim() != 1:
        raise ValueError(f"lm_blocks: expected a 1-D token stream, got shape {tuple(ids.shape)}")
    n = ids.numel()
    if block_size <= 0:
        raise ValueError("lm_blocks: block_size must be positive")
    if n < block_size + 1:
        raise ValueError(f"lm_blocks: a stream of {n} tokens is shorter than one block of {block_size + 1}")
    rng = _rng(seed, epoch)
    offset = min(rng.randrange(block_size), n - block_size - 1) if shuffle else 0
    blocks = ids[offset:].unfold(0, block_size + 1, block_size)  # (n_blocks, L + 1), a view
    if shuffle:
        perm = torch.randperm(blocks.size(0), generator=torch.Generator().manual_seed(rng.getrandbits(63)))
        return blocks[perm].long()
    return blocks.clone().long()


def lm_batches(blocks: torch.Tensor, batch_size: int, pad_id: int = PAD_ID) -> list[Batch]:
    """Split blocks (n_blocks, L + 1) into batches of ``batch_size`` (the last may be smaller).

    ``tgt_in = block[:, :-1]`` and ``tgt_out = block[:, 1:]``, both (B, L); ``src`` is None;
    ``indices`` are the rows of ``blocks``.
    """
    if batch_size <= 0:
        raise ValueError("lm_batches: batch_size must be positive")
    out = []
    for start in range(0, blocks.size(0), batch_size):
        b = blocks[start : start + batch_size]
        tgt_out = b[:, 1:]
        out.append(
            Batch(None, b[:, :-1], tgt_out, int((tgt_out != pad_id).sum()), list(range(start, start + b.size(0))))
        )
    return out
