"""Language-model generation and summaries: ``aiayn generate``, ``aiayn summarize``, and :class:`Generator`.

``aiayn generate RUN --prompt TEXT`` continues the prompt with a language-model run and prints each
token as it is produced (:func:`generate_text`): KV-cached decoding (:func:`aiayn.search.sample`),
temperature 0 for greedy, top-k / top-p filtering, a seed for repeatable draws. The model's context is
the block length it was trained on (``data.block_size``, at most ``model.max_positions``). A prompt
that leaves no room for one new token in it is refused, unless ``slide`` asks to keep only its last
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

Decoding options are one :class:`~aiayn.config.DecodeOptions` (the run's ``decode`` section plus
overrides). ROUGE of summaries on a split is :mod:`aiayn.eval.summaries`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiayn.config import Config, DecodeOptions
from aiayn.data.pipeline import corpus_of
from aiayn.data.summarization import collapse_whitespace, lm_prompt, separator_ids
from aiayn.data.tokenizer import Tokenizer
from aiayn.decode.loaded import LoadedRun, merged_options, text_list
from aiayn.device import model_device
from aiayn.engine import kernels
from aiayn.errors import ConfigError, DataError
from aiayn.run.directory import Run
from aiayn.search import SearchSpec, decode_ids, strategy_for

if TYPE_CHECKING:
    pass

log = logging.getLogger("aiayn.generate")

DEFAULT_NEW_TOKENS = {"generate": 200, "summarize": 64}


def lm_context(cfg: Config) -> int:
    """Tokens a language-model run reads at once: the block it was trained on, within its positions."""
    return min(cfg.model.max_positions, cfg.data.block_size)


def prompt_ids(cfg: Config, tok: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """The ids generation starts from. Summarization LMs saw BOS first in training, so they get it too;
    a text-stream LM never saw BOS, so an empty prompt starts from a new line when it knows one (the run's
    corpus says which: :attr:`aiayn.data.pipeline.Corpus.prompt`). A prompt given as ids (a client that
    tokenized it, as lm-evaluation-harness does) is taken as it is."""
    if not isinstance(prompt, str):
        return [int(i) for i in prompt]
    return corpus_of(cfg).prompt(tok, prompt)


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


def new_token_limit(opts: DecodeOptions, command: str) -> int:
    """Tokens to generate: ``opts.max_new_tokens``, or the default of ``command`` ("generate", "summarize")."""
    return DEFAULT_NEW_TOKENS[command] if opts.max_new_tokens is None else opts.max_new_tokens


def generate_options(cfg: Config, chosen: dict[str, Any]) -> DecodeOptions:
    """What ``aiayn generate`` and the server's ``/v1/generate`` decode with: the run's ``decode`` section with
    its task's decoding defaults (a language model samples at temperature 1), unless ``chosen`` (flags, by
    DecodeOptions field name) says otherwise."""
    return cfg.decode.replace(**{**cfg.kind.decoding, **chosen})


def check_prompt_fits(cfg: Config, ids: Sequence[int]) -> None:
    """A one-line ConfigError when a prompt of these ids leaves no room for a new token in the model's context."""
    ctx = lm_context(cfg)
    if len(ids) + 1 > ctx:
        raise ConfigError(f"the prompt is {len(ids)} tokens but the model reads {ctx} at once (its training "
                          f"block), so no new token fits: shorten it, or pass --slide to read only its last {ctx}")


def generate_text(run: Run, prompt: str | Sequence[int], opts: DecodeOptions, slide: bool = False) -> Iterator[str]:
    """Stream the continuation of ``prompt`` by a language-model :class:`~aiayn.run.directory.Run`: one text
    piece per generated token (empty while a character is incomplete), then what was held back.

    Draws with ``opts.temperature`` / ``top_k`` / ``top_p`` / ``seed`` when ``opts.sample`` (temperature 0:
    greedy), greedy otherwise; ``opts.max_new_tokens`` tokens at most (default 200), n-gram blocking by
    ``opts.no_repeat_ngram``. Checks happen here, before the first token: a prompt too long for the
    context (without ``slide``) raises :class:`ConfigError`."""
    cfg, tok = run.cfg, run.tokenizers.src
    cfg.kind.check_does("generate", run.path)
    ids = prompt_ids(cfg, tok, prompt)
    ctx = lm_context(cfg)
    if not slide:
        check_prompt_fits(cfg, ids)
    tokens = strategy_for(opts).stream(run.model, ids, SearchSpec(opts, run.tokenizers.specials),
                                       new_token_limit(opts, "generate"), ctx)

    def stream() -> Iterator[str]:
        text = TextStream(tok, ids)
        device = model_device(run.model)
        while True:
            with kernels(device, run.precision):  # per token: nothing is held while the caller has the stream
                t = next(tokens, None)
            if t is None:
                break
            yield text.add(t)
        yield text.finish()

    return stream()


def fits_in_batch(run: Run, prompt: str | Sequence[int], max_new_tokens: int) -> bool:
    """Whether ``prompt`` and ``max_new_tokens`` new tokens fit the model's positions, so that the prompt can be
    generated in a batch with others (:func:`stream_rows`; longer ones need :func:`generate_text`'s window)."""
    return len(prompt_ids(run.cfg, run.tokenizers.src, prompt)) + max_new_tokens <= lm_context(run.cfg)


def stream_rows(run: Run, prompts: Sequence[str | Sequence[int]], opts: DecodeOptions, max_new_tokens: Sequence[int],
                seeds: Sequence[int | None]) -> Iterator[list[str | None]]:
    """:func:`generate_text` for several prompts in one batch (a server's concurrent requests): per generated
    token, one list with each row's text piece (None once the row has ended), then a last list with each row's
    held-back tail. Row r draws with ``seeds[r]`` and stops after ``max_new_tokens[r]`` tokens; the other options
    are ``opts``'. A row's pieces are those :func:`generate_text` streams for it alone (up to float rounding);
    every prompt must :func:`fits_in_batch`."""
    cfg, tok = run.cfg, run.tokenizers.src
    ids = [prompt_ids(cfg, tok, p) for p in prompts]
    spec = SearchSpec(opts, run.tokenizers.specials)
    steps = strategy_for(opts).stream_rows(run.model, ids, spec, list(max_new_tokens), list(seeds))
    texts = [TextStream(tok, i) for i in ids]
    device = model_device(run.model)
    while True:
        with kernels(device, run.precision):  # per step: nothing is held while the caller has the pieces
            step = next(steps, None)
        if step is None:
            break
        yield [None if t is None else texts[r].add(t) for r, t in enumerate(step)]
    yield [t.finish() for t in texts]


# Summaries ---------------------------------------------------------------------------------------------


def summarize_lm(run: Run, documents: Sequence[str], opts: DecodeOptions) -> list[str]:
    """Greedy summaries from a "document <sep> summary" language model, one per document; with
    ``opts.no_repeat_ngram`` n > 0 a summary never repeats one of its own n-grams (it may copy the document's)."""
    cfg, tok = run.cfg, run.tokenizers.src
    ctx = lm_context(cfg)
    sep = separator_ids(tok, cfg.data.separator)
    stops = (cfg.data.separator.strip(), "\n")  # a second separator or a new line ends the summary too
    max_new = new_token_limit(opts, "summarize")
    reserve = min(max_new, ctx // 4)
    spec = SearchSpec(opts.replace(sample=False), run.tokenizers.specials)  # greedy
    out = []
    for doc in documents:
        doc = collapse_whitespace(doc)
        if not doc:
            out.append("")
            continue
        found: list[int] = []
        text = ""
        for t in strategy_for(spec.options).stream(run.model, lm_prompt(tok, doc, sep, ctx - reserve), spec, max_new,
                                                    ctx):
            found.append(t)
            text = tok.decode(found)
            if any(s in text for s in stops):
                break
        for s in stops:
            text = text.split(s)[0]
        out.append(collapse_whitespace(text))
    return out


def summarize_seq2seq(run: Run, documents: Sequence[str], opts: DecodeOptions) -> list[str]:
    """Summaries from an encoder-decoder run: documents cut to its positions, the options' search, at most
    ``opts.max_new_tokens`` (default 64) summary tokens."""
    from aiayn.decode.translator import Translator

    tr = Translator(run)
    opts = opts.replace(max_len_a=0.0, max_len_b=new_token_limit(opts, "summarize"))
    ids, cut = tr.encode_sources([collapse_whitespace(d) for d in documents])
    if cut:
        log.info("%d of %d documents cut to the model's %d source tokens", len(cut), len(documents),
                 tr.max_source_tokens)
    todo = [i for i, s in enumerate(ids) if s is not None]
    found = decode_ids(run.model, [ids[i] for i in todo], SearchSpec(opts, run.tokenizers.specials), scores=False)
    out = [""] * len(documents)
    for i, hyps in zip(todo, found):
        out[i] = collapse_whitespace(run.tokenizers.tgt.decode(hyps[0].tokens))
    return out


def summarize(run: Run, documents: Iterable[str], options: DecodeOptions | None = None, **overrides) -> list[str]:
    """One summary per document (see the module docstring), from either kind of summarization run.
    Options: the run's ``decode`` section, then ``options``, then the non-None ``overrides``."""
    documents = text_list(documents, "documents")
    opts = merged_options(run.cfg.decode, options, **overrides)
    if opts.max_new_tokens is not None and opts.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={opts.max_new_tokens}: a summary needs at least 1")
    summarizer = summarizer_of(run)
    if summarizer.greedy and (overrides.get("beam") not in (None, 1) or opts.sample):
        raise ConfigError("a language-model run summarizes greedily (no --beam, no --sample); beam search "
                          "needs an encoder-decoder (task: summarization) run")
    with kernels(model_device(run.model), run.precision):
        return summarizer.run(run, documents, opts)


@dataclass(frozen=True)
class Summarizer:
    """How a run summarizes, by what it was trained on: ``run(run, documents, opts)`` the summaries; ``how(opts)``
    its decoding in words (a ROUGE result's record); ``greedy``: a beam or sampling asked of it is refused."""

    run: Callable[[Run, Sequence[str], DecodeOptions], list[str]]
    how: Callable[[DecodeOptions], str]
    greedy: bool = False


# Who summarizes what a run was trained on (its data.pipeline.Corpus): a language model of "document <sep>
# summary" rows continues the separator; an encoder-decoder of (document, summary) pairs decodes its summary.
# A run of running text has none.
SUMMARIZERS: dict[str, Summarizer] = {
    "rows": Summarizer(summarize_lm, lambda opts: "lm: greedy after 'document <sep>'", greedy=True),
    "documents": Summarizer(summarize_seq2seq, lambda opts: f"encoder-decoder: beam {opts.beam}")}


def summarizer_for(cfg: Config) -> Summarizer | None:
    """The :class:`Summarizer` of the corpus runs of ``cfg`` train on (:data:`SUMMARIZERS`); None for one that
    holds no summaries (a language model's running text)."""
    return SUMMARIZERS.get(corpus_of(cfg).name)


def summarizer_of(run: Run) -> Summarizer:
    """The :class:`Summarizer` of ``run``'s corpus; a one-line ConfigError for a run that cannot summarize."""
    run.cfg.kind.check_does("summarize", run.path)
    summarizer = summarizer_for(run.cfg)
    if summarizer is None:
        raise ConfigError(f"{run.path} is a language model of running text, not of 'document <sep> summary' "
                          "sequences (data.dataset xsum or JSONL files): it cannot summarize")
    return summarizer


def read_documents(path: str | None, field: str = "document") -> list[str]:
    """Documents from ``path`` (stdin when None or ``-``): one per line, or the ``field`` of each row of a
    ``.jsonl`` / ``.jsonl.gz`` file."""
    from aiayn.data.corpus import read_jsonl_rows, read_lines, read_stdin_lines

    if path is not None and (path.endswith(".jsonl") or path.endswith(".jsonl.gz")):
        docs = []
        for n, row in enumerate(read_jsonl_rows(path), start=1):
            if not isinstance(row.get(field), str):
                raise DataError(f"{path}: row {n}: no string field {field!r}")
            docs.append(row[field])
        return docs
    return read_stdin_lines() if path in (None, "-") else read_lines(path)


class Generator(LoadedRun):
    """A language-model run with its tokenizer and decoding defaults (what ``aiayn.load`` returns for one).

    ``generate(prompt)`` returns the continuation; ``stream(prompt)`` yields it piece by piece;
    ``summarize(documents)`` works for runs trained on "document <sep> summary" sequences."""

    def __init__(self, run: Run) -> None:
        run.cfg.kind.check_does("load_generator", run.path)
        super().__init__(run)

    def stream(self, prompt: str | Sequence[int] = "", options: DecodeOptions | None = None, slide: bool = False,
               **overrides) -> Iterator[str]:
        """The continuation of ``prompt``, one text piece per token (see :func:`generate_text`)."""
        return generate_text(self.run, prompt, self.options(options, **overrides), slide)

    def generate(self, prompt: str = "", options: DecodeOptions | None = None, slide: bool = False,
                 **overrides) -> str:
        """The continuation of ``prompt`` (without the prompt): greedy unless ``sample=True``."""
        return "".join(self.stream(prompt, options, slide, **overrides))

    def warm_up(self) -> None:
        self.generate("", max_new_tokens=1)

    def summarize(self, documents: Iterable[str], options: DecodeOptions | None = None, **overrides) -> list[str]:
        """One summary per document (a "document <sep> summary" language model): :func:`summarize`."""
        return summarize(self.run, documents, options, **overrides)
