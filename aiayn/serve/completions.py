"""OpenAI's completions, read and written: the checked request (:func:`completion_request`), its decoding options
(:func:`completion_options`), the text cut at its stop strings as it comes (:class:`StopScan`,
:class:`CompletionText`), and the language model's completions on the batcher's worker thread (:func:`run_lm`,
:func:`run_scored`). The routes that answer with them are :mod:`aiayn.serve.openai_api`'s.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Any

from aiayn.config import DecodeOptions
from aiayn.decode.generate import Generator
from aiayn.errors import ConfigError
from aiayn.serve.errors import OpenAIError
from aiayn.serve.schemas import Limits
from aiayn.serve.scores import MAX_LOGPROBS, scored_choices

OPENAI_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "user",
                 "echo", "logprobs", "presence_penalty", "frequency_penalty", "best_of", "suffix", "logit_bias",
                 "stream_options", *("top_k", "min_p", "repetition_penalty", "truncate_prompt_tokens"))
# vLLM's sampling extras that OpenAI's clients send as top-level fields (extra_body): top_k and
# truncate_prompt_tokens are done; min_p and repetition_penalty are taken at the value that changes nothing.
VLLM_NEUTRAL = (("min_p", (None, 0, 0.0)), ("repetition_penalty", (None, 1, 1.0)))
# OpenAI takes 4 stop strings; lm-evaluation-harness sends a task's every `until` string (vLLM takes any number)
MAX_STOPS = 64
Job = tuple[int, Any, int | None]  # (choice index, prompt: a text or token ids, seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """A checked ``/v1/completions`` request."""

    prompts: list[str] | list[list[int]]  # texts, or token ids (a client that tokenizes, as lm-eval does)
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    echo: bool = False
    logprobs: int | None = None  # top log-probabilities per token (None: no logprobs object)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    sample_asked: bool = False  # temperature or top_p given: a translation run samples only then
    options: DecodeOptions | None = None  # the decoding options, checked before any answer (completion_options)
    top_k: int | None = None  # vLLM's top_k (None: not given, the server's own; 0: off, as vLLM's -1 and 0 say)
    truncate: int | None = None  # vLLM's truncate_prompt_tokens: only the prompt's last k tokens are read

    @property
    def scored(self) -> bool:
        """Whether the answer needs the log-probability path (:mod:`aiayn.serve.scores`)."""
        return self.echo or self.logprobs is not None


def number_field(body: dict[str, Any], name: str, default: float, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        value = default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise OpenAIError(400, f"{name}: expected {'an integer' if integer else 'a number'}", param=name,
                          code="invalid_type")
    if not low <= value <= high:
        raise OpenAIError(400, f"{name}={value}: expected {low:g} to {high:g}", param=name, code="out_of_range")
    return value


def is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def prompts_of(prompt: Any) -> list[str] | list[list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of token ids, a list of lists of ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(is_id(i) for i in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(
                isinstance(p, list) and p and all(is_id(i) for i in p) for p in prompt):
            return prompt
    raise OpenAIError(400, "prompt: expected a string, a list of strings, a list of token ids or a list of such "
                           "lists (none empty)", param="prompt", code="invalid_type")


def refuse_unsupported(body: dict[str, Any], neutral_values: tuple[tuple[str, tuple], ...]) -> None:
    """Fields taken only at the value that asks for nothing: a request for what this server does not do is refused
    (400 naming the field), not silently ignored (a penalty of 1.5 would otherwise give the text of 0)."""
    for name, neutral in neutral_values:
        value = body.get(name)
        if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            takes = [json.dumps(n) for n in neutral if n is not None][:1]
            raise OpenAIError(400, f"{name} is not supported by this server" + (
                f" (only {takes[0]}, which asks for nothing)" if takes else ""), param=name, code="unsupported")


def vllm_extras(body: dict[str, Any]) -> tuple[int | None, int | None]:
    """(top_k, truncate_prompt_tokens) of vLLM's extras (top_k: None when not given, 0 for vLLM's -1 and 0, which
    turn it off; truncation -1, the model's context, is 0 here: :func:`truncated` leaves room for new tokens);
    min_p and repetition_penalty refused unless neutral."""
    refuse_unsupported(body, VLLM_NEUTRAL)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise OpenAIError(400, "top_k: expected an integer (-1 or 0: off)", param="top_k", code="invalid_type")
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < -1
                                 or truncate == 0):
        raise OpenAIError(400, "truncate_prompt_tokens: expected a positive integer (the prompt's last k tokens are "
                               "read) or -1 (the model's context)", param="truncate_prompt_tokens",
                          code="invalid_type")
    return (None if top_k is None else max(top_k, 0)), (0 if truncate == -1 else truncate)


def checked_prompts(body: dict[str, Any], limits: Limits, param: str = "prompt") -> list[str] | list[list[int]]:
    """A completions request's prompts (``prompt`` required, as vLLM asks for it: OpenAI's implicit start of a
    document is no prompt a client meant to send), within the server's count and length limits; ``param``: what
    the client sent them as, named by the errors (``messages`` for a chat rendered into a prompt)."""
    if body.get("prompt") is None:
        raise OpenAIError(400, "prompt: required (a string, a list of strings, a list of token ids or a list of such "
                               "lists)", param="prompt", code="missing_required_parameter")
    prompts = prompts_of(body["prompt"])
    if len(prompts) > limits.max_sentences:
        raise OpenAIError(400, f"prompt: {len(prompts)} prompts, the limit is {limits.max_sentences} per request "
                               "(the server's aiayn serve --max-sentences)", param="prompt", code="out_of_range")
    for p in prompts:
        if len(p) > limits.max_chars:
            what = "the rendered chat is " if param != "prompt" else ""
            raise OpenAIError(400, f"{param}: {what}{len(p)} characters, the limit is {limits.max_chars}",
                              param=param, code="out_of_range")
    return prompts


def completion_request(body: dict[str, Any], limits: Limits, param: str = "prompt") -> Completion:
    """The checked fields of an OpenAI completions request (unknown fields refused by name; the prompts:
    :func:`checked_prompts`, their errors naming ``param``)."""
    unknown = sorted(set(body) - set(OPENAI_FIELDS))
    if unknown:
        raise OpenAIError(400, f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    refuse_unsupported(body, (("best_of", (None, 1)), ("suffix", (None, "")), ("logit_bias", (None, {})),
                              ("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0))))
    top_k, truncate = vllm_extras(body)
    prompts = checked_prompts(body, limits, param)
    stop = body.get("stop")
    stops = () if stop is None else ((stop,) if isinstance(stop, str) else stop)
    if (not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise OpenAIError(400, f"stop: expected a string or up to {MAX_STOPS} non-empty strings", param="stop",
                          code="invalid_type")
    n = number_field(body, "n", 1, 1, limits.max_nbest, integer=True)
    if n * len(prompts) > limits.max_sentences:
        raise OpenAIError(400, f"n x prompts = {n * len(prompts)} completions, the limit is {limits.max_sentences} "
                               "per request (the server's aiayn serve --max-sentences)", param="n", code="out_of_range")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise OpenAIError(400, "seed: expected a non-negative integer", param="seed", code="invalid_type")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError(400, "stream: expected a boolean", param="stream", code="invalid_type")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise OpenAIError(400, "stream_options: only with stream true, and only {'include_usage': bool}",
                          param="stream_options", code="invalid_type")
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise OpenAIError(400, "echo: expected a boolean", param="echo", code="invalid_type")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = number_field(body, "logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    if (echo or logprobs is not None) and (stream or stops):
        name = "stream" if stream else "stop"
        raise OpenAIError(400, f"echo and logprobs are not supported with {name} by this server", param=name,
                          code="unsupported")
    # max_tokens 0 asks for the prompt's log-probabilities only (echo), as lm-evaluation-harness may
    max_tokens = number_field(body, "max_tokens", 16, 0 if echo else 1, limits.max_new_tokens, integer=True)
    asked = body.get("temperature") is not None or body.get("top_p") is not None
    return Completion(prompts=prompts, max_tokens=max_tokens,
                      temperature=float(number_field(body, "temperature", 1.0, 0.0, 2.0)),
                      top_p=float(number_field(body, "top_p", 1.0, 0.0, 1.0)), n=n, stop=tuple(stops), seed=seed,
                      stream=stream, echo=echo, logprobs=logprobs,
                      include_usage=bool(options and options.get("include_usage")), sample_asked=asked, top_k=top_k,
                      truncate=truncate)


def truncated(ids: list[int], prompt: str | list[int], keep: int | None, room: int) -> str | list[int]:
    """``prompt``, or (vLLM's ``truncate_prompt_tokens``: ``keep`` > 0, or 0 for -1) the last ``keep`` of its
    ``ids`` when it has more. -1 reads as the model's context less what must fit beside the prompt (``room``: one
    new token, or ``max_tokens`` with echo or logprobs), so that a prompt cut so is always answered."""
    if keep is None:
        return prompt
    keep = keep or room
    return ids[-keep:] if len(ids) > keep else prompt


def check_context(prompt_tokens: int, new_tokens: int, context: int, param: str, scored: bool) -> None:
    """A 400 ``context_length_exceeded`` (OpenAI's code) when a prompt of ``prompt_tokens`` and ``new_tokens`` do
    not fit the model's ``context``, naming what the client can change: ``max_tokens`` when the prompt alone
    fits, else the prompt (``param``), which vLLM's ``truncate_prompt_tokens`` cuts to its last tokens. With echo
    or logprobs (``scored``) the new tokens must fit too (scores read every token before: no sliding window);
    a plain completion needs room for one new token, then slides."""
    if prompt_tokens + new_tokens <= context:
        return
    if scored and prompt_tokens <= context:
        raise OpenAIError(400, f"max_tokens: the prompt is {prompt_tokens} tokens and max_tokens {new_tokens}, but "
                               f"with echo or logprobs both must fit the model's context of {context} tokens: send "
                               f"max_tokens {context - prompt_tokens} or less, or truncate_prompt_tokens to read only "
                               "the prompt's last tokens", param="max_tokens", code="context_length_exceeded")
    room = context - (new_tokens if scored else 1)
    raise OpenAIError(400, f"{param}: the prompt is {prompt_tokens} tokens, past the model's context of {context} "
                           f"with room for {'max_tokens' if scored else 'a new token'}: shorten it, or send "
                           f"truncate_prompt_tokens={max(room, 1)} to read only its last {max(room, 1)} tokens",
                      param=param, code="context_length_exceeded")


def completion_options(c: Completion, base: DecodeOptions, language_model: bool) -> Completion:
    """``c`` with its decoding options on the run's ``base``. A language model samples at ``temperature`` > 0 (0:
    greedy); a translation run keeps its own search unless the request asks for sampling (``c.sample_asked`` and a
    ``temperature`` > 0: OpenAI's default temperature of 1 does not count). ``top_p`` below 1 filters a draw. Every
    sampling number goes through :class:`DecodeOptions`, the one validator of the command line, the recipes and
    every route, whether this request samples or not; one it refuses (``top_p`` 0, a ``temperature`` below 1e-6)
    is a 400 naming the field, before any streamed 200 is sent."""
    top_p = c.top_p if c.top_p < 1 else None
    sample = c.temperature > 0 and (language_model or c.sample_asked)
    overrides: dict[str, Any] = {"top_k": c.top_k} if c.top_k else {}  # not given: the server's; 0: off (below)
    if sample:
        overrides.update(sample=True, temperature=c.temperature, top_p=top_p)
    elif language_model:
        overrides.update(sample=False, top_p=top_p)
    if language_model:
        overrides["max_new_tokens"] = c.max_tokens
    try:
        base.replace(temperature=c.temperature, top_p=top_p)  # checked even where the run's own search ignores them
        options = base.replace(**overrides)  # replace() keeps an option it is given None for: off is set apart
        return dataclasses.replace(c, options=dataclasses.replace(options, top_k=None) if c.top_k == 0 else options)
    except ConfigError as e:
        message = str(e).removeprefix("decode.")
        param = next((p for p in ("temperature", "top_p") if message.startswith(p)), None)
        raise OpenAIError(400, message, param=param, code="out_of_range") from None


class StopScan:
    """Text pieces in, the part that is final out: cut at the first stop string, and hold back a tail that may
    still become one (a stream must never show text that a stop sequence would have removed)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.held, self.stopped = stops, "", False

    def add(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self.held = True, ""
            return text[:min(cuts)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def finish(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


class CompletionText:
    """One completion's text as a language model's pieces come (its tokens' text, then the held-back tail):
    cut at its stop strings, each final part passed to ``emit`` (a stream) as soon as it is final."""

    def __init__(self, c: Completion, emit: Callable[[str], None] | None,
                 cancelled: threading.Event | None = None) -> None:
        self.scan, self.emit, self.limit = StopScan(c.stop), emit, c.max_tokens
        self.cancelled = cancelled  # set when a streamed answer's client went away (aiayn.serve.streams)
        self.parts: list[str] = []
        self.pieces = 0

    @property
    def done(self) -> bool:
        """Whether no more pieces are wanted: a stop string was reached, or the client went away."""
        return self.scan.stopped or (self.cancelled is not None and self.cancelled.is_set())

    def add(self, piece: str) -> None:
        if self.done:
            return
        self.pieces += 1
        self._out(self.scan.add(piece))

    def _out(self, text: str) -> None:
        if text:
            self.parts.append(text)
            if self.emit:
                self.emit(text)

    def result(self, prompt_tokens: int) -> dict[str, Any]:
        """The completion's choice fields and token counts (call once, after the last piece)."""
        tokens = self.pieces - (0 if self.scan.stopped else 1)  # the last piece is the held-back tail
        self._out(self.scan.finish())
        finish = "stop" if self.scan.stopped or tokens < self.limit else "length"
        return {"text": "".join(self.parts), "finish_reason": finish, "prompt_tokens": prompt_tokens,
                "completion_tokens": max(tokens, 0)}




def choices_for(c: Completion) -> list[Job]:
    """(choice index, prompt, seed) of every completion: n per prompt, in OpenAI's order."""
    out = []
    for p_i, prompt in enumerate(c.prompts):
        for k in range(c.n):
            seed = None if c.seed is None else c.seed + p_i * c.n + k
            out.append((p_i * c.n + k, prompt, seed))
    return out


def lm_group(c: Completion) -> tuple:
    """Completions that may share a batch: the same sampling options (seeds, limits and stops are per row)."""
    return ("completion", c.temperature, c.top_p, c.top_k)


def lm_cost(c: Completion, jobs: list[Job]) -> int:
    """What the rows hold in a batch (the batcher's --max-batch-tokens bounds merged requests): prompt
    characters as an upper bound of their tokens, plus the new tokens."""
    return sum(len(p) + 1 + c.max_tokens for _, p, _ in jobs)


def usage_of(c: Completion, results: list[dict[str, Any]], jobs: list[Job]) -> dict[str, int]:
    """Tokens read (each prompt once, however many choices) and written."""
    usage = {"prompt_tokens": sum(r["prompt_tokens"] for r, (i, _, _) in zip(results, jobs) if i % c.n == 0),
             "completion_tokens": sum(r["completion_tokens"] for r in results)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


def sent_tokens(gen: Generator, prompt: str | list[int]) -> int:
    """The prompt tokens a client sent: an empty prompt sent none (the model starts from the start of a text, which
    the client did not send and is not counted)."""
    from aiayn.decode.generate import prompt_ids

    return 0 if prompt == "" else len(prompt_ids(gen.cfg, gen.tokenizers.src, prompt))


def run_one(gen: Generator, prompt: str, c: Completion, seed: int | None, emit: Callable[[str], None] | None,
            cancelled: threading.Event | None) -> dict[str, Any]:
    """Generate one completion by a language model alone (worker thread; the sliding window when the text
    outgrows the context); ``emit`` gets each final piece as it comes; ``cancelled`` stops it at the next
    token (the generator decodes one token per piece asked for)."""
    out = CompletionText(c, emit, cancelled)
    pieces = gen.stream(prompt, c.options.replace(seed=seed))
    prompt_tokens = sent_tokens(gen, prompt)
    for piece in pieces:
        out.add(piece)
        if out.done:
            break
    return out.result(prompt_tokens)


def run_lm(gen: Generator, items: list[tuple[str, int | None, Completion, Any, Any]]) -> list[dict[str, Any]]:
    """Completions of concurrent requests by a language model in one batch (worker thread): items are
    (prompt, seed, request, emit or None, cancelled event or None); rows too long for a batch (they need the
    sliding window) run alone. Each row's text, stop and token count are what :func:`run_one` gives it alone.
    The batch decodes until every row is done: ended, stopped, or cancelled by its client."""
    from aiayn.decode.generate import fits_in_batch, stream_rows

    results: list[dict[str, Any] | None] = [None] * len(items)
    rows = [k for k, (p, _, c, _, _) in enumerate(items) if fits_in_batch(gen.run, p, c.max_tokens)]
    if rows:
        opts = items[rows[0]][2].options  # one group: the same temperature, top_p and top_k
        outs = [CompletionText(items[k][2], items[k][3], items[k][4]) for k in rows]
        for pieces in stream_rows(gen.run, [items[k][0] for k in rows], opts,
                                  [items[k][2].max_tokens for k in rows], [items[k][1] for k in rows]):
            for out, piece in zip(outs, pieces):
                if piece is not None:
                    out.add(piece)
            if all(out.done for out in outs):
                break
        for out, k in zip(outs, rows):
            results[k] = out.result(sent_tokens(gen, items[k][0]))
    for k, (p, seed, c, emit, cancelled) in enumerate(items):  # after the batch: those that need the window
        if results[k] is None:
            results[k] = run_one(gen, p, c, seed, emit, cancelled)
    return results


def run_scored(gen: Generator, items: list[tuple[str | list[int], int | None, Completion]]) -> list[dict[str, Any]]:
    """Echo / logprobs choices (worker thread): each one's completion by its own search, the log-probabilities of
    all of them in shared forward passes (:func:`aiayn.serve.scores.scored_choices`)."""
    return scored_choices(gen.run, [(prompt, c.options.replace(seed=seed), c.max_tokens, c.echo, c.logprobs)
                                    for prompt, seed, c in items])
