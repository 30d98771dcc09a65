"""What every route of ``aiayn serve`` shares: the loaded model, its batcher, the request limits and the API key.

Translations of every protocol go through :meth:`Service.translate`, so that the batcher merges concurrent
requests of aiayn's ``/v1/translate``, LibreTranslate's ``/translate`` and OpenAI's completions when they decode
with the same options.

API key (``aiayn serve --api-key KEY`` or ``$AIAYN_API_KEY``; off by default): every API request must then carry
it, as ``Authorization: Bearer KEY`` (OpenAI's clients, aiayn's own ``/v1/*``) or as the ``api_key`` field
(LibreTranslate's); compared in constant time (:meth:`Service.key_matches`). A missing or wrong key is 403 in the
protocol's error shape (401 on OpenAI's, as OpenAI answers).
"""

from __future__ import annotations

import dataclasses
import hmac
import threading
import time
from typing import Any

from starlette.requests import Request

from aiayn.config import DecodeOptions
from aiayn.decode.generate import Generator, generate_options
from aiayn.decode.translator import Translation, Translator
from aiayn.run.directory import Run
from aiayn.search import rows_per_source
from aiayn.serve.batcher import Batcher
from aiayn.serve.schemas import ApiError, Limits, source_tokens
from aiayn.task import Task


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


@dataclasses.dataclass(frozen=True)
class Choices:
    """What ``aiayn serve``'s operator chose beyond the run: ``decode``, decoding options that replace the run's
    ``decode`` section on every route (its decoding flags, by DecodeOptions field name); ``aliases``, other model
    names that OpenAI's routes answer to (``--model-alias``: a client's default name, e.g. LangChain's);
    ``split_sentences`` and ``libre_formatting``, whether LibreTranslate's routes translate a text sentence by
    sentence and format the answer as LibreTranslate does (both on unless ``--no-split-sentences``,
    ``--no-libre-formatting``)."""

    decode: dict[str, Any] = dataclasses.field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    split_sentences: bool = True
    libre_formatting: bool = True


@dataclasses.dataclass(kw_only=True)
class Service:
    """What the routes share: the loaded model, its batcher (``budget``: the source tokens x beam of one model
    call; ``max_wait_ms`` and ``max_queue`` as the batcher was built), the request limits, the API key (None:
    none asked) and the operator's :class:`Choices` (``decode``: the run's ``decode`` section with its decoding
    flags, what every route decodes with unless a request says otherwise)."""

    model: Translator | Generator
    batcher: Batcher
    limits: Limits
    api_key: str | None = None
    budget: int = 0
    max_wait_ms: float = 10.0
    max_queue: int = 256
    started: float = dataclasses.field(default_factory=time.time)
    choices: Choices = dataclasses.field(default_factory=Choices)

    def __post_init__(self) -> None:
        self.decode: DecodeOptions = self.model.cfg.decode.replace(**self.choices.decode)

    def generate_options(self) -> DecodeOptions:
        """The base of ``/v1/generate``: as ``aiayn generate``, sampling at temperature 1 unless the server's
        flags say otherwise (then the request's own options)."""
        return generate_options(self.model.cfg, self.choices.decode)

    @property
    def task(self) -> str:
        return self.model.cfg.task

    @property
    def kind(self) -> Task:
        return self.model.cfg.kind

    @property
    def run(self) -> Run:
        return self.model.run

    def key_matches(self, given: str | None) -> bool:
        """Whether ``given`` is the server's key (always, when the server has none); constant time."""
        if self.api_key is None:
            return True
        return given is not None and hmac.compare_digest(given.encode("utf-8"), self.api_key.encode("utf-8"))

    def check_key(self, request: Request) -> None:
        """aiayn's own API: the key as a bearer token (403 ``invalid_api_key`` else)."""
        if not self.key_matches(bearer(request)):
            raise ApiError(403, "invalid_api_key", "this server needs an API key: Authorization: Bearer KEY")

    async def translate(self, texts: list[str], opts: DecodeOptions, seeds: list[int] | None = None,
                        field: str = "text", cancelled: threading.Event | None = None
                        ) -> tuple[list[list[Translation]], Any]:
        """Translate ``texts`` through the batcher (merged with concurrent requests of the same options);
        returns the hypotheses of each text and the options used. A text too long for the model is a 413 naming
        ``field[i]`` (the request's own name of its texts). ``seeds``: one seeded draw per text, each decoded alone
        (a seeded draw must not depend on its batch) but all in one job, so one request takes one queue place.
        ``cancelled`` (a stream's): once set, the search stops at its next step if no other request shares it."""
        stop = self.batcher.call_cancelled
        tr: Translator = self.model
        opts = opts.replace(max_tokens=self.budget)
        cost = sum(n + 1 for n in source_tokens(tr, texts, field) if n) * rows_per_source(opts)
        if seeds is not None:
            draws = [opts.replace(sample=True, seed=seed) for seed in seeds]
            found = await self.batcher.run(None, list(zip(texts, draws)), max(cost, 1), lambda items: [
                tr.search([text], o, scores=True, stop=stop)[0] for text, o in items], cancelled)
            return found, opts
        # Seeded draws must not depend on who else is in the batch: such requests run alone.
        group = None if opts.sample and opts.seed is not None else ("translate", dataclasses.astuple(opts))
        found = await self.batcher.run(group, texts, max(cost, 1),
                                       lambda items: tr.search(items, opts, scores=True, stop=stop), cancelled)
        return found, opts
