"""``aiayn`` command line: a thin dispatcher, each subcommand calls one library function.

Bad input (missing file, bad config key, mismatched corpus, broken checkpoint, unavailable device) ends
with one line on stderr and exit status 2, checked before any work starts where it can be. Nothing heavy
is imported until a subcommand runs, so ``aiayn --help`` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from aiayn import __version__
from aiayn.errors import ConfigError, is_refusal, one_line, said_here, user_error_message
from aiayn.launched import reattach_stderr, record_error, said_by_launcher, say_when_torchrun_stops_this


def decode_overrides(args: argparse.Namespace) -> dict:
    """The decoding options given on the command line (None = the run's value), by DecodeOptions field name."""
    from aiayn.config import DecodeOptions

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(DecodeOptions)
            if getattr(args, f.name, None) is not None}


def _write_stdout(text: str) -> None:
    """UTF-8 whatever the locale says, flushed at once (streaming)."""
    if hasattr(sys.stdout, "buffer"):
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


RUN_HELP = "run directory (from aiayn train or aiayn import hf)"


THREADS_HELP = "CPU threads (default: the cores not busy with other work; 1 is faster on a busy machine)"


def add_device_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA, else MPS, else CPU) | cpu | cuda | cuda:N | mps")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "tf32", "bf16", "fp16", "int8"],
                   help="auto: bf16 on a CPU whose native bf16 passed aiayn's probe and measured faster, else fp32; "
                        "tf32 = fp32 with TF32 matmuls, fp16: CUDA only; bf16: CUDA, or a CPU with native bf16 (its "
                        "linear layers); int8: int8 linear layers, CPU only")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)


# Commands that train pass --threads on as train.threads (a resume keeps the count its checkpoints used).
TRAINING_COMMANDS = ("train", "table3", "sweep", "launch")


def _set_threads(args: argparse.Namespace) -> None:
    """Every command's ``--threads``, checked the same way (1 to 4,096) before any work; the CPU threads of the
    other commands set now (training chooses its own: train.threads)."""
    if not hasattr(args, "threads"):
        return
    from aiayn.engine import check_threads, cpu_threads, set_cpu_threads

    if args.threads is not None:
        check_threads(args.threads)
    if args.command not in TRAINING_COMMANDS:
        set_cpu_threads(cpu_threads(args.threads))


def add_decode_options(p: argparse.ArgumentParser, search: bool = True) -> None:
    """The --flags of DecodeOptions, built from its fields and their flags in :data:`aiayn.cli_flags.DECODE_FLAGS`
    (default None: the run's ``decode`` section; ``search`` False: only those of commands that do not search, e.g.
    generate), and the device options."""
    from aiayn.cli_flags import DECODE_FLAGS
    from aiayn.config import DecodeOptions

    for f in dataclasses.fields(DecodeOptions):
        meta = DECODE_FLAGS.get(f.name)
        if meta is None or (meta.search and not search):
            continue
        kind = str(f.type).replace(" | None", "")
        name = "--" + f.name.replace("_", "-")
        if kind == "bool":
            p.add_argument(name, action="store_true", default=None, help=meta.help)
        else:
            p.add_argument(name, type={"int": int, "float": float, "str": str}[kind], choices=meta.choices,
                           metavar=meta.metavar, help=meta.help)
    add_device_options(p)


def add_output(p: argparse.ArgumentParser, *names: str, kind: str, **kw) -> argparse.Action:
    """An argument naming what the command writes, tagged with the ``kind`` it writes (``output_kind``: a kind of
    :data:`aiayn.files.KINDS`, ``dir`` or ``record``, an eval record's name): each command puts it through the
    output guard (:func:`aiayn.files.guard_output`, :func:`aiayn.files.guard_output_dir`) before any work, and
    the tests walk the tagged arguments."""
    action = p.add_argument(*names, **kw)
    action.output_kind = kind  # type: ignore[attr-defined]
    return action


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose usage errors (``--threads abc``, a missing argument) are one line ``aiayn: error: ...`` and
    exit 2 as every other bad input, not a usage block; ``--help`` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"aiayn: error: {one_line(message)}{self.suggestion(message)} ({self.prog} --help lists the "
                     "options)\n")

    def suggestion(self, message: str) -> str:
        """"did you mean" for a mistyped command (``invalid choice: 'trian'``) or flag (``unrecognized arguments:
        --beem``), from the commands and flags this parser knows."""
        from aiayn.errors import did_you_mean

        choice = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            return did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        flags = [w for w in message.removeprefix("unrecognized arguments:").split() if w.startswith("--")]
        if message.startswith("unrecognized arguments:") and flags:
            parser: argparse.ArgumentParser = self  # the command's own parser, whose flags these were meant as
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    named = [w for w in getattr(self, "argv", []) if w in action.choices]
                    parser = action.choices[named[0]] if named else self
            known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            return did_you_mean(flags[0].split("=", 1)[0], known)
        return ""

    def parse_known_args(self, args=None, namespace=None):
        self.argv = list(sys.argv[1:] if args is None else args)  # for suggestion(): which command was named
        return super().parse_known_args(args, namespace)


FIRST_STEPS = """\
The Transformer of "Attention Is All You Need": train, translate, evaluate, serve, export.

first steps:
  aiayn import hf Helsinki-NLP/opus-mt-en-de runs/opus   a pretrained model (the hf extra), or
  aiayn train multi30k_en_de_quick --run-dir runs/m30k   train one (at most 30 minutes)
  echo "A dog runs." | aiayn translate runs/m30k         translate; then evaluate, serve, viz
  aiayn presets                                          the recipes aiayn train knows by name
  aiayn COMMAND --help                                   each command's options"""


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a YAML recipe (or continue a run: --resume RUN)")
    p.add_argument("config", nargs="?", help="YAML recipe, or a preset name (paper-base, multi30k_en_de_quick, ...)")
    add_output(p, "--run-dir", kind="dir", default=None, help="run directory (default runs/<config name>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.warmup=8000")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN",
                   help="continue from the run's last checkpoint; --resume RUN alone uses RUN's own config "
                        "(a --set then may change only when it stops, what it logs, where it runs)")
    p.add_argument("--init-from", default=None, metavar="RUN",
                   help="fine-tune RUN: its weights, tokenizer and model section; the rest from CONFIG")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP + " (= --set train.threads=N)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="open a token store that has no checksums (prepared by an older aiayn, or stripped) as it "
                        "is: its shape and ids checked, its contents unverified")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (plain lines: loss, speed, ETA)")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from aiayn.train.run import resume_run, train_from_config

    if args.threads is not None:
        args.set = [*args.set, f"train.threads={args.threads}"]
    say_when_torchrun_stops_this()
    if args.allow_unverified:
        from aiayn.data.integrity import allow_unverified

        allow_unverified()
    if isinstance(args.resume, str):  # --resume RUN: the run's own config
        if args.config is not None or args.init_from is not None:
            raise ConfigError("--resume RUN takes the run's own config: give no CONFIG and no --init-from "
                              "(or resume a recipe's run: aiayn train CONFIG --run-dir RUN --resume)")
        if args.run_dir is not None and Path(args.run_dir) != Path(args.resume):
            raise ConfigError(f"--resume {args.resume} and --run-dir {args.run_dir} name two directories")
        resume_run(args.resume, args.set, progress=not args.no_progress)
        return 0
    if args.config is None:
        raise ConfigError("aiayn train needs a CONFIG (a YAML recipe or a preset), or --resume RUN")
    train_from_config(args.config, run_dir=args.run_dir, overrides=args.set, resume=bool(args.resume),
                      progress=not args.no_progress, init_from=args.init_from)
    return 0


def _add_presets(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list the recipes (presets) aiayn train takes by name, one line each")
    p.set_defaults(func=cmd_presets)


def cmd_presets(args: argparse.Namespace) -> int:
    from aiayn.config import list_presets

    presets = list_presets()
    width = max(len(name) for name, _ in presets)
    for name, line in presets:
        print(f"{name:<{width}}  {line}")
    print("train one: aiayn train NAME --run-dir runs/NAME (the YAML files: aiayn/configs/)")
    return 0


def _add_translate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("translate", help="translate text, one sentence per line (streams)",
                       description="Reads one sentence per line (--input or stdin; interactive on a terminal), "
                                   "writes one record per line (--output or stdout), chunk by chunk.")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--input", default=None, help="input file (default stdin)")
    add_output(p, "--output", kind="text", default=None,
               help="output file, written atomically (default stdout, streamed)")
    p.add_argument("--format", choices=["text", "tsv", "json"], default="text",
                   help="text: best line (nbest N: N lines per input); tsv: line, rank, score, logprob, text; "
                        "json: one object per input line")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.add_argument("--chunk", type=int, default=None, metavar="LINES",
                   help="lines read, translated and written at a time (default 2000; 1 on a terminal)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr for an --input file: a bar on a terminal, plain lines otherwise "
                        "(default: when stderr is a terminal)")
    p.add_argument("--split-sentences", action="store_true",
                   help="translate each line sentence by sentence, with the splitter an Argos package of the run "
                        "ships, and join them as Argos Translate (and LibreTranslate) do")
    add_decode_options(p)
    p.set_defaults(func=cmd_translate)


def cmd_translate(args: argparse.Namespace) -> int:
    """Validate the run, the options and the files, then stream: read, translate and write chunk by chunk."""
    from aiayn.data.corpus import check_file, stdin_stream
    from aiayn.decode.open_run import open_run
    from aiayn.decode.stream import iter_lines, translate_stream
    from aiayn.files import atomic_write, guard_output

    fmt = "json" if args.json else args.format
    if args.chunk is not None and args.chunk < 1:
        raise ConfigError(f"--chunk must be >= 1, got {args.chunk}")
    from_stdin = args.input in (None, "-")
    if not from_stdin:  # a file, or a pipe (--input <(zcat corpus.gz)), a device, /dev/stdin
        check_file(args.input)
    if args.output not in (None, "-"):
        guard_output(args.output, "text", [args.run, *([] if from_stdin else [args.input])], "--output")
    translator = open_run(args.run, args.device, args.precision, translator_only=True)  # before any input
    opts = translator.options(**decode_overrides(args))
    if args.split_sentences:
        from aiayn.interop.paragraphs import SentenceTranslator

        translator = SentenceTranslator(translator)
    source = stdin_stream() if from_stdin else open(args.input, "rb")  # noqa: SIM115 - closed below
    interactive = from_stdin and sys.stdin.isatty()
    chunk = args.chunk or (1 if interactive else 2000)
    if interactive:
        print("aiayn translate: type a sentence and press Enter (Ctrl-D to end)", file=sys.stderr)
    bar = _progress(args, args.input)
    try:
        lines = iter_lines(source, "<stdin>" if from_stdin else args.input)
        on_chunk = bar.update if bar is not None else None
        if args.output in (None, "-"):
            translate_stream(translator, lines, _write_stdout, opts, fmt, chunk, on_chunk)
        else:  # streamed into a temporary file, renamed over --output only once everything is written
            def write(tmp: str) -> None:
                with open(tmp, "w", encoding="utf-8") as out:  # hidden until renamed: no flush per chunk
                    translate_stream(translator, lines, out.write, opts, fmt, chunk, on_chunk)

            atomic_write(args.output, write)
    finally:
        if bar is not None:
            bar.close()
        if not from_stdin:
            source.close()
    return 0


def _progress(args: argparse.Namespace, path: str | None):
    """Progress over the input file's lines on stderr (a terminal, or --progress: then plain lines when stderr
    is not a terminal), else None."""
    if path in (None, "-") or not (args.progress or (args.progress is None and sys.stderr.isatty())):
        return None
    from aiayn.progress import ItemProgress

    total = None  # a pipe or a device: counted as it comes (reading it ahead would consume it)
    if Path(path).is_file():
        with open(path, "rb") as f:
            total = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    return ItemProgress(total, "line", "translate")


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="BLEU/chrF of a translation run, ROUGE of summaries, perplexity of an LM")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--split", default=None, help="a split of the run's dataset, e.g. test_2016_flickr")
    p.add_argument("--src", default=None, help="a source file, one sentence per line (with --ref, instead of --split)")
    p.add_argument("--ref", default=None, help="its reference translations, one per line of --src")
    add_output(p, "--name", kind="record", default=None, help="name of the eval/<name>.json file")
    p.add_argument("--weights", nargs="+", default=None, metavar="WHICH",
                   help="score other weights of the run, read only: last (the newest checkpoint), best, average (of "
                        "the last train.average_last checkpoints, in memory), step N, or a .safetensors file "
                        "(default: model.safetensors); the record is then eval/<split>.<which>.json")
    p.add_argument("--max-new-tokens", type=int, default=None, help="summaries: at most this many tokens (64)")
    p.add_argument("--rolling", action="store_true",
                   help="language models: the validation text (or --src FILE, one document) in lm-evaluation-harness's "
                        "rolling windows, the first after <s>, as its perplexity tasks score it through aiayn serve")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="with --rolling: lm-evaluation-harness's max_length (default: the run's context)")
    add_decode_options(p)
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from aiayn.eval.evaluate import EvalData, evaluate_run, summary

    data = EvalData(args.split, args.src, args.ref, args.name, args.rolling, args.max_length,
                    weights_choice(args.weights))
    result = evaluate_run(args.run, data, device=args.device,
                          precision=args.precision, **decode_overrides(args))
    print(summary(result))
    return 0


def weights_choice(words: list[str] | None) -> str:
    """``--weights``' words as :func:`aiayn.run.weights.select_weights` names them: ``model`` (none given), ``last``,
    ``best``, ``average``, ``step N`` (``step:N``), or a .safetensors file."""
    if not words:
        return "model"
    if words[0] == "step":
        if len(words) != 2 or not words[1].isdigit():
            raise ConfigError(f"--weights {' '.join(words)}: expected step N, the step of one of the run's checkpoints")
        return f"step:{int(words[1])}"
    if len(words) != 1:
        raise ConfigError(f"--weights {' '.join(words)}: expected last, best, average, model, step N or a "
                          ".safetensors file")
    return words[0]


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize a corpus once into a token store, ahead of training",
                       description="Trains the tokenizer on a sample and encodes the train and valid data into DIR "
                                   "(flat token-id files + offsets, read by position); train from it with --set "
                                   "data.prepared=DIR. Optional: a training without data.prepared prepares its "
                                   "store itself in $AIAYN_CACHE_DIR/stores. Safe to run several at once on one DIR "
                                   "(one builds, under a lock); a damaged store is rebuilt. --verify DIR reads "
                                   "every file of a store and checks it against the checksums written when it was "
                                   "prepared: one line per problem and exit 2, or exit 0 when it is sound.")
    p.add_argument("config", nargs="?", help="YAML recipe, or a preset name")
    add_output(p, "--out", kind="dir", metavar="DIR",
               help="the store's directory (new, empty, or a store: reused when its inputs and settings match "
                   "and its files check out, else rebuilt)")
    p.add_argument("--verify", metavar="DIR", help="check the store DIR (no CONFIG): every file against its "
                   "checksum, and its shape and ids")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override, e.g. data.vocab_size=32000")
    p.add_argument("--allow-unverified", action="store_true",
                   help="open a token store that has no checksums (prepared by an older aiayn, or stripped) as it "
                        "is: its shape and ids checked, its contents unverified")
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: every usable core "
                   "for a corpus of 32 MB or more, else 1)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from aiayn.config import load_config
    from aiayn.data.pipeline import check_data_sources, prepare_corpus
    from aiayn.data.store import describe_store
    from aiayn.files import guard_output_dir

    if args.allow_unverified:
        from aiayn.data.integrity import allow_unverified

        allow_unverified()
    if args.verify is not None:
        return _verify_store(args)
    if args.config is None or args.out is None:
        raise ConfigError("aiayn prepare needs a CONFIG and --out DIR (or --verify DIR to check a store)")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    guard_output_dir(args.out, [args.config] if Path(args.config).exists() else [], "--out")
    cfg = load_config(args.config, args.set)
    check_data_sources(cfg)
    store = prepare_corpus(cfg, args.out, workers=args.workers)
    for line in describe_store(store.manifest):
        print(line)
    sets = "".join(f" --set {x}" for x in args.set)
    print(f"train from it: aiayn train {args.config}{sets} --set data.prepared={args.out}")
    return 0


def _verify_store(args: argparse.Namespace) -> int:
    """``aiayn prepare --verify DIR``: one line per problem on stderr and exit 2, or one line on stdout and 0."""
    from aiayn.data.pipeline import verify_store

    if args.config is not None or args.out is not None or args.set:
        raise ConfigError("--verify DIR checks the store DIR as it is: give no CONFIG, --out or --set")
    problems = verify_store(args.verify)
    for problem in problems:
        print(f"aiayn: error: {one_line(problem)}", file=sys.stderr)
    if problems:
        return 2
    from aiayn.data.store import read_manifest

    manifest = read_manifest(Path(args.verify)) or {}
    print(f"{args.verify}: sound (every file read and checked)" if "files" in manifest else
          f"{args.verify}: its shape and ids are sound; prepared without checksums (by an older aiayn), its contents "
          "are unverified")
    return 0


def _add_average(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("average", help="average the last N checkpoints into RUN/average.safetensors (--replace: "
                                       "into model.safetensors)",
                       description="Writes the element-wise mean of the last N checkpoints beside the run's "
                                   "model.safetensors (RUN/average.safetensors, or --out FILE), which it leaves as "
                                   "it is unless --replace. Compare before replacing: aiayn evaluate RUN --split S "
                                   "--weights average (or --weights FILE).")
    p.add_argument("run", help="run directory with checkpoints (checkpoints/step_*.safetensors)")
    p.add_argument("--last", type=int, default=5, metavar="N", help="how many of the latest checkpoints (default 5)")
    add_output(p, "--out", kind="weights", default=None, metavar="FILE",
               help="where to write the average (default RUN/average.safetensors)")
    p.add_argument("--replace", action="store_true", help="write it as RUN/model.safetensors, the weights "
                                                          "translate, serve and evaluate use")
    p.set_defaults(func=cmd_average)


def cmd_average(args: argparse.Namespace) -> int:
    from aiayn.train.run import average_run

    if args.replace and args.out is not None:
        raise ConfigError("--out names another file; --replace writes RUN/model.safetensors: give one")
    out = average_run(args.run, last=args.last, out=args.out, replace=args.replace)
    print(f"wrote {out}")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="what a run did: updates, time, tokens/s, valid NLL, its evaluations")
    p.add_argument("run", help="run directory, results/ copy of one, or a metrics.jsonl")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from aiayn.train.report import report_cli

    return report_cli(args)


def _add_table3(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("table3", help="the paper's Table 3: train and evaluate each variation of a base recipe",
                       description="Trains every chosen row of Table 3 (heads and d_k, d_k, depth and widths, "
                                   "dropout and label smoothing, learned positions, big) as a change of BASE, "
                                   "evaluates it (validation perplexity and BLEU) and writes OUT/table3.md, .json "
                                   "and .png beside the paper's numbers. Rerun the same command to go on after "
                                   "an interruption: finished rows are kept, a started one resumes.")
    p.add_argument("base", help="the base translation recipe (YAML or preset), e.g. multi30k_table3")
    add_output(p, "--out", kind="dir", required=True, metavar="DIR", help="where the runs, results and the table go")
    p.add_argument("--rows", default="all", help="all (default), groups (base, A, B, C, D, E, big) or rows "
                   "(A1,B2,...), comma-separated; base always runs")
    p.add_argument("--seeds", type=int, nargs="+", default=[1], metavar="SEED", help="train.seed of each run "
                   "(several: the table shows their mean and each value)")
    p.add_argument("--updates", type=int, default=None, help="updates per row (default: the base's "
                   "train.max_updates; the big row trains 3x as many, as in the paper)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override on the base")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="rows trained at a time, in N processes (several share one GPU; default 1)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP + " (= --set train.threads=N)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (plain lines)")
    p.set_defaults(func=cmd_table3)


def cmd_table3(args: argparse.Namespace) -> int:
    from aiayn.table3 import run_table

    if args.threads is not None:
        args.set = [*args.set, f"train.threads={args.threads}"]
    table = run_table(args.base, args.out, rows=args.rows, seeds=args.seeds, updates=args.updates, extra=args.set,
                      progress=not args.no_progress, parallel=args.parallel)
    print(f"{len(table['rows'])} rows in {args.out}/table3.md (JSON: table3.json, figure: table3.png)")
    return 0


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="seeds and variants of a recipe: trained side by side, chosen on validation, "
                                     "tested once; mean and deviation per split",
                       description="Trains each variant x seed of CONFIG (several at once on a GPU: --parallel), "
                                   "scores every run on validation under each --decode choice, chooses the best mean "
                                   "on validation, and only then scores the chosen runs on the test splits. Writes "
                                   "OUT/table.md (mean and standard deviation per split and metric), per-run JSON and "
                                   "curves.png (validation BLEU against updates, a line per run). Rerun the same "
                                   "command to go on after an interruption: finished runs are kept.")
    p.add_argument("config", help="the translation recipe (YAML or preset), e.g. configs/multi30k_en_de.yaml")
    add_output(p, "--out", kind="dir", required=True, metavar="DIR",
               help="results: new, empty, or this sweep's own (e.g. results/NAME); another sweep's is refused")
    add_output(p, "--work", kind="dir", default=None, metavar="DIR", help="where the runs train (checkpoints; default "
                   "runs/sweeps/<OUT's name>)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1], metavar="SEED", help="train.seed of each run "
                   "(default 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override on every run, over the variants' own (e.g. train.max_minutes=7)")
    p.add_argument("--variant", action="append", nargs="+", default=[], metavar="NAME_OR_KEY=VALUE",
                   help="a variant: NAME KEY=VALUE ... (repeat for more; default one, 'recipe', the recipe as it is)")
    p.add_argument("--variants", default=None, metavar="GRID.yaml",
                   help="a grid file (or a shipped one by name, e.g. multi30k_search): set (on every run), "
                        "variants and decode choices")
    p.add_argument("--only", nargs="+", default=None, metavar="VARIANT",
                   help="of the grid's variants, only these (a search sized to the time at hand)")
    p.add_argument("--decode", action="append", nargs="+", default=[], metavar="NAME_OR_KEY=VALUE",
                   help="a decoding scored on validation: NAME [average_last=K] [beam=N alpha=A length_penalty=P] "
                        "(default one, 'run': the run's own weights and decoding)")
    p.add_argument("--splits", nargs="+", default=None, metavar="SPLIT",
                   help="test splits (default: the dataset's, e.g. Multi30k's test_2016_flickr test_2017_flickr "
                        "test_2017_mscoco)")
    p.add_argument("--select", default="bleu_lc_tok", choices=["bleu", "chrf", "bleu_lc_tok"],
                   help="the validation metric the choice maximizes (default bleu_lc_tok)")
    p.add_argument("--no-test", action="store_true", help="validation only: no choice is tested")
    p.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="trainings at a time (default: 3 on a GPU, 1 on a CPU)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP + " (= --set train.threads=N)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (plain lines)")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    from aiayn.sweep import sweep_cli

    return sweep_cli(args)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a language model (streams tokens)")
    p.add_argument("run", help="language-model run directory (e.g. trained from lm_tinyshakespeare_char)")
    p.add_argument("--prompt", default="", help="text to continue (default: none, from the start token)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 200)")
    p.add_argument("--slide", action="store_true", help="slide the context window past the model's positions")
    add_decode_options(p, search=False)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """The prompt, then its continuation token by token (sampling; --temperature 0 is greedy), then a new line."""
    from aiayn.decode.generate import generate_options, generate_text
    from aiayn.run.directory import load_run

    run = load_run(args.run, args.device, precision=args.precision)
    opts = generate_options(run.cfg, decode_overrides(args))
    pieces = generate_text(run, args.prompt, opts, args.slide)
    _write_stdout(args.prompt)
    for piece in pieces:
        if piece:
            _write_stdout(piece)
    _write_stdout("\n")
    return 0


def _add_summarize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("summarize", help="summarize documents, one per line (or a .jsonl file's documents)")
    p.add_argument("run", help="summarization run directory (xsum_lm or xsum_seq2seq)")
    p.add_argument("--input", default=None, help="one document per line, or .jsonl rows with a 'document' field")
    add_output(p, "--output", kind="text", default=None, help="output file, one summary per line (default stdout)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="at most this many summary tokens (64)")
    add_decode_options(p)
    p.set_defaults(func=cmd_summarize)


def cmd_summarize(args: argparse.Namespace) -> int:
    """One summary line per input document, in order."""
    from aiayn.decode.generate import read_documents, summarize
    from aiayn.files import atomic_write_text, guard_output
    from aiayn.run.directory import load_run

    if args.output not in (None, "-"):
        guard_output(args.output, "text", [args.run, *([] if args.input in (None, "-") else [args.input])],
                     "--output")
    run = load_run(args.run, args.device, precision=args.precision)
    opts = run.cfg.decode.replace(**decode_overrides(args))
    field = run.cfg.data.src_field if run.cfg.data.format == "jsonl" else "document"
    docs = read_documents(args.input, field)
    # beam also on its own: summarize() refuses an explicit --beam for a language-model summarizer (greedy only)
    text = "".join(s + "\n" for s in summarize(run, docs, opts, beam=args.beam))
    if args.output not in (None, "-"):
        atomic_write_text(args.output, text)
    else:
        _write_stdout(text)
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    from aiayn.interop.registry import TARGETS, option_help

    p = sub.add_parser("export", help="export a run: " + ", ".join(t.title for t in TARGETS.values()))
    p.add_argument("engine", choices=list(TARGETS), help="the export target: what OUT_DIR becomes")
    p.add_argument("run", help="translation run directory (trained or imported)")
    add_output(p, "out_dir", kind="dir", help="; ".join(f"{t.name}: {t.help}" for t in TARGETS.values()))
    p.add_argument("--quantization", default=None, help=f"e.g. int8 ({option_help('quantization')})")
    p.add_argument("--sentence-model", default=None,
                   help=f"{option_help('sentence_model')}: a MiniSBD .onnx sentence splitter to package (default: "
                        "aiayn's rule-based one)")
    p.add_argument("--force", action="store_true", help="replace out_dir whatever it holds")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """``aiayn export``: the registry (aiayn.interop.registry) checks the run against the target's declarations,
    then runs its exporter."""
    from aiayn.interop.registry import export

    out = export(args.engine, args.run, args.out_dir, force=args.force, quantization=args.quantization,
                 sentence_model=args.sentence_model)
    print(f"wrote {out}")
    return 0


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="make a run from a Hugging Face Marian model (OPUS-MT): a Hub id or a directory",
                       description="Converts a Marian model (weights, tokenizers, generation settings) into a run "
                                   "directory that translate, evaluate, serve and --init-from use. A Hub id (e.g. "
                                   "Helsinki-NLP/opus-mt-en-de) is downloaded once into the Hugging Face cache "
                                   "(HF_HUB_OFFLINE=1: the cache only); a local directory is read as it is.")
    p.add_argument("engine", choices=["hf"], help="hf: a Hugging Face Marian model")
    p.add_argument("hf_dir", metavar="MODEL", help="a Hub id (owner/name) or a local Marian directory")
    add_output(p, "run_dir", kind="dir", metavar="RUN", help="the run directory to create (new or empty)")
    p.add_argument("--revision", default=None, help="Hub id only: a branch, tag or commit to pin (default main)")
    p.add_argument("--force", action="store_true", help="replace RUN whatever it holds")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    from aiayn.interop.hf import import_hf

    print(f"wrote {import_hf(args.hf_dir, args.run_dir, force=args.force, revision=args.revision)}")
    return 0


def _add_viz(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("viz", help="figures: positional, attention, schedule, curves, mask, model",
                       usage="%(prog)s {positional,attention,schedule,curves,mask,model} [run] [options]; "
                             "attention: %(prog)s attention RUN --src TEXT [--tgt TEXT]",
                       description="Draws one figure to a PNG and prints each path it writes. attention writes "
                                   "three files, one per kind of attention: --out X.png gives X_encoder.png, "
                                   "X_decoder_self.png and X_cross.png.")
    p.add_argument("what", choices=["positional", "attention", "schedule", "curves", "mask", "model"],
                   help="which figure (model: the paper's Figure 1 with the run's N, d_model, h, d_ff)")
    p.add_argument("run", nargs="?", default=None,
                   help="attention, curves: the run directory; schedule, model: a run, a recipe or a preset "
                        "(optional; model: paper-base)")
    add_output(p, "--out", kind="png", default=None,
               help="PNG path (default WHAT.png); attention: the stem of its three files (X.png -> X_encoder.png, "
                    "X_decoder_self.png, X_cross.png)")
    p.add_argument("--show", action="store_true", help="also open the figure in a window")
    p.add_argument("--d-model", type=int, default=None, help="positional, schedule: model width (default 512 / "
                                                             "the run's)")
    p.add_argument("--max-pos", type=int, default=128, help="positional: positions drawn (default 128)")
    p.add_argument("--warmup", type=int, default=None, help="schedule: warm-up updates (default 4000 / the run's)")
    p.add_argument("--compare", action="store_true", help="positional: sinusoidal beside the other encodings")
    p.add_argument("--src", default=None, help="attention: the source sentence (required there)")
    p.add_argument("--tgt", default=None, help="attention: the target (default: the model's greedy translation)")
    p.add_argument("--layer", type=int, default=None, help="attention: only this layer (default all)")
    p.add_argument("--head", type=int, default=None, help="attention: only this head (default all)")
    p.add_argument("--len", type=int, default=8, dest="length", help="mask: sequence length (default 8)")
    p.add_argument("--width", type=int, default=None, help="figure width in pixels")
    p.add_argument("--height", type=int, default=None, help="figure height in pixels")
    p.add_argument("--device", default="auto", help="attention: where the model runs")
    p.set_defaults(func=cmd_viz)


def cmd_viz(args: argparse.Namespace) -> int:
    from aiayn.viz.cli import viz_cli

    return viz_cli(args)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="HTTP API (translate, generate, attention) and an attention explorer page")
    from aiayn.serve import add_serve_options  # stdlib only: --help stays fast

    add_serve_options(p)
    add_decode_options(p)  # the server's decoding defaults (LibreTranslate's routes take no decoding options)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from aiayn.serve import serve_cli

    return serve_cli(args, decode_overrides(args))


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: train the quick recipe, evaluate, show translations")
    add_output(p, "--run-dir", kind="dir", default=None,
               help="run directory (default runs/demo; a finished one is evaluated, an unfinished one resumed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. "
                                                                                    "train.max_minutes=10")
    p.add_argument("--config", default=None, help="recipe to train (default multi30k_en_de_quick)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from aiayn.demo import run_demo

    return run_demo(args)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    # torchrun's options and aiayn's command pass through as they are: read by torchrun's parser and by train's
    p = sub.add_parser("launch", prefix_chars="+", add_help=False,
                       help="aiayn train under torchrun (its options, then train ...), ending in one line of aiayn's: "
                            "what stopped the job and the command that goes on (docs/distributed.md)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="[torchrun's options] train ...",
                   help="torchrun's options (--nnodes, --nproc-per-node, --rdzv-*, --max-restarts ...), then aiayn "
                        "train's command line; aiayn launch --help lists torchrun's options")
    p.set_defaults(func=cmd_launch)


def cmd_launch(args: argparse.Namespace) -> int:
    """``aiayn launch``: the command as torchrun's options and a checked ``aiayn train`` command line, then
    :func:`aiayn.launch.launch` (which ends the process)."""
    import shlex

    from aiayn.launch import launch, parse_launch, setup_timeout_of
    from aiayn.train.run import default_run_dir, may_change_on_resume

    job = parse_launch(args.argv)
    train = build_parser().parse_args(job.command)  # a bad train option: one line, before any process starts
    if isinstance(train.resume, str):
        run = Path(train.resume)
    elif train.config is not None:
        run = Path(train.run_dir) if train.run_dir else default_run_dir(train.config)
    else:
        raise ConfigError("aiayn train needs a CONFIG (a YAML recipe or a preset), or --resume RUN")
    keep = [x for kv in train.set if may_change_on_resume(kv.split("=", 1)[0].strip()) for x in ("--set", kv)]
    keep += [flag for flag, on in (("--no-progress", train.no_progress), ("--allow-unverified",
                                                                           train.allow_unverified)) if on]
    keep += ["--threads", str(train.threads)] if train.threads is not None else []
    job.run_dir = run
    # the rendezvous waits for the nodes within train.setup_timeout_s at most (docs/distributed.md, "A lost node")
    job.setup_timeout_s = setup_timeout_of(train.config, train.resume if isinstance(train.resume, str) else None,
                                           train.set)
    job.resume = shlex.join(["aiayn", "launch", *job.options, "train", "--resume", str(run), *keep])
    job.again = shlex.join(["aiayn", "launch", *args.argv])
    launch(job)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one sub-parser per command, each built by its own function above."""
    parser = OneLineParser(prog="aiayn", description=FIRST_STEPS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks of bugs")
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_presets, _add_translate, _add_evaluate, _add_prepare, _add_average, _add_report,
                _add_table3, _add_sweep, _add_generate, _add_summarize, _add_export, _add_import, _add_viz,
                _add_serve, _add_demo, _add_launch):
        add(sub)
    return parser


def _interrupted_training(args: argparse.Namespace) -> str:
    """For an interrupted ``aiayn train`` or ``aiayn demo`` (``make demo``): how to go on (its run directory keeps
    its checkpoints; the demo resumes an unfinished run by itself)."""
    command = getattr(args, "command", None)
    if command not in ("train", "demo"):
        return ""
    from aiayn.train.run import default_run_dir, resume_hint

    if command == "demo":
        from aiayn.demo import DEFAULT_RUN_DIR

        run = Path(args.run_dir or DEFAULT_RUN_DIR)
        return (f"; {resume_hint(run)}, or run make demo (aiayn demo) again, which resumes it"
                if (run / "config.yaml").is_file() else "")
    run = args.resume if isinstance(args.resume, str) else args.run_dir or (
        default_run_dir(args.config) if args.config else None)
    return f"; {resume_hint(Path(run))}" if run is not None and (Path(run) / "config.yaml").is_file() else ""


def main(argv: Sequence[str] | None = None) -> int:
    """The one error boundary of every command: a user-caused error (:func:`aiayn.errors.user_error_message`)
    is one line ``aiayn: error: <what>: <why>`` and exit 2; anything else is a bug: one line saying so and
    exit 1, its traceback only with ``-v``."""
    reattach_stderr()  # a process started by aiayn launch writes to the user's stderr, not the launcher's log
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        _set_threads(args)
        from aiayn.engine import keep_freed_memory

        keep_freed_memory()  # this process is aiayn's: its allocator may keep what a step (decoding, training) frees
        return args.func(args)
    except KeyboardInterrupt:
        print(f"aiayn: interrupted{_interrupted_training(args)}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # whoever read our output stopped (`aiayn translate ... | head`): quiet, as `cat` is
        with contextlib.suppress(OSError):  # no second error when the interpreter flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
    except Exception as e:
        msg = user_error_message(e)
        if msg is not None:
            refusal = is_refusal(e)
            # a refusal every process of a torchrun job reaches: once per machine (by aiayn launch, if it started it)
            if said_here(e) and not said_by_launcher(refusal):
                print(f"aiayn: error: {msg}", file=sys.stderr)
            record_error(msg, 2, refusal)  # torchrun's report of this process (and aiayn launch's last line) names it
            return 2
        if args.verbose:
            traceback.print_exc()
        what = " ".join(f"{type(e).__name__}: {e}".split())
        print(f"aiayn: internal error (a bug in aiayn, please report it): {what[:300]}"
              f"{'' if args.verbose else '; rerun with -v for the traceback'}", file=sys.stderr)
        record_error(f"internal error (a bug in aiayn, please report it): {what[:300]}", 1)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
