"""What a run's ``task`` (``translation``, ``summarization``, ``lm``) means, looked up once by name.

The recipe names its task as a string (the ``task:`` key); everything that behaves differently per task asks the
:class:`Task` it resolves to (``cfg.kind``: :attr:`aiayn.config.Config.kind`) instead of comparing that string:
whether the model has an encoder, what ``aiayn.load`` returns, what ``aiayn generate`` decodes with by default
(which exports take it: each export target declares the tasks it takes, :mod:`aiayn.interop.registry`; which of
aiayn's own HTTP routes serves it: the server maps what ``aiayn.load`` returns to its route,
:data:`aiayn.serve.native.ROUTES`). A new task is one entry of :data:`TASKS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Task:
    """One task's behaviour.

    ``encoder``: an encoder-decoder model (``Transformer``: a source, then a target), else a decoder-only language
    model (``DecoderOnlyLM``: one token stream, continued). ``translates``: its outputs are translations (BLEU
    while training, LibreTranslate's API, Argos packages, sweeps and Table 3). ``summarizes``: an encoder-decoder
    of documents to summaries (documents cut to the model's length, ROUGE). ``loader``: what ``aiayn.load``
    returns (``translator`` or ``generator``; the server routes each to its own path). ``decoding``: what
    ``aiayn generate`` and the server's generation route decode with unless told otherwise."""

    name: str
    label: str  # how a message names a run of it
    encoder: bool
    translates: bool = False
    summarizes: bool = False
    loader: str = "translator"
    decoding: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __str__(self) -> str:
        return self.name


# In the order a config's error lists them.
TASKS: Mapping[str, Task] = MappingProxyType({t.name: t for t in (
    Task(name="translation", label="translation", encoder=True, translates=True),
    # A language model samples at temperature 1 unless told otherwise: its greedy continuation loops.
    Task(name="lm", label="language-model (task lm)", encoder=False, loader="generator",
         decoding=MappingProxyType({"sample": True, "temperature": 1.0})),
    Task(name="summarization", label="summarization", encoder=True, summarizes=True),
)})


def task_named(name: str) -> Task:
    """The :class:`Task` of a config's ``task`` value (already validated by the config)."""
    return TASKS[name]
