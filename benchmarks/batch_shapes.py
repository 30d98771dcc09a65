"""How many distinct batch shapes, and how much padding, each bounded-shape setting gives (no model runs).

Every new (B, S, T) shape costs a GPU something: a re-plan (cuDNN attention), a recompile
(torch.compile with static shapes) or a new CUDA graph; padding costs compute. For a length distribution
and a token budget this prints, for no extra padding, ``data.pad_to_multiple`` and ``data.length_buckets``:
the number of batches of an epoch, of distinct (B, S, T) shapes and of distinct (S, T) length pairs, and
the share of real tokens in the padded tensors (source + target).

    python -m benchmarks.batch_shapes --lengths multi30k wmt --max-tokens 4096 25000
    python -m benchmarks.batch_shapes --run-dir runs/multi30k_en_de_quick --max-tokens 4096
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from aiayn.data.batching import batch_shape, token_batches
from benchmarks import common

SETTINGS: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("no extra padding", 1, ()),
    ("pad_to_multiple 8", 8, ()),
    ("length_buckets 16 24 32 48 64 96 128 (+ multiple 8)", 8, (16, 24, 32, 48, 64, 96, 128)),
)


def shape_stats(src_lens: Sequence[int], tgt_lens: Sequence[int], max_tokens: int, pad_to_multiple: int,
                buckets: Sequence[int], seed: int = 1) -> dict[str, Any]:
    """Batches of one epoch as aiayn training makes them (lengths without EOS / BOS) and their shapes."""
    groups = token_batches(src_lens, tgt_lens, max_tokens, seed=seed, pad_to_multiple=pad_to_multiple,
                           buckets=buckets)
    shapes, real, padded = set(), 0, 0
    for g in groups:
        src, tgt = [src_lens[i] + 1 for i in g], [tgt_lens[i] + 1 for i in g]
        rows, S, T = batch_shape(src, tgt, max_tokens, pad_to_multiple, buckets)
        shapes.add((rows or len(g), S, T))
        real += sum(src) + sum(tgt)
        padded += (rows or len(g)) * (S + T)
    return {"batches": len(groups), "shapes": len(shapes), "length_pairs": len({(s, t) for _, s, t in shapes}),
            "real_fraction": real / padded}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.batch_shapes", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", nargs="+", default=["multi30k", "wmt"], choices=list(common.LENGTH_DISTRIBUTIONS))
    p.add_argument("--run-dir", help="Multi30k train tokenized with this run's tokenizer instead of --lengths")
    p.add_argument("--pairs", type=int, default=29000, help="synthetic pairs (an epoch)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[4096, 25000])
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.run_dir:
        pairs = common.multi30k_token_pairs(args.run_dir, "train")
        sources = {"Multi30k (tokenized)": ([len(s) for s, _ in pairs], [len(t) for _, t in pairs])}
    else:
        sources = {}
        for name in args.lengths:
            lengths = common.synthetic_lengths(args.pairs, args.seed, name)
            sources[name] = ([s for s, _ in lengths], [t for _, t in lengths])
    rows = []
    headers = ["lengths", "max tokens", "setting", "batches", "(B, S, T) shapes", "(S, T) pairs", "real tokens"]
    for name, (src, tgt) in sources.items():
        for budget in args.max_tokens:
            for label, multiple, buckets in SETTINGS:
                st = shape_stats(src, tgt, budget, multiple, buckets, args.seed)
                rows.append({"lengths": name, "max_tokens": budget, "setting": label, **st})
    print(common.markdown_table(headers, [[r["lengths"], r["max_tokens"], r["setting"], r["batches"], r["shapes"],
                                           r["length_pairs"], f"{100 * r['real_fraction']:.1f}%"] for r in rows]))
    return rows


if __name__ == "__main__":
    main()
