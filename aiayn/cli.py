"""``aiayn`` command line: a thin dispatcher, each subcommand calls one library function.

Bad input (missing file, bad config key, mismatched corpus, broken checkpoint) ends with one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from aiayn.errors import UserError

USER_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError, IsADirectoryError, PermissionError)


def cmd_train(args: argparse.Namespace) -> int:
    from aiayn.train.run import train_from_config

    train_from_config(args.config, run_dir=args.run_dir, overrides=args.set, resume=args.resume,
                      progress=not args.no_progress)
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from aiayn.train.run import average_run

    out = average_run(args.run, last=args.last)
    print(f"wrote {out}")
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    from aiayn.decode.translator import translate_cli

    return translate_cli(args)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from aiayn.eval.evaluate import evaluate_cli

    return evaluate_cli(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from aiayn.decode.generate import generate_cli

    return generate_cli(args)


def cmd_summarize(args: argparse.Namespace) -> int:
    from aiayn.decode.generate import summarize_cli

    return summarize_cli(args)


def cmd_report(args: argparse.Namespace) -> int:
    from aiayn.train.report import report_cli

    return report_cli(args)


def cmd_export(args: argparse.Namespace) -> int:
    from aiayn.interop.ctranslate2 import export_run

    out = export_run(args.run, args.out_dir, quantization=args.quantization)
    print(f"wrote {out}")
    return 0


def cmd_viz(args: argparse.Namespace) -> int:
    from aiayn.viz.cli import viz_cli

    return viz_cli(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from aiayn.demo import run_demo

    return run_demo(args)


def _decode_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beam", type=int, default=None, help="beam size (default: the run's config, paper: 4)")
    p.add_argument("--alpha", type=float, default=None, help="length penalty alpha (paper: 0.6)")
    p.add_argument("--length-penalty", choices=["gnmt", "power", "none"], default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="token budget of one decoding batch")
    p.add_argument("--no-repeat-ngram", type=int, default=None, metavar="N",
                   help="never repeat an n-gram of the output (default: the run's config, 0 = off)")
    p.add_argument("--device", default="cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a YAML recipe")
    p.add_argument("config", help="YAML recipe or preset name in configs/")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<config name>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.warmup=8000")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("translate", help="translate text, one sentence per line")
    p.add_argument("run")
    p.add_argument("--input", default=None, help="input file (default stdin)")
    p.add_argument("--output", default=None, help="output file (default stdout)")
    p.add_argument("--nbest", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object per line with scores and n-best")
    _decode_options(p)
    p.set_defaults(func=cmd_translate)

    p = sub.add_parser("evaluate", help="BLEU/chrF of a translation run, perplexity of a language model")
    p.add_argument("run")
    p.add_argument("--split", default=None, help="a split of the run's dataset, e.g. test_2016_flickr")
    p.add_argument("--src", default=None)
    p.add_argument("--ref", default=None)
    p.add_argument("--name", default=None, help="name of the eval/<name>.json file")
    _decode_options(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("average", help="average the last N checkpoints into model.safetensors")
    p.add_argument("run")
    p.add_argument("--last", type=int, default=5)
    p.set_defaults(func=cmd_average)

    p = sub.add_parser("report", help="what a run did: updates, time, tokens/s, valid NLL, its evaluations")
    p.add_argument("run", help="run directory, results/ copy of one, or a metrics.jsonl")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("generate", help="continue a prompt with a language model (streams tokens)")
    p.add_argument("run")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--slide", action="store_true", help="slide the context window past the model's positions")
    p.add_argument("--no-repeat-ngram", type=int, default=0, metavar="N",
                   help="never repeat an n-gram of the generated text (0 = off)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("summarize", help="summarize documents, one per line (or JSONL with --field)")
    p.add_argument("run")
    p.add_argument("--input", default=None)
    p.add_argument("--output", default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    _decode_options(p)
    p.set_defaults(func=cmd_summarize)

    p = sub.add_parser("export", help="export a run to a production engine")
    p.add_argument("engine", choices=["ctranslate2"])
    p.add_argument("run")
    p.add_argument("out_dir")
    p.add_argument("--quantization", default=None, help="e.g. int8 (CTranslate2)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("viz", help="figures: positional, attention, schedule, curves, mask")
    p.add_argument("what", choices=["positional", "attention", "schedule", "curves", "mask"])
    p.add_argument("run", nargs="?", default=None)
    p.add_argument("--out", default=None, help="PNG path")
    p.add_argument("--show", action="store_true")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--max-pos", type=int, default=128)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--compare", action="store_true")
    p.add_argument("--src", default=None)
    p.add_argument("--tgt", default=None)
    p.add_argument("--layer", type=int, default=None)
    p.add_argument("--head", type=int, default=None)
    p.add_argument("--len", type=int, default=8, dest="length")
    p.add_argument("--width", type=int, default=None, help="figure width in pixels")
    p.add_argument("--height", type=int, default=None, help="figure height in pixels")
    p.set_defaults(func=cmd_viz)

    p = sub.add_parser("demo", help="the main job: train the quick recipe, evaluate, show translations")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--config", default=None)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, OSError) and e.filename and e.strerror:
            msg = f"{e.filename}: {e.strerror}"  # "path: reason", not "[Errno 2] reason: 'path'"
        print(f"aiayn: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aiayn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
