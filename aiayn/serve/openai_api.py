"""OpenAI's completions and chat completions (with vLLM's tokenizer routes) over aiayn's runs, so that the ``openai``
package, lm-evaluation-harness and the tools built on them work against ``aiayn serve`` unchanged. docs/serve.md's
protocol table lists every difference from the originals.

===============================  ==================================================================================
``GET /v1/models``               the served run as one model (another ``model`` named: 404)
``POST /v1/completions``         ``prompt`` (strings or token ids), ``max_tokens``, ``temperature``, ``top_p``, ``n``,
                                 ``stop``, ``seed``, ``stream`` (server-sent events ending in ``data: [DONE]``),
                                 ``stream_options.include_usage``, ``echo`` and ``logprobs``
                                 (:mod:`aiayn.serve.scores`); ``usage`` in tokens (:mod:`aiayn.serve.completions`)
``POST /v1/chat/completions``    chat completions, through the run's own template (:mod:`aiayn.serve.chat_template`)
                                 or the default one (:mod:`aiayn.serve.chat`)
``/tokenize``, ``/detokenize``,  vLLM's tokenizer routes, as lm-evaluation-harness's remote tokenizer reads them
``GET /tokenizer_info``          (:mod:`aiayn.serve.tokenizer_routes`)
===============================  ==================================================================================

Errors come in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (:mod:`aiayn.serve.errors`);
the API key is a bearer token (:mod:`aiayn.serve.service`). What the server does not do is refused, never
silently ignored.

Translation runs answer both completions APIs too: the prompt (or the last user message) is the sentence to
translate, the completion its translation by the run's own search, unless the request asks for sampling
(``temperature`` > 0 given, or ``top_p`` without it). On a translation run a completion goes through
:meth:`aiayn.serve.service.Service.translate`: the batcher merges it with concurrent requests of every API that
decode with the same options (LibreTranslate's, aiayn's /v1/translate, other completions).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiayn.decode.generate import lm_context, prompt_ids
from aiayn.serve.chat import ChatShape, Shape, TextShape, chat_request, conversation_prompt, last_user_message
from aiayn.serve.chat_template import ChatTemplate, load_chat_template
from aiayn.serve.completions import (
    Completion,
    Job,
    StopScan,
    check_context,
    choices_for,
    completion_options,
    completion_request,
    lm_cost,
    lm_group,
    run_lm,
    run_scored,
    truncated,
    usage_of,
)
from aiayn.serve.errors import OpenAIError, openai_stream_error
from aiayn.serve.routes import RouteTable, route
from aiayn.serve.schemas import ApiError, parse_body, read_body, source_tokens
from aiayn.serve.scores import encode_with_specials
from aiayn.serve.service import Service, bearer
from aiayn.serve.streams import EventStream


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event of a streamed answer."""
    return ("data: " + json.dumps(body, ensure_ascii=False) + "\n\n").encode("utf-8")


class OpenAIRoutes(RouteTable):
    """OpenAI's routes over ``svc``: the run is the one model, named by its directory (vLLM's tokenizer routes:
    :class:`aiayn.serve.tokenizer_routes.TokenizerRoutes`)."""

    protocol = "openai"
    claims = ("/v1/",)  # any other /v1/ path (OpenAI's clients call many): its 404 in OpenAI's shape

    def __init__(self, svc: Service) -> None:
        self.svc = svc
        self.model_id = svc.run.path.name
        self.created = int(time.time())
        self.completer = COMPLETIONS[svc.kind.loader](self)  # what a completion is on this run

    def authorize(self, request: Request) -> None:
        if not self.svc.key_matches(bearer(request)):
            raise OpenAIError(401, "Incorrect API key provided", code="invalid_api_key",
                              kind="invalid_request_error")

    async def body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, once its key is checked."""
        self.authorize(request)
        return parse_body(await read_body(request, self.svc.limits), self.svc.limits)

    @route("/v1/models", "GET")
    async def models(self, request: Request) -> Response:
        self.authorize(request)
        names = [self.model_id, *self.svc.choices.aliases]  # the run first: the name its answers carry
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": self.created,
                                                         "owned_by": "aiayn"} for name in names]})

    @route("/v1/completions", "POST")
    async def completions(self, request: Request) -> Response:
        body = await self.body(request)
        c = completion_request(body, self.svc.limits)
        self.check_model(body)
        return await self.respond(c, TextShape())

    @route("/v1/chat/completions", "POST")
    async def chat_completions(self, request: Request) -> Response:
        body = await self.body(request)
        prompt, fields, strip = self.completer.chat_prompt(*chat_request(body))
        c = completion_request({**fields, "prompt": prompt}, self.svc.limits, "messages")
        self.check_model(body)
        return await self.respond(c, ChatShape(strip_leading_space=strip))

    def template_ids(self, text: str) -> list[int]:
        """The ids of a prompt the run's chat template rendered: the special tokens' names in it read as those
        tokens (``<s>``, ``</s>``), as a Hugging Face tokenizer reads a rendered chat."""
        limit = self.svc.limits.max_chars
        if len(text) > limit:
            raise OpenAIError(400, f"messages: the chat template rendered {len(text)} characters, the limit is "
                                   f"{limit}", param="messages", code="out_of_range")
        ids = encode_with_specials(self.svc.run, text)
        if not ids:
            raise OpenAIError(400, "messages: the run's chat template rendered an empty prompt for these messages",
                              param="messages", code="chat_template_error")
        return ids

    def check_model(self, body: dict[str, Any]) -> None:
        """The ``model`` a request names must be one /v1/models lists: the run, or an alias (none named: the run)."""
        name = body.get("model")
        if name is not None and name != self.model_id and name not in self.svc.choices.aliases:
            raise OpenAIError(404, f"The model `{name}` does not exist (this server serves `{self.model_id}`: "
                                   "GET /v1/models; aiayn serve --model-alias NAME adds a name)", param="model",
                              code="model_not_found")

    def refuse_unserved(self) -> None:
        """A 400 ``wrong_task`` when the run's task answers no completion (a summarization run's)."""
        why = self.svc.kind.refusal("completions")
        if why is not None:
            raise OpenAIError(400, why, code="wrong_task")

    async def respond(self, c: Completion, shape: Shape) -> Response:
        """The answer to a checked completion in ``shape``'s protocol: whole, or streamed as server-sent events."""
        self.refuse_unserved()
        # Every sampling number checked (completion_options), and the prompts: before batching (one request's bad
        # prompt must not fail the others in its batch) and before a stream's 200.
        c = completion_options(c, self.svc.decode, language_model=self.completer.language_model)
        # before batching, so that one request's bad prompt does not fail the others in its batch
        c = self.completer.check_prompts(c, shape.prompt_param)
        if c.stream:
            return await CompletionStream(self, c, shape).response()
        rid, when = shape.new_id(), int(time.time())
        jobs = choices_for(c)
        results = await self.completer.results(c, jobs)
        return JSONResponse({"id": rid, "object": shape.object, "created": when, "model": self.model_id,
                             "choices": [shape.choice(i, r) for r, (i, _, _) in zip(results, jobs)],
                             "usage": usage_of(c, results, jobs)})

    async def generate(self, c: Completion, jobs: list[Job], stream: CompletionStream | None
                       ) -> list[dict[str, Any]]:
        """A language model's completions through the batcher, merged with concurrent requests of the same
        sampling options; a ``stream`` gets each choice's text as it is decoded."""
        if stream is None:
            items = [(prompt, seed, c, None, None) for _, prompt, seed in jobs]
        else:
            items = [(prompt, seed, c, functools.partial(stream.text_chunk, index), stream.events.cancelled)
                     for index, prompt, seed in jobs]
        return await self.svc.batcher.run(lm_group(c), items, lm_cost(c, jobs),
                                          functools.partial(run_lm, self.svc.model))

    async def translate_choices(self, c: Completion, jobs: list[Job], cancelled: threading.Event | None = None
                                ) -> list[dict[str, Any]]:
        """Every choice of a completion on a translation run: the run's own search (every choice of a prompt is
        the same translation, decoded once) unless the request asks for sampling (a temperature > 0, or a top_p,
        given: OpenAI's default temperature of 1 does not count, since its clients send none), through the
        batcher; ``cancelled`` (a stream's) stops the search at its next step once the client went away."""
        base = c.options.replace(nbest=1)  # completion_options: the run's own search unless sampling is asked
        if not (c.sample_asked and c.temperature > 0):
            prompts = list(dict.fromkeys(p for _, p, _ in jobs))
            found, _ = await self.svc.translate(prompts, base, cancelled=cancelled)
            by_prompt = dict(zip(prompts, found))
            hyps = [by_prompt[p] for _, p, _ in jobs]
        else:
            # unseeded draws: one call for all, each row its own draw; seeded ones: one job whose draws each run
            # alone (a seeded draw must not depend on its batch), so the request's n choices take one queue place
            seeds = None if c.seed is None else [seed for _, _, seed in jobs]
            hyps, _ = await self.svc.translate([p for _, p, _ in jobs], base, seeds=seeds, cancelled=cancelled)
        out = []
        for (_, prompt, _), h in zip(jobs, hyps):
            scan = StopScan(c.stop)
            text = scan.add(h[0].text if h else "") + scan.finish()
            out.append({"text": text, "finish_reason": "stop", "completion_tokens": len(h[0].ids) if h else 0,
                        "prompt_tokens": len(self.svc.model.tokenizers.src.encode(prompt)) + 1})
        return out


class CompletionStream:
    """One streamed answer of a checked completion: OpenAI's chunks as server-sent events, through the one
    cancellation path of streamed answers (:class:`aiayn.serve.streams.EventStream`)."""

    def __init__(self, api: OpenAIRoutes, c: Completion, shape: Shape) -> None:
        self.api, self.c, self.shape = api, c, shape
        self.rid, self.when = shape.new_id(), int(time.time())
        self.jobs = choices_for(c)
        self.events = EventStream(api.svc.batcher.stats)
        self.filters = {index: shape.text_filter() for index, _, _ in self.jobs}

    async def response(self) -> Response:
        for index, _, _ in self.jobs:
            opening = self.shape.opening(index)
            if opening is not None:
                self.events.push(self.chunk(opening))
        # the headers are sent by the time a failure is known: it is said in the stream, as OpenAI does
        return await self.events.response(self.answered(), lambda e: sse(openai_stream_error(e)))

    def head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": self.shape.chunk_object, "created": self.when, "model": self.api.model_id}

    def chunk(self, choice: dict[str, Any]) -> bytes:
        body = {**self.head(), "choices": [choice]}
        return sse({**body, "usage": None} if self.c.include_usage else body)  # OpenAI's chunks, with usage asked

    def text_chunk(self, index: int, text: str) -> None:
        """Each final piece of a choice's text (from the worker thread)."""
        text = self.filters[index](text)
        if text:
            self.events.push(self.chunk(self.shape.delta(index, text, None)))

    async def answered(self) -> None:
        c, jobs = self.c, self.jobs
        results = await self.api.completer.stream(self)
        for r, (index, _, _) in zip(results, jobs):  # after every piece: the worker queued those first
            self.events.push(self.chunk(self.shape.delta(index, "", r["finish_reason"])))
        if c.include_usage:  # OpenAI's last chunk: no choices, the usage of the whole request
            self.events.push(sse({**self.head(), "choices": [], "usage": usage_of(c, results, jobs)}))


class Completions:
    """What a completion is on the served run: its prompts' checks (before batching), its results, its stream."""

    language_model: bool
    template: ChatTemplate | None = None  # a language model's own chat template

    def __init__(self, api: OpenAIRoutes) -> None:
        self.api = api

    def chat_prompt(self, turns: list[tuple[str, str]], fields: dict[str, Any]
                    ) -> tuple[str | list[int], dict[str, Any], bool]:
        """(the completion prompt, the request's other fields, whether the reply's leading white space is cut) of
        a chat's ``turns`` (:func:`aiayn.serve.chat.chat_request`)."""
        raise NotImplementedError


class TranslationCompletions(Completions):
    """What a completion is on a translation run: the prompt (or the last user message) is the sentence, the
    completion its translation (:meth:`OpenAIRoutes.translate_choices`), decoded whole."""

    language_model = False

    def chat_prompt(self, turns: list[tuple[str, str]], fields: dict[str, Any]
                    ) -> tuple[str | list[int], dict[str, Any], bool]:
        if not any(role == "user" for role, _ in turns):  # a run that answers no completion says that, not this
            self.api.refuse_unserved()
        return last_user_message(turns), fields, False

    def check_prompts(self, c: Completion, param: str = "prompt") -> Completion:
        """Refuse what only a language model does, and a prompt too long for the model (before a stream's 200: as
        OpenAI answers one, 400 context_length_exceeded naming the request's field; ``param``: what the request
        calls its prompt, ``messages`` on chat, whose last user message is the text)."""
        ids = [p for p in c.prompts if not isinstance(p, str)]
        if ids or c.scored or c.truncate is not None:
            what = ("token-id prompts" if ids else "echo and logprobs" if c.scored else "truncate_prompt_tokens")
            raise OpenAIError(400, f"{what} need a language-model run; this server runs a translation run",
                              param="truncate_prompt_tokens" if what == "truncate_prompt_tokens" else param,
                              code="unsupported")
        try:
            source_tokens(self.api.svc.model, c.prompts, "prompt" if param == "prompt" else "messages: the last user "
                                                                                         "message")
        except ApiError as e:
            message = e.message if param == "prompt" else e.message.replace("message[0]", "message", 1)
            raise OpenAIError(400, f"{message}: shorten it (a translation model reads one sentence)",
                              param=param, code="context_length_exceeded") from None
        return c

    async def results(self, c: Completion, jobs: list[Job]) -> list[dict[str, Any]]:
        return await self.api.translate_choices(c, jobs)

    async def stream(self, s: CompletionStream) -> list[dict[str, Any]]:
        """A translation is decoded whole: one event per choice."""
        results = await self.api.translate_choices(s.c, s.jobs, s.events.cancelled)
        for r, (index, _, _) in zip(results, s.jobs):
            s.text_chunk(index, r["text"])
        return results


class LanguageModelCompletions(Completions):
    """What a completion is on a language-model run: the prompt's continuation, or its scores (echo and
    logprobs), each token streamed as it is decoded."""

    language_model = True

    def __init__(self, api: OpenAIRoutes) -> None:
        super().__init__(api)
        self.template = load_chat_template(api.svc.run)  # the run's own (RUN/chat_template.jinja), or None

    def chat_prompt(self, turns: list[tuple[str, str]], fields: dict[str, Any]
                    ) -> tuple[str | list[int], dict[str, Any], bool]:
        if self.template is None:  # the default template: its reply follows "Assistant:" and a space
            prompt, fields = conversation_prompt(turns, fields)
            return prompt, fields, True
        # the run's own template knows its turns' ends (no stop of ours is added) and where its reply starts
        text = self.template.render([{"role": role, "content": text} for role, text in turns])
        return self.api.template_ids(text), fields, False

    def check_prompts(self, c: Completion, param: str = "prompt") -> Completion:
        """Each token-id prompt within the vocabulary, and each prompt within the context; returns ``c`` with
        each prompt cut to its last ``truncate_prompt_tokens`` tokens (vLLM's), where asked."""
        model = self.api.svc.model
        vocab = model.tokenizers.src.vocab_size
        for p in (p for p in c.prompts if not isinstance(p, str)):
            if max(p) >= vocab:
                raise OpenAIError(400, f"prompt: token id {max(p)} is not in the model's vocabulary of {vocab}",
                                  param="prompt", code="out_of_range")
        cfg, tok = model.cfg, model.tokenizers.src
        context = lm_context(cfg)
        new = c.max_tokens if c.scored else 1  # what must fit beside the prompt (then a plain completion slides)
        prompts = [truncated(prompt_ids(cfg, tok, p), p, c.truncate, max(context - new, 1)) for p in c.prompts]
        for prompt in prompts:
            check_context(len(prompt_ids(cfg, tok, prompt)), new, context, param, c.scored)
        return dataclasses.replace(c, prompts=prompts)

    async def results(self, c: Completion, jobs: list[Job]) -> list[dict[str, Any]]:
        if not c.scored:
            return await self.api.generate(c, jobs, None)
        # a request's prompts share forward passes (run_scored); requests are not merged: a merge would make each
        # lone request wait the batching window, and a harness sends its batch as one request
        svc = self.api.svc
        return await svc.batcher.run(None, [(p, s, c) for _, p, s in jobs], lm_cost(c, jobs),
                                     functools.partial(run_scored, svc.model))

    async def stream(self, s: CompletionStream) -> list[dict[str, Any]]:
        """Each token as it is decoded, from a shared batch."""
        return await self.api.generate(s.c, s.jobs, s)


# What a completion is, by what the run loads as (Task.loader): a summarization run loads as a translator, and
# its completions are refused first (Task.refusal("completions")).
COMPLETIONS: dict[str, type[TranslationCompletions | LanguageModelCompletions]] = {
    "translator": TranslationCompletions, "generator": LanguageModelCompletions}
