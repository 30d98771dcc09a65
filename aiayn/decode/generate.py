"""Language-model generation and summaries: ``aiayn generate``, ``aiayn summarize`` and ROUGE on a split.

``aiayn generate RUN --prompt TEXT`` continues the prompt with a language-model run and prints each
token as it is produced (:func:`generate_text`): KV-cached decoding (:func:`aiayn.decode.search.sample`),
temperature 0 for greedy, top-k / top-p filtering, a seed for repeatable draws. The model's context is
the block length it was trained on (``data.block_size``, at most ``model.max_positions``). A prompt
that leaves no room for one new token in it is refused, unless ``--slide`` asks to keep only its last
tokens. Generation that runs past the context always slides: each step then re-reads the last
``context`` tokens without a cache (absolute positions cannot move inside a cache), as nanoGPT does.

``aiayn summarize RUN`` writes one summary per input document (:func:`summarize`). Input: one
document per line, or a ``.jsonl`` / ``.jsonl.gz`` file whose rows hold a ``document`` field (the
run's ``data.src_field`` when it was trained from JSONL files). Each document is put on one line, as
in training. Output: one line per input line, in order; an empty document gives an empty line.

* Language-model runs trained on "document <sep> summary" (:mod:`aiayn.data.summarization`) are
  primed with ``BOS document <sep>`` and decoded greedily until EOS, a new line or a second separator.
  The prompt keeps room for ``min(max_new_tokens, context / 4)`` summary tokens: the end of a long
  document is cut, never the separator.
* Encoder-decoder runs (``task: summarization``) use the translator's machinery: documents cut to the
  model's positions, beam search (the run's ``decode`` settings or the options), at most
  ``max_new_tokens`` summary tokens.

ROUGE-1/2/L on a split, beside the lead-1 baseline (the document's first sentence)::

    python -m aiayn.decode.generate rouge RUN [--split test]      # writes RUN/eval/rouge_test.{json,hyp}
    python -m aiayn.decode.generate rouge --lead1 [--split test]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from aiayn.config import Config, ConfigError
from aiayn.data.corpus import DataError
from aiayn.data.summarization import (
    is_summary_lm,
    lead_1,
    lm_prompt,
    one_line,
    separator_ids,
    summary_pairs,
    xsum_split,
)
from aiayn.data.tokenizer import BOS_ID, EOS_ID, UNK_ID, Tokenizer
from aiayn.decode.search import sample
from aiayn.errors import UserError

log = logging.getLogger("aiayn.generate")


def lm_context(cfg: Config) -> int:
    """Tokens a language-model run reads at once: the block it was trained on, within its positions."""
    return min(cfg.model.max_positions, cfg.data.block_size)


def prompt_ids(cfg: Config, tok: Tokenizer, prompt: str) -> list[int]:
    """The ids generation starts from. Summarization LMs saw BOS first in training, so they get it too;
    a text-stream LM never saw BOS, so an empty prompt starts from a new line when it knows one."""
    if is_summary_lm(cfg):
        return [BOS_ID] + tok.encode(prompt)
    if prompt:
        return tok.encode(prompt)
    newline = tok.encode("\n")
    return newline if newline and UNK_ID not in newline else [BOS_ID]


class TextStream:
    """Ids in, one at a time; out, the text each adds. Re-decodes the new ids behind a few ids of
    context (SentencePiece drops a leading word boundary, so the first new piece alone would lose its
    space) and holds back a trailing U+FFFD: a byte-fallback character may still be incomplete."""

    def __init__(self, tok: Tokenizer, context: Sequence[int] = ()) -> None:
        self.tok = tok
        self.ids = list(context)[-8:]
        self.shown = tok.decode(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        stable = self.tok.decode(self.ids).rstrip("\ufffd")
        if not stable.startswith(self.shown):
            return ""  # a piece rewrote earlier text (rare): wait until it settles
        new, self.shown = stable[len(self.shown):], stable
        return new

    def finish(self) -> str:
        text = self.tok.decode(self.ids)
        return text[len(self.shown):] if text.startswith(self.shown) else ""


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ConfigError(f"--top-p must be in (0, 1], got {top_p}")


def generate_text(run, prompt: str, max_new_tokens: int = 200, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None, slide: bool = False,
                  no_repeat_ngram: int = 0) -> Iterator[str]:
    """Stream the continuation of ``prompt`` by a language-model :class:`~aiayn.run_dir.Run`: one text
    piece per generated token (empty while a character is incomplete), then what was held back.
    Checks happen here, before the first token: a bad option or a prompt too long for the context
    (without ``slide``) raises :class:`ConfigError`."""
    cfg, tok = run.cfg, run.tokenizers.src
    if cfg.task != "lm":
        raise ConfigError(f"{run.path} is a {cfg.task} run: `aiayn generate` needs a language model "
                          "(use translate or summarize)")
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    if no_repeat_ngram < 0:
        raise ConfigError(f"--no-repeat-ngram must be >= 0 (0: off), got {no_repeat_ngram}")
    ids = prompt_ids(cfg, tok, prompt)
    ctx = lm_context(cfg)
    if len(ids) + 1 > ctx and not slide:
        raise ConfigError(f"the prompt is {len(ids)} tokens but the model reads {ctx} at once (its training "
                          f"block), so no new token fits: shorten it, or pass --slide to read only its last {ctx}")
    tokens = sample(run.model, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    eos_id=EOS_ID, context_limit=ctx, no_repeat_ngram=no_repeat_ngram)

    def stream() -> Iterator[str]:
        text = TextStream(tok, ids)
        for t in tokens:
            yield text.add(t)
        yield text.finish()

    return stream()


def _write_stdout(text: str) -> None:
    """UTF-8 whatever the locale says, flushed at once (streaming)."""
    if hasattr(sys.stdout, "buffer"):
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def generate_cli(args: argparse.Namespace) -> int:
    """``aiayn generate``: the prompt, then its continuation token by token, then a new line."""
    from aiayn.run_dir import load_run

    run = load_run(args.run, args.device)
    pieces = generate_text(run, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                           args.seed, args.slide, args.no_repeat_ngram)
    _write_stdout(args.prompt)
    for piece in pieces:
        if piece:
            _write_stdout(piece)
    _write_stdout("\n")
    return 0


# Summaries ---------------------------------------------------------------------------------------------


def summarize_lm(run, documents: Sequence[str], max_new_tokens: int = 64, no_repeat_ngram: int = 0) -> list[str]:
    """Greedy summaries from a "document <sep> summary" language model, one per document; with
    ``no_repeat_ngram`` n > 0 a summary never repeats one of its own n-grams (it may copy the document's)."""
    cfg, tok = run.cfg, run.tokenizers.src
    ctx = lm_context(cfg)
    sep = separator_ids(tok, cfg.data.separator)
    stops = (cfg.data.separator.strip(), "\n")  # a second separator or a new line ends the summary too
    reserve = min(max_new_tokens, ctx // 4)
    out = []
    for doc in documents:
        doc = one_line(doc)
        if not doc:
            out.append("")
            continue
        found: list[int] = []
        text = ""
        for t in sample(run.model, lm_prompt(tok, doc, sep, ctx - reserve), max_new_tokens, temperature=0.0,
                        eos_id=EOS_ID, context_limit=ctx, no_repeat_ngram=no_repeat_ngram):
            found.append(t)
            text = tok.decode(found)
            if any(s in text for s in stops):
                break
        for s in stops:
            text = text.split(s)[0]
        out.append(one_line(text))
    return out


def summarize_seq2seq(run, documents: Sequence[str], max_new_tokens: int = 64, beam: int | None = None,
                      alpha: float | None = None, length_penalty: str | None = None,
                      max_tokens: int | None = None, no_repeat_ngram: int | None = None) -> list[str]:
    """Summaries from an encoder-decoder run: documents cut to its positions, beam (or greedy) search."""
    from aiayn.decode.translator import Translator, decode_sources

    tr = Translator(run.model, run.tokenizers, run.cfg, run.path)
    settings = tr.settings(beam, alpha, length_penalty, max_tokens, no_repeat_ngram)
    settings.max_len_a, settings.max_len_b = 0.0, max_new_tokens  # at most max_new_tokens summary tokens
    ids, cut = tr.encode_sources([one_line(d) for d in documents], warn=False)
    if cut:
        log.info("%d of %d documents cut to the model's %d source tokens", len(cut), len(documents),
                 tr.max_source_tokens)
    todo = [i for i, s in enumerate(ids) if s is not None]
    found = decode_sources(run.model, [ids[i] for i in todo], settings, scores=False)
    out = [""] * len(documents)
    for i, hyps in zip(todo, found):
        out[i] = one_line(run.tokenizers.tgt.decode(hyps[0].tokens))
    return out


def summarize(run, documents: Sequence[str], max_new_tokens: int = 64, beam: int | None = None,
              alpha: float | None = None, length_penalty: str | None = None,
              max_tokens: int | None = None, no_repeat_ngram: int | None = None) -> list[str]:
    """One summary per document (see the module docstring), from either kind of summarization run.
    ``no_repeat_ngram`` None takes the run's ``decode.no_repeat_ngram``."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if no_repeat_ngram is None:
        no_repeat_ngram = run.cfg.decode.no_repeat_ngram
    if no_repeat_ngram < 0:
        raise ConfigError(f"--no-repeat-ngram must be >= 0 (0: off), got {no_repeat_ngram}")
    if run.cfg.task == "lm":
        if not is_summary_lm(run.cfg):
            raise ConfigError(f"{run.path} is a language model of running text, not of 'document <sep> summary' "
                              "sequences (data.dataset xsum or JSONL files): it cannot summarize")
        if beam not in (None, 1):
            raise ConfigError("--beam: a language-model run summarizes greedily; beam search needs an "
                              "encoder-decoder (task: summarization) run")
        return summarize_lm(run, documents, max_new_tokens, no_repeat_ngram)
    if run.cfg.task != "summarization":
        raise ConfigError(f"{run.path} is a {run.cfg.task} run: use `aiayn translate`")
    return summarize_seq2seq(run, documents, max_new_tokens, beam, alpha, length_penalty, max_tokens,
                             no_repeat_ngram)


def read_documents(path: str | None, field: str = "document") -> list[str]:
    """Documents from ``path`` (stdin when None or ``-``): one per line, or the ``field`` of each row of a
    ``.jsonl`` / ``.jsonl.gz`` file."""
    from aiayn.data.corpus import read_jsonl_rows
    from aiayn.decode.translator import _read_input

    if path is not None and (path.endswith(".jsonl") or path.endswith(".jsonl.gz")):
        docs = []
        for n, row in enumerate(read_jsonl_rows(path), start=1):
            if not isinstance(row.get(field), str):
                raise DataError(f"{path}: row {n}: no string field {field!r}")
            docs.append(row[field])
        return docs
    return _read_input(path)


def summarize_cli(args: argparse.Namespace) -> int:
    """``aiayn summarize``: one summary line per input document, in order."""
    from aiayn.run_dir import load_run

    run = load_run(args.run, args.device)
    field = run.cfg.data.src_field if run.cfg.data.format == "jsonl" else "document"
    docs = read_documents(args.input, field)
    found = summarize(run, docs, args.max_new_tokens, args.beam, args.alpha, args.length_penalty, args.max_tokens,
                      args.no_repeat_ngram)
    text = "".join(s + "\n" for s in found)
    if args.output is not None and args.output != "-":
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        _write_stdout(text)
    return 0


# ROUGE on a split ----------------------------------------------------------------------------------------


def lead1_scores(split: str = "test") -> dict[str, float]:
    """ROUGE-1/2/L (percent) of the lead-1 baseline on an XSum split: each document's first sentence."""
    from aiayn.eval.metrics import rouge_scores

    rows = xsum_split(split)
    return rouge_scores([lead_1(r["document"]) for r in rows], [one_line(r["summary"]) for r in rows])


def evaluate_summaries(run_dir: str | Path, split: str = "test", max_new_tokens: int = 64, beam: int | None = None,
                       alpha: float | None = None, length_penalty: str | None = None,
                       device: str = "cpu", no_repeat_ngram: int | None = None) -> dict[str, Any]:
    """Summarize a split of the run's data, score ROUGE-1/2/L (and lead-1 on XSum), write
    ``RUN/eval/rouge_<split>.json`` and ``.hyp``; return the record."""
    from aiayn.eval.evaluate import _weights_info, _write_result
    from aiayn.eval.metrics import rouge_scores
    from aiayn.run_dir import load_run

    run_dir = Path(run_dir)
    run = load_run(run_dir, device)
    pairs = summary_pairs(run.cfg, split)
    start = time.perf_counter()
    if no_repeat_ngram is None:
        no_repeat_ngram = run.cfg.decode.no_repeat_ngram
    hyps = summarize(run, [d for d, _ in pairs], max_new_tokens, beam, alpha, length_penalty,
                     no_repeat_ngram=no_repeat_ngram)
    wall = time.perf_counter() - start
    kind = "lm: greedy after 'document <sep>'" if run.cfg.task == "lm" else \
        f"encoder-decoder: beam {beam or run.cfg.decode.beam}"
    result: dict[str, Any] = {
        "name": f"rouge_{split}",
        "task": run.cfg.task,
        "data": {"dataset": run.cfg.data.dataset, "split": split, "n_documents": len(pairs)},
        "scores": {k: round(v, 2) for k, v in rouge_scores(hyps, [s for _, s in pairs]).items()},
        "decode": {"how": kind, "max_new_tokens": max_new_tokens, "no_repeat_ngram": no_repeat_ngram},
        "run": _weights_info(run_dir),
        "wall_s": round(wall, 3),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if run.cfg.data.dataset == "xsum":
        result["lead1"] = {k: round(v, 2) for k, v in lead1_scores(split).items()}
    result["json_path"] = str(_write_result(run_dir, result["name"], result, hyps))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aiayn.decode.generate rouge (RUN | --lead1) [--split test]``."""
    p = argparse.ArgumentParser(prog="python -m aiayn.decode.generate", description="ROUGE of summaries on a split")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rouge", help="ROUGE-1/2/L of a run's summaries (or of lead-1) on a split")
    r.add_argument("run", nargs="?", default=None)
    r.add_argument("--lead1", action="store_true", help="score the lead-1 baseline (XSum) instead of a run")
    r.add_argument("--split", default="test")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--beam", type=int, default=None)
    r.add_argument("--alpha", type=float, default=None)
    r.add_argument("--length-penalty", choices=["gnmt", "power", "none"], default=None)
    r.add_argument("--no-repeat-ngram", type=int, default=None, metavar="N",
                   help="never repeat an n-gram of the summary (default: the run's config, 0 = off)")
    r.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.lead1 == (args.run is not None):
            raise ConfigError("rouge needs either a RUN or --lead1")
        if args.lead1:
            print(json.dumps({"lead1": {"split": args.split, **{k: round(v, 2) for k, v in
                                                                 lead1_scores(args.split).items()}}}))
        else:
            res = evaluate_summaries(args.run, args.split, args.max_new_tokens, args.beam, args.alpha,
                                     args.length_penalty, args.device, args.no_repeat_ngram)
            print(json.dumps({k: res[k] for k in ("name", "task", "data", "scores", "decode", "wall_s")
                              if k in res} | ({"lead1": res["lead1"]} if "lead1" in res else {})))
            print(f"wrote {res['json_path']}")
    except (UserError, OSError) as e:
        print(f"aiayn: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
