"""How close Argos Translate running an ``aiayn export argos`` package comes to ``aiayn translate``, on a real test
set: identical lines, BLEU and chrF of each, and the time each takes.

    python -m benchmarks.argos_agreement RUN [--split test_2016_flickr] [--limit N] [--out-json F]

The package is exported (fp32) into a temporary directory and installed by the real ``argostranslate`` in a fresh
process whose Argos directories are empty and where every network connection is refused; it translates each
source line as LibreTranslate would (``translate.translate(q, src, tgt)``: its sentence splitter, then beam 4,
CTranslate2's length penalty 0.2), once with ``ARGOS_COMPUTE_TYPE=float32`` and once with Argos' default
("auto": CTranslate2 quantizes the float32 weights to int8 as it loads them, on most CPUs). aiayn decodes the
same lines with Argos' search (``aiayn.interop.argos.ARGOS_SEARCH``: beam 4, power length penalty 0.2, done once
4 hypotheses have ended, no EOS first, up to 256 tokens) and with the run's own. Where they may still differ:
CTranslate2 replaces <unk> by a source token (``replace_unknowns``), Argos turns "_" into spaces and splits
multi-sentence lines, and two hypotheses whose scores tie may come in either order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Runs argostranslate as a user would, in a fresh process whose Argos directories are empty and where no
# connection can be opened: installs the package file, then translates each line of stdin (a JSON list).
CLIENT = r"""
import json, socket, sys, time
def refuse(*args, **kwargs):
    raise OSError("offline: no network")
socket.socket.connect = refuse
socket.create_connection = refuse
from argostranslate import package, translate
package.install_from_path(sys.argv[1])
langs = sorted(l.code for l in translate.get_installed_languages())
src, tgt = sys.argv[2], sys.argv[3]
lines = json.loads(sys.stdin.read())
start = time.perf_counter()
out = [translate.translate(q, src, tgt) for q in lines]
print(json.dumps({"installed": langs, "out": out, "seconds": time.perf_counter() - start}))
"""


def argos_translate(package_file: Path, lines: Sequence[str], home: Path, src: str, tgt: str,
                    threads: int = 1, compute_type: str | None = None) -> dict[str, Any]:
    """``{"installed": [codes], "out": [translations], "seconds": s}`` from argostranslate in a fresh, offline
    process whose Argos data, cache and config live under ``home``. ``compute_type``: ARGOS_COMPUTE_TYPE (None:
    Argos' default, "auto", which CTranslate2 turns into int8 on most CPUs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARGOS_", "XDG_"))}
    env.update(HOME=str(home), XDG_DATA_HOME=str(home / "data"), XDG_CACHE_HOME=str(home / "cache"),
               XDG_CONFIG_HOME=str(home / "config"), ARGOS_DEVICE_TYPE="cpu", ARGOS_INTRA_THREADS=str(threads),
               OMP_NUM_THREADS=str(threads))
    if compute_type is not None:
        env["ARGOS_COMPUTE_TYPE"] = compute_type
    r = subprocess.run([sys.executable, "-c", CLIENT, str(package_file), src, tgt], input=json.dumps(list(lines)),
                       capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"argostranslate failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The table of decoders on stdout: lines identical to Argos' fp32, BLEU, chrF, seconds."""
    print(f"{'decoder':52} {'identical to Argos fp32':>23} {'BLEU':>6} {'chrF':>6} {'seconds':>8}")
    for r in rows:
        print(f"{r['decoder']:52} {r['identical_to_argos']:>17}/{r['lines']:<5} {r['bleu']:6.2f} {r['chrf']:6.2f} "
              f"{r['seconds']:8.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.argos_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a translation run directory (shared SentencePiece vocabulary)")
    p.add_argument("--split", default="test_2016_flickr", help="a split of the run's dataset (default: Multi30k test)")
    p.add_argument("--limit", type=int, default=None, help="the first N lines only")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each side (default 1)")
    p.add_argument("--out-json", default=None)
    args = p.parse_args(argv)

    import torch

    from aiayn import load
    from aiayn.config import load_config
    from aiayn.eval.evaluate import split_pairs
    from aiayn.eval.scorers import sacrebleu_scores
    from aiayn.interop.argos import ARGOS_SEARCH, export_argos
    from benchmarks.common import command_line, utc_now, write_json

    torch.set_num_threads(args.threads)
    cfg = load_config(Path(args.run) / "config.yaml")
    pairs = split_pairs(cfg, args.split)[: args.limit]
    sources, refs = [s for s, _ in pairs], [r for _, r in pairs]
    translator = load(args.run, "cpu")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        package = export_argos(args.run, Path(d) / "model.argosmodel")
        for name, compute in (("argos, ARGOS_COMPUTE_TYPE=float32", "float32"), ("argos, its default (auto)", None)):
            got = argos_translate(package, sources, Path(d) / name.split()[-1], cfg.data.src_lang, cfg.data.tgt_lang,
                                  args.threads, compute)
            results[name] = {"out": got["out"], "seconds": got["seconds"]}
    # What aiayn documented as Argos' search before ARGOS_SEARCH (2026-11-27): Hugging Face's default stop and the
    # run's length limits; and ARGOS_SEARCH with that stop alone changed. Rows to show what each part changes.
    before = dict(beam=ARGOS_SEARCH["beam"], alpha=ARGOS_SEARCH["alpha"], length_penalty="power", stop="hf")
    for name, opts in (("aiayn, Argos' settings", ARGOS_SEARCH),
                       ("aiayn, Argos' settings but --stop hf", {**ARGOS_SEARCH, "stop": "hf"}),
                       ("aiayn, the flags before (--stop hf, run's lengths)", before),
                       ("aiayn, the run's settings", {})):
        start = time.perf_counter()
        out = translator.translate(sources, **opts)
        results[name] = {"out": out, "seconds": time.perf_counter() - start}
    argos = results["argos, ARGOS_COMPUTE_TYPE=float32"]["out"]
    rows = []
    for name, r in results.items():
        scores = sacrebleu_scores(r["out"], refs)
        same = sum(a == b for a, b in zip(r["out"], argos))
        rows.append({"decoder": name, "lines": len(sources), "identical_to_argos": same,
                     "bleu": round(scores["bleu"], 2), "chrf": round(scores["chrf"], 2),
                     "seconds": round(r["seconds"], 1)})
    print_rows(rows)
    differ = [(s, a, b) for s, a, b in zip(sources, argos, results["aiayn, Argos' settings"]["out"]) if a != b]
    for s, a, b in differ[:5]:
        print(json.dumps({"source": s, "argos": a, "aiayn": b}, ensure_ascii=False))
    if args.out_json:
        write_json(args.out_json, {"command": command_line("argos_agreement", argv or sys.argv[1:]),
                                   "date": utc_now(), "run": Path(args.run).name, "split": args.split,
                                   "rows": rows, "differences": [dict(zip(("source", "argos", "aiayn"), t))
                                                                 for t in differ[:20]]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
