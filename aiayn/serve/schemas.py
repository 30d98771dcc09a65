"""Request checking for ``aiayn serve``: raw bytes in, validated values or an :class:`ApiError` out.

Every way a request can be wrong maps to one status and one machine-readable code, with a one-line
message that names the field (and the line, for a list of texts):

=====  ======================  =====================================================================
400    invalid_utf8            the body is not UTF-8
400    bad_json                the body is not JSON, not a JSON object, nested too deeply or holds a
                               number too long to read
403    host_not_allowed        the Host header names no host this server answers to (``--allow-host``)
403    cors_not_allowed        a page of another origin (``--cors ORIGIN`` allows one)
415    unsupported_media_type  a POST whose Content-Type is not application/json
400    wrong_task              the endpoint needs another kind of run (names the run's task)
413    body_too_large          more than ``Limits.max_body_bytes``
413    too_many_sentences      more texts than ``Limits.max_sentences``
413    line_too_long           a text longer than ``Limits.max_chars`` or the model's positions
422    missing_field           a required field is absent
422    unknown_field           a field the endpoint does not take (typos are not silently ignored)
422    bad_type                a field of the wrong JSON type
422    out_of_range            a value outside the server's limits or DecodeOptions' ranges
=====  ======================  =====================================================================

Decoding options are the fields of :class:`~aiayn.config.DecodeOptions`, checked against its type
hints strictly (JSON ``4.0`` is not an integer beam, ``"0.6"`` not a number), then by its own
``replace`` (ranges, nbest <= beam), then against the server's caps (beam, nbest, new tokens).
``max_tokens`` (the decoding batch budget) belongs to the server (``--max-batch-tokens``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from typing import Any

from aiayn.config import DECODE_HINTS, DecodeOptions
from aiayn.errors import ConfigError

API_KEY_ENV = "AIAYN_API_KEY"  # aiayn serve's API key when --api-key is not given

# Options a client may set per request; max_tokens is the server's batch budget.
CLIENT_OPTIONS = tuple(f.name for f in dataclasses.fields(DecodeOptions) if f.name != "max_tokens")
GENERATE_OPTIONS = ("max_new_tokens", "sample", "temperature", "top_k", "top_p", "seed", "no_repeat_ngram")


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, a stable ``code`` and a one-line ``message``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}


@dataclass
class Limits:
    """What one request may ask for. Sizes bound memory and time per request; the queue bounds the rest."""

    max_body_bytes: int = 1 << 20
    max_sentences: int = 128  # texts per request (sentences; prompts x n): room for a client batch of 100
    max_chars: int = 2000  # per text, before tokenization; the model's positions bound the tokens too
    max_beam: int = 16
    max_nbest: int = 16
    max_new_tokens: int = 512
    # LibreTranslate's routes have its own two limits, off (-1) unless set, as in LibreTranslate (--char-limit,
    # --batch-limit): characters per text, texts per request. The body's size and the model's positions still hold.
    char_limit: int = -1
    batch_limit: int = -1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value < 1 and not (f.name in ("char_limit", "batch_limit") and value == -1):
                raise ConfigError(f"serve limit {f.name}={value}: must be >= 1"
                                  + (" (or -1: none)" if f.name in ("char_limit", "batch_limit") else ""))


def parse_body(raw: bytes, limits: Limits) -> dict[str, Any]:
    """The JSON object of a request body (UTF-8, at most ``limits.max_body_bytes``)."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, "body_too_large", f"request body is {len(raw)} bytes, the limit is "
                                              f"{limits.max_body_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, "invalid_utf8", f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, "bad_json", f"request body is not JSON: {e.msg} at line {e.lineno} column {e.colno}"
                       ) from None
    except RecursionError:
        raise ApiError(400, "bad_json", "request body is nested too deeply") from None
    except ValueError:  # an integer longer than Python converts ("Exceeds the limit (4300 digits)")
        raise ApiError(400, "bad_json", "request body holds a number too long to read") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", f"request body must be a JSON object, got {_json_type(body)}")
    return body


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _check_fields(body: dict[str, Any], allowed: typing.Iterable[str], endpoint: str) -> None:
    allowed = set(allowed)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(422, "unknown_field", f"{endpoint}: unknown field {unknown[0]!r} (known: "
                                             f"{', '.join(sorted(allowed))})")


def _check_type(name: str, value: Any, hint: Any) -> None:
    """JSON-strict type check of one DecodeOptions value against its field's hint."""
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args:
            return
        raise ApiError(422, "bad_type", f"{name}: may not be null")
    if args:  # Optional[X]
        hint = next(a for a in args if a is not type(None))
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[hint](value)
    if not ok:
        want = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[hint]
        raise ApiError(422, "bad_type", f"{name}: expected {want}, got {_json_type(value)}")
    if hint is float and not math.isfinite(value):
        raise ApiError(422, "out_of_range", f"{name}: expected a finite number")


def decode_options(base: DecodeOptions, body: dict[str, Any], names: typing.Iterable[str], limits: Limits
                   ) -> DecodeOptions:
    """``base`` with the request's options among ``names`` applied, then checked."""
    given = {k: body[k] for k in names if k in body}
    for k, v in given.items():
        _check_type(k, v, DECODE_HINTS[k])
    try:
        opts = base.replace(**given)
    except ConfigError as e:
        raise ApiError(422, "out_of_range", str(e).removeprefix("decode.")) from None
    if "beam" in given and opts.beam > limits.max_beam:
        raise ApiError(422, "out_of_range", f"beam={opts.beam}: this server allows at most {limits.max_beam}")
    if "nbest" in given and opts.nbest > limits.max_nbest:
        raise ApiError(422, "out_of_range", f"nbest={opts.nbest}: this server allows at most {limits.max_nbest}")
    if opts.max_new_tokens is not None and opts.max_new_tokens > limits.max_new_tokens:
        raise ApiError(422, "out_of_range", f"max_new_tokens={opts.max_new_tokens}: this server allows at most "
                                            f"{limits.max_new_tokens}")
    return opts


def _text(value: Any, where: str, limits: Limits) -> str:
    if not isinstance(value, str):
        raise ApiError(422, "bad_type", f"{where}: expected a string, got {_json_type(value)}")
    if len(value) > limits.max_chars:
        raise ApiError(413, "line_too_long", f"{where}: {len(value)} characters, the limit is {limits.max_chars}")
    return value


def texts_field(body: dict[str, Any], limits: Limits) -> list[str]:
    """The ``text`` of a translate request: a list of strings (or one string), within the limits."""
    if "text" not in body:
        raise ApiError(422, "missing_field", "text: required (a list of sentences)")
    value = body["text"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ApiError(422, "bad_type", f"text: expected an array of strings, got {_json_type(value)}")
    if len(value) > limits.max_sentences:
        raise ApiError(413, "too_many_sentences", f"text: {len(value)} sentences, the limit is "
                                                  f"{limits.max_sentences} per request")
    return [_text(v, f"text[{i}]", limits) for i, v in enumerate(value)]


def string_field(body: dict[str, Any], name: str, limits: Limits, required: bool = True,
                 default: str | None = None) -> str | None:
    """One string field (``required``: it must be there) within ``limits.max_chars``."""
    if name not in body or body[name] is None:
        if required:
            raise ApiError(422, "missing_field", f"{name}: required (a string)")
        return default
    return _text(body[name], name, limits)


def source_tokens(translator: Any, texts: list[str], field: str = "text") -> list[int]:
    """The source tokens of each text (0 for an empty one), or a 413 ``line_too_long`` naming ``field[i]`` (the
    request's own name for its texts) for one longer than the model's positions: checked before the request is
    queued, and so before a streamed answer sends its 200."""
    out = []
    for i, text in enumerate(texts):
        n = len(translator.tokenizers.src.encode(text)) if text.strip() else 0
        if n > translator.max_source_tokens:
            raise ApiError(413, "line_too_long", f"{field}[{i}]: {n} tokens, the model takes at most "
                                                 f"{translator.max_source_tokens} (its positions, less the EOS)")
        out.append(n)
    return out


def translate_request(body: dict[str, Any], base: DecodeOptions, limits: Limits) -> tuple[list[str], DecodeOptions]:
    """(texts, options) of ``POST /v1/translate``."""
    _check_fields(body, ("text",) + CLIENT_OPTIONS, "translate")
    return texts_field(body, limits), decode_options(base, body, CLIENT_OPTIONS, limits)


def generate_request(body: dict[str, Any], base: DecodeOptions, limits: Limits) -> tuple[str, DecodeOptions]:
    """(prompt, options) of ``POST /v1/generate`` on ``base`` (the server's: as ``aiayn generate``, sampling at
    temperature 1 unless the server or the request says otherwise; temperature 0 is greedy); 64 new tokens
    unless asked."""
    _check_fields(body, ("prompt",) + GENERATE_OPTIONS, "generate")
    prompt = string_field(body, "prompt", limits, required=False, default="")
    base = base.replace(max_new_tokens=min(64, limits.max_new_tokens))
    return prompt, decode_options(base, body, GENERATE_OPTIONS, limits)


def attention_request(body: dict[str, Any], limits: Limits) -> tuple[str, str | None]:
    """(text, target or None) of ``POST /v1/attention``; an empty text is refused."""
    _check_fields(body, ("text", "target"), "attention")
    text = string_field(body, "text", limits)
    if not text.strip():
        raise ApiError(422, "out_of_range", "text: must not be empty")
    return text, string_field(body, "target", limits, required=False)


async def read_body(request: Any, limits: Limits) -> bytes:
    """The body, refused (413) as soon as it passes ``limits.max_body_bytes``."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise ApiError(413, "body_too_large", f"request body is {declared} bytes, the limit is "
                                              f"{limits.max_body_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise ApiError(413, "body_too_large", f"request body is over the limit of {limits.max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
