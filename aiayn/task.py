"""What a run's ``task`` (``translation``, ``summarization``, ``lm``) means, looked up once by name.

The recipe names its task as a string (the ``task:`` key); it resolves once to a :class:`Task` (``cfg.kind``:
:attr:`aiayn.config.Config.kind`), and the code that behaves differently per task calls what the task names
instead of asking it yes/no questions. The task stands on the ground floor (the config reads it), so behaviour
that needs the floors above is named here and registered on the floor it needs, fairseq's registries in small:

* its corpus (:meth:`Task.corpus`): what the pipeline reads, stores and batches, what a training checks first,
  how a generation prompt starts and who summarizes (:data:`aiayn.data.pipeline.CORPORA`);
* its model (:attr:`Task.architecture`): the class its runs build (:data:`aiayn.model.transformer.ARCHITECTURES`),
  which also says what an export target holds and how its attention is read;
* its validation (:attr:`Task.valid_scores`, :attr:`Task.weights_scores`: :data:`aiayn.train.validation.VALID_SCORES`);
* its evaluation (:attr:`Task.evaluator`: :data:`aiayn.eval.evaluate.EVALUATORS`);
* what ``aiayn.load`` gives (:attr:`Task.loader`), which the server maps to its route and completions
  (:data:`aiayn.serve.native.ROUTES`, :data:`aiayn.serve.openai_api.COMPLETIONS`), and what ``aiayn generate``
  decodes with (:attr:`Task.decoding`).

What only the task knows it answers itself: the work its runs refuse, in its own words (:meth:`Task.check_does`),
the config fields whose meaning is its own (:meth:`Task.check_config`), how its texts read (:meth:`Task.texts`), what
it says of a dataset it does not read (:meth:`Task.dataset_error`).
Which exports take it: each export target declares the tasks it takes (:mod:`aiayn.interop.registry`). A new task
that reuses these behaviours is one entry of :data:`TASKS`; a new behaviour is one entry in the table of its floor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from aiayn.errors import ConfigError, DataError, UserError


@dataclass(frozen=True, kw_only=True)
class Task:
    """One task's behaviour.

    ``encoder``: an encoder-decoder model (``Transformer``: a source, then a target), else a decoder-only language
    model (``DecoderOnlyLM``: one token stream, continued): :attr:`architecture`. ``translates``: its texts are
    sentences, read as written (:meth:`texts`; pre-tokenization is its own). ``loader``: what ``aiayn.load``
    returns (``translator`` or ``generator``; the server routes each to its own path). ``decoding``: what
    ``aiayn generate`` and the server's generation route decode with unless told otherwise."""

    name: str
    label: str  # how a message names a run of it
    encoder: bool
    translates: bool = False
    loader: str = "translator"
    decoding: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # The work its runs refuse, by name, and the one line each refusal says ({where}: the run or recipe asked,
    # {task}: its task's name): what the commands and the library ask through :meth:`check_does`.
    refuses: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # How ``aiayn evaluate`` scores its runs (:data:`aiayn.eval.evaluate.EVALUATORS`: pairs, summaries,
    # language_model), and the scores its outputs get beside BLEU and chrF.
    evaluator: str = "pairs"
    extra_scores: tuple[str, ...] = ()
    # What its runs train on (:data:`aiayn.data.pipeline.CORPORA`): of its data as written, and of (document,
    # summary) data (XSum, JSONL files): see :meth:`corpus`.
    corpora: tuple[str, str] = ("pairs", "pairs")
    # What its training's validation scores beside NLL (``train.eval_bleu``), and what choosing its inference
    # weights weighs beside NLL (:data:`aiayn.train.validation.VALID_SCORES`).
    valid_scores: tuple[str, ...] = ("bleu",)
    weights_scores: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name

    @property
    def architecture(self) -> str:
        """The model its runs build (:data:`aiayn.model.transformer.ARCHITECTURES`; what an export target holds)."""
        return "encoder-decoder" if self.encoder else "decoder-only"

    def corpus(self, documents: Callable[[], bool]) -> str:
        """The name of the corpus its runs train on (:data:`aiayn.data.pipeline.CORPORA`): a translation's
        (source, target) pairs, a summarizer's documents (cut to the model's positions), a language model's token
        stream, or its "document <sep> summary" rows when ``documents()`` (asked only then) says its data is
        (document, summary) pairs."""
        plain, of_documents = self.corpora
        return of_documents if plain != of_documents and documents() else plain

    def texts(self, pairs: Iterable[tuple[str, str]]) -> Iterable[tuple[str, str]]:
        """Its (source, target) texts as its runs read them: a translation's as written (a line is a sentence);
        documents and summaries on one line each (their line breaks are layout, :func:`collapse_whitespace`)."""
        if self.translates:
            return pairs
        return ((collapse_whitespace(a), collapse_whitespace(b)) for a, b in pairs)

    def split_error(self, split: str) -> str:
        """What its config's own files answer when asked for a split other than train and valid."""
        return f"split {split!r}: expected train or valid" + ("" if self.translates else " (files named in the config)")

    def dataset_error(self, name: str | None, known: Sequence[str]) -> UserError:
        """What a config of this task answers when its ``data.dataset`` (``name``) is not a corpus it reads
        (``known``: the named ones it reads): a language model names its own text file as the other way."""
        if self.encoder:
            return DataError(f"dataset {name!r} is not a {self.name} corpus (known: {', '.join(known)})")
        return ConfigError(f"data.dataset={name!r} is not a language-modelling corpus "
                           f"(task {self.name}: {', '.join(known)}, or data.train_src: a text file)")

    def refusal(self, work: str, where: object = "") -> str | None:
        """The one line a run of this task answers when asked for ``work`` it refuses (see :attr:`refuses`),
        naming ``where`` (the run directory, recipe or route); None: it does that work."""
        why = self.refuses.get(work)
        return None if why is None else why.format(where=where, task=self.name)

    def check_does(self, work: str, where: object) -> None:
        """A one-line :class:`ConfigError` when a run of this task is asked for ``work`` it refuses."""
        why = self.refusal(work, where)
        if why is not None:
            raise ConfigError(why)

    def check_config(self, pretokenize: str, shared_vocab: bool, share_embeddings: bool) -> None:
        """The config fields whose meaning depends on the task: pre-tokenization is a translation's; two
        vocabularies (``data.shared_vocab=false``) cannot share the embeddings of an encoder-decoder."""
        if pretokenize != "none" and not self.translates:
            raise ConfigError(f"data.pretokenize={pretokenize!r} is for translation, not task {self.name}")
        if not shared_vocab and share_embeddings and self.encoder:
            raise ConfigError("data.shared_vocab=false needs model.share_embeddings=false (two vocabularies)")


def collapse_whitespace(text: str) -> str:
    """``text`` with every whitespace run (newlines included) replaced by one space, stripped."""
    return " ".join(text.split())


_NOT_LM = "{where} is a {task} run"
_REFUSALS = MappingProxyType({  # the work only a translation does
    "table3": "{where}: Table 3 varies a translation model; this recipe's task is {task}",
    "sweep": "{where}: a sweep scores translations; this recipe's task is {task}",
    "libretranslate": "this server runs a {task} run; LibreTranslate's API needs a translation run (language "
                      "models answer /v1/completions)",
})
_ENCODER_DECODER = MappingProxyType({  # the work only a language model does
    "generate": _NOT_LM + ": `aiayn generate` needs a language model (use translate or summarize)",
    "load_generator": _NOT_LM + ", not a language model",
    "lm_route": "{where} needs a language-model run; this server runs a {task} run",
})

_TASKS: dict[str, Task] = {}
# Every task by name, in the order a config's error lists them (read-only: :func:`register_task` adds one).
TASKS: Mapping[str, Task] = MappingProxyType(_TASKS)


def register_task(task: Task) -> Task:
    """Add ``task`` under its name (once: a second task of the same name is a bug); a config may then name it."""
    if task.name in _TASKS:
        raise ValueError(f"task {task.name!r} is registered twice")
    _TASKS[task.name] = task
    return task


for _task in (
    Task(name="translation", label="translation", encoder=True, translates=True, weights_scores=("bleu",),
         refuses=MappingProxyType({**_ENCODER_DECODER, "summarize": _NOT_LM + ": use `aiayn translate`"})),
    # A language model samples at temperature 1 unless told otherwise: its greedy continuation loops.
    Task(name="lm", label="language-model (task lm)", encoder=False, loader="generator",
         decoding=MappingProxyType({"sample": True, "temperature": 1.0}),
         refuses=MappingProxyType({**_REFUSALS, "pairs": "a language-model corpus is a token stream, not pairs",
                                   "init_from": "language models: not supported",
                                   "load_translator": "{where} is a language-model run: load it with aiayn.load() "
                                                      "or `aiayn generate`"}),
         evaluator="language_model", corpora=("stream", "rows"), valid_scores=()),
    Task(name="summarization", label="summarization", encoder=True,
         refuses=MappingProxyType({**_ENCODER_DECODER, **_REFUSALS, "completions": "this server runs a {task} run; "
                                   "completions need a language model or a translation run"}), evaluator="summaries",
         extra_scores=("rouge",), corpora=("documents", "documents")),
):
    register_task(_task)


def task_named(name: str) -> Task:
    """The :class:`Task` of a config's ``task`` value (already validated by the config)."""
    return TASKS[name]
