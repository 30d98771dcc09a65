"""A synthetic translation task for tests and smoke runs: reverse a sequence of words.

Deterministic for a seed; needs no download. The source vocabulary is a fixed list of short words,
so a tiny model can learn it in a minute on a CPU.
"""

from __future__ import annotations

import random

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def reverse_pairs(n: int, seed: int = 0, min_len: int = 3, max_len: int = 8) -> list[tuple[str, str]]:
    """``n`` pairs (words, the same words reversed), lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_len, max_len))]
        pairs.append((" ".join(words), " ".join(reversed(words))))
    return pairs


SPLITS = {"train": (20000, 1), "valid": (300, 2), "val": (300, 2), "test": (300, 3)}


def reverse_split(split: str) -> list[tuple[str, str]]:
    """The fixed splits of the ``reverse`` dataset: train (20,000), valid/val (300), test (300)."""
    from aiayn.data.corpus import DataError

    if split not in SPLITS:
        raise DataError(f"reverse: no split {split!r} (splits: {', '.join(SPLITS)})")
    n, seed = SPLITS[split]
    return reverse_pairs(n, seed)
