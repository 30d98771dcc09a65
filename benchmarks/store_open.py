"""Opening a prepared store that has not changed: this tree against a baseline tree, in fresh processes, alternately.

    python -m benchmarks.store_open --baseline /tmp/aiayn-base [--pairs 1000000] [--opens 20] [--rounds 5]
                                    [--out-json F] [--smoke]

Every training process opens its store at every start (every rank, every restart), so what an opening costs when
nothing changed is what issue 58's checksums may not raise by more than 10%. This builds one synthetic pair store
with this tree (``--pairs`` pairs, lengths 5-60 ids per side, ids drawn below a char tokenizer's vocabulary; with a
sha256 per file in its manifest) and gives each tree a copy of its own; each tree opens its copy once (its memo of
the files found good is written then: an unchanged store is not read again). Then, for ``--rounds`` rounds, each
tree in turn opens its copy ``--opens`` times in a fresh process (``open_store(DIR, ("train", "valid"))``, the
training's call); the median seconds of an opening per round and tree, and the ratio of the medians of the rounds
(this tree / baseline). ``--baseline``: a checkout of aiayn (``git archive REF aiayn | tar -x -C DIR`` makes one).
``--smoke``: 2,000 pairs, 2 opens, 1 round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
OPEN = """
import json, sys, time
from pathlib import Path
from aiayn.data.store import open_store
path, n = Path(sys.argv[1]), int(sys.argv[2])
times = []
for _ in range(n):
    start = time.perf_counter()
    store = open_store(path, ("train", "valid"))
    times.append(time.perf_counter() - start)
    del store
print(json.dumps(times))
"""


def build_store(out: Path, pairs: int, seed: int = 0) -> dict[str, Any]:
    """A pair store of ``pairs`` training and 1,000 validation pairs of random ids, prepared by this tree."""
    import numpy as np

    from aiayn.config import load_config
    from aiayn.data.store import PAIRS, STORE_VERSION, open_kind, prepare_store, storage_dtype
    from aiayn.data.tokenizer import TokenizerPair, train_tokenizer_pair

    class Synthetic:
        key, inputs = f"synthetic-{pairs}-{seed}", {"synthetic": str(pairs)}

        def manifest_settings(self) -> dict[str, Any]:
            return {}

        def open(self, path: Path) -> Any:  # under the lock prepare_store holds
            return open_kind(path, PAIRS, ("train", "valid"))

        def build_into(self, stage: Path) -> dict[str, Any]:
            train_tokenizer_pair(["".join(map(chr, range(33, 33 + 200)))], [], stage / "tokenizer", kind="char")
            vocab = TokenizerPair.load(stage / "tokenizer").src.vocab_size
            dtype, rng, splits = storage_dtype(vocab), np.random.default_rng(seed), {}
            for name, n in (("train", pairs), ("valid", 1000)):
                info: dict[str, Any] = {"pairs": n, "stats": {"empty": 0, "too_long": 0, "kept": n}}
                for side in ("src", "tgt"):
                    lens = rng.integers(5, 61, n)
                    offsets = np.zeros(n + 1, dtype="<i8")
                    np.cumsum(lens, out=offsets[1:])
                    rng.integers(4, vocab, int(offsets[-1])).astype(dtype.newbyteorder("<")).tofile(
                        stage / f"{name}.{side}.bin")
                    offsets.tofile(stage / f"{name}.{side}.idx")
                    info[f"{side}_tokens"] = int(offsets[-1])
                splits[name] = info
            return {"version": STORE_VERSION, "key": self.key, "kind": PAIRS, "created": "synthetic",
                    "settings": load_config("tiny_reverse").to_dict()["data"], "inputs": self.inputs,
                    "dtype": dtype.name, "vocab_size": vocab, "src_vocab_size": vocab, "tgt_vocab_size": vocab,
                    "splits": splits}

    store = prepare_store(out, Synthetic())
    return {"pairs": pairs, "store_mb": round(sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20,
                                              1), "files": len(store.manifest.get("files", {}))}


def open_times(tree: Path, store: Path, opens: int) -> list[float]:
    """Seconds of each of ``opens`` openings of ``store`` by the code of ``tree``, in one fresh process."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", OPEN, str(store), str(opens)], env=env, capture_output=True,
                         text=True, check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _describe(tree: Path) -> str:
    try:
        rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = ""
    return f"{tree}{f' ({rev})' if rev else ''}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store_open", description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, help="a checkout of the aiayn to compare with")
    p.add_argument("--pairs", type=int, default=1_000_000)
    p.add_argument("--opens", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out-json")
    p.add_argument("--smoke", action="store_true", help="2,000 pairs, 2 opens, 1 round: does it run?")
    args = p.parse_args(argv)
    pairs, opens, rounds = (2000, 2, 1) if args.smoke else (args.pairs, args.opens, args.rounds)
    baseline = Path(args.baseline).resolve()
    if not (baseline / "aiayn" / "__init__.py").is_file():
        p.error(f"--baseline {baseline}: not a checkout of aiayn (no aiayn/__init__.py)")
    trees = {"baseline": baseline, "this tree": HERE}
    with tempfile.TemporaryDirectory() as tmp:
        built = build_store(Path(tmp) / "built", pairs)
        copies = {}
        for name, tree in trees.items():  # a copy each: each tree keeps its own memo of the files found good
            copies[name] = Path(tmp) / name.replace(" ", "_")
            shutil.copytree(Path(tmp) / "built", copies[name])
            open_times(tree, copies[name], 1)  # the first opening: every file read and checked, the memo written
        medians: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(rounds):
            for name, tree in trees.items():
                medians[name].append(statistics.median(open_times(tree, copies[name], opens)))
    med = {name: statistics.median(v) for name, v in medians.items()}
    ratio = med["this tree"] / med["baseline"]
    result = {"command": "python -m benchmarks.store_open " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cpus": os.cpu_count(), "store": built, "opens_per_round": opens,
              "baseline": _describe(baseline), "this_tree": _describe(HERE),
              "median_open_s_by_round": medians, "median_open_s": med, "ratio": ratio}
    print(json.dumps(result, indent=1))
    print(f"an unchanged store of {pairs:,} pairs ({built['store_mb']} MB) opened in {med['this tree'] * 1e3:.2f} ms "
          f"(this tree) against {med['baseline'] * 1e3:.2f} ms (baseline): ratio {ratio:.3f}")
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
