"""OpenAI's chat completions over aiayn's runs, and the two shapes (legacy text, chat) of a completion's answer.

A chat request becomes one completion prompt (:func:`chat_request`, then the run's
:meth:`~aiayn.serve.openai_api.Completions.chat_prompt`):

* A language-model run that carries its own template (``RUN/chat_template.jinja``, Hugging Face's convention:
  :mod:`aiayn.serve.chat_template`) reads the conversation as that template renders it; the reply is what the
  model writes next, as it writes it, ending at its EOS, the request's ``stop`` or ``max_tokens``.
* A language-model run without one reads the conversation through this template::

      System: {content}\\n          (each message in order, its role capitalized)
      User: {content}\\n
      Assistant: {content}\\n
      Assistant:                    (the model continues from here)

  and the reply is what the model writes after ``Assistant:``, without its leading white space, ending before
  the first ``\\nUser:`` (the template's own stop, added to the request's ``stop``) or at ``max_tokens``.
* A translation run answers with the translation of the last ``user`` message (the others are ignored: a
  translation model reads one sentence).

The answers of both endpoints are built by a :class:`Shape`: :class:`TextShape` (``/v1/completions``) or
:class:`ChatShape` (``/v1/chat/completions``), so that every option and the streaming are one code path.
"""

from __future__ import annotations

import secrets
from typing import Any

from aiayn.serve.completions import refuse_unsupported
from aiayn.serve.errors import OpenAIError

CHAT_ONLY = ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "tools",
             "tool_choice", "parallel_tool_calls")
SHARED = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user",
          "presence_penalty", "frequency_penalty", "logit_bias",
          *("top_k", "min_p", "repetition_penalty", "truncate_prompt_tokens"))  # vLLM's extras
ROLES = ("system", "developer", "user", "assistant")
TEMPLATE_STOP = "\nUser:"


def _content(message: Any, i: int) -> tuple[str, str]:
    """(role, text) of one message; text parts of a list content are joined (other parts refused)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise OpenAIError(400, f"messages[{i}]: expected {{'role': one of {', '.join(ROLES)}, 'content': text}}",
                          param="messages", code="invalid_type")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise OpenAIError(400, f"messages[{i}].content: only text parts are supported", param="messages",
                              code="unsupported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise OpenAIError(400, f"messages[{i}].content: expected a string", param="messages", code="invalid_type")
    return message["role"], content


def chat_request(body: dict[str, Any]) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """(the conversation's turns, (role, text) each; the completion request's other fields) of a chat request: what
    the run's completions make a prompt of (:meth:`aiayn.serve.openai_api.Completions.chat_prompt`)."""
    unknown = sorted(set(body) - set(CHAT_ONLY) - set(SHARED))
    if unknown:  # as the completions route names it
        raise OpenAIError(400, f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
    refuse_unsupported(body, (("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("tools", (None, [])),
                              ("tool_choice", (None, "none")), ("parallel_tool_calls", (None,)),
                              ("response_format", (None, {"type": "text"}))))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages: expected a non-empty list of messages", param="messages",
                          code="invalid_type")
    turns = [_content(m, i) for i, m in enumerate(messages)]
    fields = {k: body[k] for k in SHARED if k in body}
    if body.get("max_completion_tokens") is not None:  # the newer name wins, as OpenAI reads them
        fields["max_tokens"] = body["max_completion_tokens"]
    return turns, fields


def last_user_message(turns: list[tuple[str, str]]) -> str:
    """What a translation run translates of a conversation: its last user message."""
    users = [text for role, text in turns if role == "user"]
    if not users:
        raise OpenAIError(400, "messages: a translation run translates the last user message; there is none",
                          param="messages", code="invalid_type")
    return users[-1]


def conversation_prompt(turns: list[tuple[str, str]], fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the prompt, the fields with the template's stop added) of a conversation read through the default
    template above: what a language model without its own template continues."""
    stop = fields.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if isinstance(stops, list):
        fields = {**fields, "stop": [*stops, TEMPLATE_STOP]}
    lines = "".join(f"{'System' if role == 'developer' else role.capitalize()}: {text}\n" for role, text in turns)
    return lines + "Assistant:", fields


class Shape:
    """How a completion's answer reads in one protocol: the whole response, or a stream's chunks."""

    object = ""
    chunk_object = ""
    id_prefix = ""
    prompt_param = "prompt"  # what the request calls the text the model reads (named by its errors)

    def new_id(self) -> str:
        return f"{self.id_prefix}-{secrets.token_hex(12)}"

    def choice(self, index: int, result: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self, index: int) -> dict[str, Any] | None:
        """A choice's first chunk, before any text (None: none)."""
        return None

    def text_filter(self):
        """A function that each choice's text pieces pass through, in order (per choice: call once per choice)."""
        return lambda piece: piece


class TextShape(Shape):
    """OpenAI's legacy completions: ``text_completion`` objects, chunks of the same object."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def choice(self, index: int, result: dict[str, Any]) -> dict[str, Any]:
        return {"text": result["text"], "index": index, "logprobs": result.get("logprobs"),
                "finish_reason": result["finish_reason"]}

    def delta(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": None, "finish_reason": finish}


class ChatShape(Shape):
    """OpenAI's chat completions: a ``chat.completion`` with one assistant message per choice; streamed, a
    ``chat.completion.chunk`` with the role first, then ``content`` deltas, then the finish reason."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    prompt_param = "messages"

    def __init__(self, strip_leading_space: bool) -> None:
        self.strip = strip_leading_space  # a language model's reply follows "Assistant:" and its space

    def choice(self, index: int, result: dict[str, Any]) -> dict[str, Any]:
        text = result["text"].lstrip() if self.strip else result["text"]
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": result["finish_reason"]}

    def delta(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish}

    def opening(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def text_filter(self):
        if not self.strip:
            return super().text_filter()
        started = False

        def piece(text: str) -> str:
            nonlocal started
            if not started:
                text = text.lstrip()
                started = bool(text)
            return text

        return piece
