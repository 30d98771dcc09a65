"""``aiayn evaluate``: score a run on a split of its dataset or on a pair of files, and record it in the run.

Translation (and summarization) runs: decode the sources with :class:`~aiayn.decode.translator.Translator`
and write ``RUN/eval/<name>.hyp`` (one line per source line) and ``RUN/eval/<name>.json``::

    {"name", "task", "data": {"split"} or {"src", "ref"}, "n_sentences",
     "scores": {"bleu", "chrf", "bleu_lc_tok"[, "rouge1", "rouge2", "rougeL"]},
     "signatures": {"bleu", "chrf", "bleu_lc_tok"}, "bleu_detail", "bleu_lc_tok_detail",
     "decode": {beam, alpha, length_penalty, max_len_a, max_len_b, max_tokens, device},
     "run": {"path", "weights", "weights_source", "config_task"}, "truncated_lines", "wall_s", "created"}

``bleu`` / ``chrf`` are sacreBLEU (13a, cased) on detokenized text; ``bleu_lc_tok`` is the Multi30k
papers' lowercased Moses-tokenized BLEU (see :mod:`aiayn.eval.scorers`), a different number.
Summarization runs also get ROUGE-1/2/L.

Language-model runs: mean NLL per token (nats) and perplexity of the held-out text (the last
``data.valid_fraction`` of the corpus, in the fixed validation blocks training used); with ``rolling``, of that
text or of a file in lm-evaluation-harness's rolling windows (:mod:`aiayn.eval.rolling`), the number its
perplexity tasks get through ``aiayn serve``.

Files are written atomically (temporary file + rename) so an interrupted evaluation never leaves a
half-written result in the run directory.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiayn.config import Config, DecodeOptions, load_config
from aiayn.decode.loaded import merged_options
from aiayn.errors import CheckpointError, ConfigError
from aiayn.eval.results import check_name, check_writable, scored_weights, write_result
from aiayn.files import now

log = logging.getLogger("aiayn.eval")


def split_pairs(cfg: Config, split: str) -> list[tuple[str, str]]:
    """(source, reference) pairs of a split of the run's dataset.

    ``reverse``: train / valid / test; ``multi30k``: train, val (or valid), test_2016_flickr, ...;
    parallel files named in the config: train / valid.
    """
    from aiayn.data.registry import pairs

    return pairs(cfg, split)


def _default_name(src: str) -> str:
    p = Path(src)
    return (p.with_suffix("") if p.suffix == ".gz" else p).stem or "eval"


@dataclass(frozen=True)
class EvalData:
    """What to score: a ``split`` of the run's dataset, or the file ``src`` against the file ``ref``; ``name``: the
    record's (default: the split, or the source file's stem). Language models: ``rolling`` scores the validation
    text (or the file ``src``, one document) in lm-evaluation-harness's rolling windows at its ``max_length``
    (None: the run's context) instead of the training blocks (:mod:`aiayn.eval.rolling`)."""

    split: str | None = None
    src: str | None = None
    ref: str | None = None
    name: str | None = None
    rolling: bool = False
    max_length: int | None = None
    weights: str = "model"  # which weights are scored (aiayn.run.weights.select_weights): model.safetensors by default

    def record_name(self, base: str, label: str | None) -> str:
        """The record's name: ``name`` if given, else ``base`` (the split or file), marked with the weights scored
        when they are not the run's own (``test_2016_flickr.average``, ``--name foo``: ``foo.average``), so that
        scoring other weights never replaces the run's record."""
        base = self.name if self.name is not None else base  # --name '' is refused, not the default
        return check_name(base if label is None else f"{base}.{label}")


def _precision_name(name: str, precision: str) -> str:
    """``name.int8`` for an int8 evaluation (``--name`` too): beside the fp32 record of the same data, not over it."""
    return check_name(f"{name}.int8") if precision == "int8" else name


def _scored_pairs(cfg: Config, data: EvalData, label: str | None) -> tuple[list[tuple[str, str]], dict[str, str], str]:
    """The (source, reference) pairs ``data`` names, the record's ``data`` field and the record's name: a split
    of the run's dataset, or the file ``src`` against the file ``ref``."""
    from aiayn.data.corpus import read_parallel

    if data.split is not None:
        info = {"split": data.split, "dataset": cfg.data.dataset}
        return split_pairs(cfg, data.split), info, data.record_name(data.split, label)
    info = {"src": str(data.src), "ref": str(data.ref)}
    return read_parallel(data.src, data.ref), info, data.record_name(_default_name(data.src), label)


def _score_fields(cfg: Config, hyps: list[str], refs: list[str]) -> dict[str, Any]:
    """The record's scores (rounded), their signatures and the BLEU details of hypotheses ``hyps`` against
    ``refs``: sacreBLEU's BLEU and chrF, the lowercased tokenized BLEU, and ROUGE for a summarizing run."""
    from aiayn.eval.scorers import bleu_lc_tok, rouge_scores, sacrebleu_scores

    sb = sacrebleu_scores(hyps, refs)
    lc_score, lc_desc, lc_detail = bleu_lc_tok(hyps, refs, cfg.data.tgt_lang)
    scores = {"bleu": sb["bleu"], "chrf": sb["chrf"], "bleu_lc_tok": lc_score}
    extra = {"rouge": rouge_scores}  # what a task's extra_scores name (ROUGE for a summarizer)
    for score in cfg.kind.extra_scores:
        scores.update(extra[score](hyps, refs))
    return {
        "scores": {k: round(v, 4) for k, v in scores.items()},
        "signatures": {"bleu": sb["bleu_signature"], "chrf": sb["chrf_signature"], "bleu_lc_tok": lc_desc},
        "bleu_detail": sb["bleu_detail"],
        "bleu_lc_tok_detail": lc_detail,
    }


def evaluate_translation(run_dir: str | Path, data: EvalData, options: DecodeOptions | None = None,
                         device: str = "auto", precision: str = "auto", **overrides) -> dict[str, Any]:
    """Decode ``data`` (a split, or ``src`` scored against ``ref``), write eval/<name>.json + .hyp; return the
    record.

    Options: the run's ``decode`` section, then ``options``, then the non-None ``overrides``. Everything
    that can fail (the run, the data, the options, a writable ``RUN/eval``) is checked before decoding."""
    from aiayn.decode.open_run import open_run
    from aiayn.decode.stream import no_newlines
    from aiayn.progress import ItemProgress

    run_dir = Path(run_dir)
    weights, run_info, label = scored_weights(run_dir, data.weights)
    translator = open_run(run_dir, device=device, precision=precision, weights=weights, translator_only=True)
    cfg = translator.cfg
    opts = translator.options(options, **overrides)
    if opts.nbest != 1:
        raise ConfigError("evaluate scores one hypothesis per source: nbest must be 1")
    pairs, data_info, name = _scored_pairs(cfg, data, label)
    name = _precision_name(name, translator.run.precision)
    check_writable(run_dir, name, [data.src, data.ref])
    sources, refs = [s for s, _ in pairs], [r for _, r in pairs]
    _, truncated = translator.encode_sources(sources)
    start = time.perf_counter()
    progress = ItemProgress(len(sources), "sentence", f"evaluate {name}")
    found = translator.search(sources, opts, scores=opts.sample, progress=progress.update)  # as translate() does
    progress.close()
    hyps = [no_newlines(h[0].text if h else "") for h in found]
    wall = time.perf_counter() - start
    result = {
        "name": name,
        "task": cfg.task,
        "data": data_info,
        "n_sentences": len(sources),
        **_score_fields(cfg, hyps, refs),
        "decode": {**asdict(opts), "max_tokens": opts.batch_tokens(translator.device.type),
                   "device": str(translator.device), "dtype": str(next(translator.model.parameters()).dtype),
                   "precision": translator.run.precision},
        "run": run_info,
        "truncated_lines": [i + 1 for i in truncated],
        "wall_s": round(wall, 3),
        "created": now(),
    }
    result["json_path"] = str(write_result(run_dir, name, result, hyps))
    return result


def evaluate_lm(run_dir: str | Path, name: str | None = None, device: str = "auto",
                precision: str = "auto", weights: str = "model") -> dict[str, Any]:
    """NLL per token (nats) and perplexity of a language-model run's validation text; writes eval/<name>.json
    (``weights``: which weights of the run, :class:`EvalData`'s)."""
    import torch

    from aiayn.data.pipeline import build_lm_data
    from aiayn.eval.scorers import perplexity
    from aiayn.run.directory import load_run
    from aiayn.train.validation import evaluate_loss

    run_dir = Path(run_dir)
    chosen, run_info, label = scored_weights(run_dir, weights)
    run = load_run(run_dir, device, chosen, precision=precision)
    name = _precision_name(EvalData(name=name).record_name("valid", label), run.precision)
    check_writable(run_dir, name, hyp=False)
    data, _ = build_lm_data(run.cfg, run_dir)
    start = time.perf_counter()
    with torch.no_grad():
        res = evaluate_loss(run.model, data.valid_batches, label_smoothing=0.0)
    wall = time.perf_counter() - start
    nll = res["valid_nll"]
    result = {
        "name": name,
        "task": "lm",
        "data": {"split": "valid", "valid_fraction": run.cfg.data.valid_fraction,
                 "block_size": run.cfg.data.block_size, "n_tokens": int(sum(b.ntokens for b in data.valid_batches))},
        "scores": {"nll_per_token": round(nll, 6), "ppl": round(perplexity(nll), 4)},
        "run": run_info,
        "wall_s": round(wall, 3),
        "created": now(),
    }
    result["json_path"] = str(write_result(run_dir, name, result, None))
    return result


def lm_valid_text(cfg: Config) -> str:
    """The validation text of a language model of running text: the last ``data.valid_fraction`` of its corpus,
    cut where training cut it (``data.pipeline.build_lm_data``)."""
    from aiayn.data.corpus import read_text
    from aiayn.data.registry import dataset_of
    from aiayn.decode.generate import summarizer_for

    if summarizer_for(cfg) is not None:  # a model of "document <sep> summary" rows: its corpus is no running text
        raise ConfigError("--rolling scores running text: give a summarization LM's text as --src FILE")
    text = read_text(dataset_of(cfg).text(cfg.data)[0])
    return text[int(len(text) * (1 - cfg.data.valid_fraction)):]


def evaluate_lm_rolling(run_dir: str | Path, data: EvalData, device: str = "auto",
                        precision: str = "auto") -> dict[str, Any]:
    """The log-likelihood, NLL per token and perplexity of the validation text (or the file ``data.src``, one
    document) as lm-evaluation-harness's ``loglikelihood_rolling`` scores it through ``aiayn serve``: its windows
    at ``data.max_length``, the first after ``<s>``; with lm-eval's word and byte perplexities. Writes
    eval/<name>.json."""
    from aiayn.data.corpus import read_text
    from aiayn.decode.generate import lm_context
    from aiayn.eval.rolling import rolling_windows, score_windows, text_counts
    from aiayn.eval.scorers import perplexity
    from aiayn.run.directory import load_run

    run_dir = Path(run_dir)
    chosen, run_info, label = scored_weights(run_dir, data.weights)
    run = load_run(run_dir, device, chosen, precision=precision)
    context = lm_context(run.cfg)
    max_length = data.max_length or context
    if not 3 <= max_length <= context:
        raise ConfigError(f"--max-length {max_length}: lm-evaluation-harness's windows at max_length N send N - 1 "
                          f"tokens and ask for one more, so N is 3 to the model's context ({context})")
    text = read_text(data.src) if data.src is not None else lm_valid_text(run.cfg)
    name = _precision_name(data.record_name(f"rolling_{_default_name(data.src) if data.src else 'valid'}", label),
                           run.precision)
    check_writable(run_dir, name, [data.src], hyp=False)
    ids = run.tokenizers.src.encode(text)
    windows = rolling_windows(ids, run.tokenizers.specials.bos, max_length)
    start = time.perf_counter()
    loglikelihood = score_windows(run, windows)
    wall = time.perf_counter() - start
    words, n_bytes = text_counts(text)
    nll = -loglikelihood / max(len(ids), 1)
    where = {"src": str(data.src)} if data.src is not None else {"split": "valid"}
    result = {
        "name": name, "task": "lm",
        "data": {**where, "rolling": True, "max_length": max_length, "prefix": "<s>", "windows": len(windows),
                 "n_tokens": len(ids), "words": words, "bytes": n_bytes},
        "scores": {"loglikelihood": round(loglikelihood, 6), "nll_per_token": round(nll, 6),
                   "ppl": round(perplexity(nll), 4),
                   # lm-eval's names and formulas (its perplexity tasks report these three)
                   "word_perplexity": round(perplexity(-loglikelihood / words), 4),
                   "byte_perplexity": round(perplexity(-loglikelihood / max(n_bytes, 1)), 4),
                   "bits_per_byte": round(-loglikelihood / max(n_bytes, 1) / math.log(2), 6)},
        "run": run_info, "wall_s": round(wall, 3),
        "created": now(),
    }
    result["json_path"] = str(write_result(run_dir, name, result, None))
    return result


def evaluate_run(run_dir: str | Path, data: EvalData, options: DecodeOptions | None = None, device: str = "auto",
                 precision: str = "auto", **overrides) -> dict[str, Any]:
    """Evaluate a run on ``data`` (see the module docstring); dispatches on the run's task. Decoding options: the
    run's ``decode`` section, then ``options``, then the non-None ``overrides`` (e.g. ``beam=5``)."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        what = "no such run directory" if not run_dir.is_dir() else "no config.yaml (is it a run directory?)"
        raise CheckpointError(f"{run_dir}: {what}")
    cfg = load_config(cfg_path)
    merged_options(cfg.decode, options, **overrides)  # bad options fail here, before any loading
    if data.max_length is not None and not data.rolling:
        raise ConfigError("--max-length is lm-evaluation-harness's window length: it goes with --rolling")
    return EVALUATORS[cfg.kind.evaluator](run_dir, cfg, data, options, device, precision, overrides)


def _evaluate_pairs(run_dir: Path, cfg: Config, data: EvalData, options: DecodeOptions | None, device: str,
                    precision: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """An encoder-decoder's outputs against references: a split's, or ``--src`` against ``--ref``."""
    split, src, ref = data.split, data.src, data.ref
    if data.rolling:
        raise ConfigError(f"--rolling scores a language model's text; this is a {cfg.task} run")
    if (split is None) == (src is None and ref is None):
        raise ConfigError("evaluate needs either --split NAME or --src FILE --ref FILE")
    if split is None and (src is None or ref is None):
        raise ConfigError("--src and --ref go together")
    return evaluate_translation(run_dir, data, options, device, precision, **overrides)


def _evaluate_split_summaries(run_dir: Path, data: EvalData, options: DecodeOptions | None, device: str,
                              precision: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Summaries of a split scored by ROUGE (with the lead-1 baseline beside it on XSum), for both kinds."""
    from aiayn.eval.summaries import evaluate_summaries

    return evaluate_summaries(run_dir, data.split, options, device, precision, data.weights, **overrides)


def _evaluate_summarizer(run_dir: Path, cfg: Config, data: EvalData, options: DecodeOptions | None, device: str,
                         precision: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """An encoder-decoder summarizer: a split's summaries by ROUGE, else as :func:`_evaluate_pairs`."""
    if data.split is not None:
        return _evaluate_split_summaries(run_dir, data, options, device, precision, overrides)
    return _evaluate_pairs(run_dir, cfg, data, options, device, precision, overrides)


def _evaluate_language_model(run_dir: Path, cfg: Config, data: EvalData, options: DecodeOptions | None,
                             device: str, precision: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """A language model: its text scored in lm-evaluation-harness's rolling windows (``--rolling``), a split's
    summaries (a "document <sep> summary" model), else the NLL of its validation text."""
    from aiayn.decode.generate import summarizer_for

    split, src, ref = data.split, data.src, data.ref
    if data.rolling:
        if ref is not None or split not in (None, "valid") or (src is not None and split is not None):
            raise ConfigError("--rolling scores the validation text or one --src FILE: no --ref, no other split")
        return evaluate_lm_rolling(run_dir, data, device, precision)
    if split is not None and summarizer_for(cfg) is not None:  # a model that summarizes: its summaries of a split
        return _evaluate_split_summaries(run_dir, data, options, device, precision, overrides)
    if src is not None or ref is not None or split not in (None, "valid"):
        raise ConfigError("a language-model run is evaluated on its validation text: no --src/--ref (a text "
                          "file is scored with --rolling), --split valid at most")
    return evaluate_lm(run_dir, data.name, device, precision, data.weights)


# What each task's runs are evaluated by (Task.evaluator names its entry).
EVALUATORS: dict[str, Callable[..., dict[str, Any]]] = {
    "pairs": _evaluate_pairs, "summaries": _evaluate_summarizer, "language_model": _evaluate_language_model}


def summary(result: dict[str, Any]) -> str:
    """A few lines for the terminal, the first saying which weights were scored."""
    return f"{scored_line(result.get('run') or {})}\n{_scores_summary(result)}"


def scored_line(run: dict[str, Any]) -> str:
    """Which weights an evaluation scored: the file (or checkpoints) and, when its metadata says, where they came
    from (the last update, the best validation, an average)."""
    where = f" of {run['path']}" if run.get("path") else ""
    source = f" ({run['weights_source']})" if run.get("weights_source") else ""
    return f"scored: {run.get('weights', 'the run')}{where}{source}"


def _scores_summary(result: dict[str, Any]) -> str:
    s = result["scores"]
    if result["name"].startswith("rouge_"):
        lines = [f"{result['name']}: {result['data']['n_documents']} documents ({result['decode']['how']}), "
                 f"{result['wall_s']:.1f} s",
                 "ROUGE F1 (rouge-score, Porter stemmer):  " + "  ".join(f"{k} {s[k]:.2f}" for k in
                                                                       ("rouge1", "rouge2", "rougeL"))]
        if "lead1" in result:
            lines.append("lead-1 baseline:                         " + "  ".join(
                f"{k} {result['lead1'][k]:.2f}" for k in ("rouge1", "rouge2", "rougeL")))
        lines.append(f"wrote {result['json_path']}")
        return "\n".join(lines)
    lm = "nll_per_token" in s  # a language model's record (its text's NLL), not decoded outputs'
    if lm and result["data"].get("rolling"):
        d = result["data"]
        return (f"{result['name']}: {d['n_tokens']} tokens in {d['windows']} rolling windows (lm-evaluation-harness, "
                f"max_length {d['max_length']}, after <s>): loglikelihood {s['loglikelihood']:.4f}, NLL "
                f"{s['nll_per_token']:.4f} nats/token, perplexity {s['ppl']:.2f}\nword_perplexity "
                f"{s['word_perplexity']:.4f}, byte_perplexity {s['byte_perplexity']:.4f}, bits_per_byte "
                f"{s['bits_per_byte']:.4f}\nwrote {result['json_path']}")
    if lm:
        return (f"{result['name']}: {result['data']['n_tokens']} tokens, NLL {s['nll_per_token']:.4f} nats/token, "
                f"perplexity {s['ppl']:.2f}\nwrote {result['json_path']}")
    d, sig = result["decode"], result["signatures"]
    lines = [
        f"{result['name']}: {result['n_sentences']} sentences, beam {d['beam']}, alpha {d['alpha']} "
        f"({d['length_penalty']}), {result['wall_s']:.1f} s",
        f"BLEU        {s['bleu']:6.2f}  {sig['bleu']}",
        f"chrF        {s['chrf']:6.2f}  {sig['chrf']}",
        f"BLEU lc-tok {s['bleu_lc_tok']:6.2f}  (lowercased + Moses-tokenized, Multi30k-paper style; not sacreBLEU)",
        f"            {result['bleu_lc_tok_detail']}",  # precisions and brevity: is the output too short?
    ]
    for k in ("rouge1", "rouge2", "rougeL"):
        if k in s:
            lines.append(f"{k:<11} {s[k]:6.2f}  (rouge-score F1, Porter stemmer)")
    if result["truncated_lines"]:
        lines.append(f"{len(result['truncated_lines'])} source line(s) truncated to the model's positions")
    lines.append(f"wrote {result['json_path']} and {Path(result['json_path']).with_suffix('.hyp')}")
    return "\n".join(lines)
