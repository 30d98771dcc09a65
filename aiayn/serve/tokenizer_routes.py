"""vLLM's tokenizer routes of ``aiayn serve`` (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), as
lm-evaluation-harness's remote tokenizer reads them, on a language-model run: the model name and chat template
are those of OpenAI's routes (:class:`aiayn.serve.openai_api.OpenAIRoutes`), the errors in OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiayn.serve.completions import is_id
from aiayn.serve.errors import OpenAIError
from aiayn.serve.openai_api import OpenAIRoutes
from aiayn.serve.routes import RouteTable, route
from aiayn.serve.schemas import parse_body, read_body
from aiayn.serve.scores import encode_with_specials, tokenizer_info


class TokenizerRoutes(RouteTable):
    """vLLM's tokenizer routes beside OpenAI's ``api``: its key check, model name and chat template."""

    protocol = "openai"

    def __init__(self, api: OpenAIRoutes) -> None:
        self.api, self.svc = api, api.svc

    async def lm_body(self, request: Request, path: str) -> dict[str, Any]:
        """A tokenizer route's JSON object, once its key is checked and the run is a language model."""
        self.api.authorize(request)
        self.need_lm(path)
        return parse_body(await read_body(request, self.svc.limits), self.svc.limits)

    @route("/tokenize", "POST")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: ``{"prompt"}`` -> ``{"tokens", "count", "max_model_len"}``."""
        body = await self.lm_body(request, "/tokenize")
        prompt, limit = body.get("prompt"), self.svc.limits.max_chars
        if not isinstance(prompt, str) or len(prompt) > limit:
            raise OpenAIError(400, f"prompt: expected a string of at most {limit} characters", param="prompt",
                              code="invalid_type")
        if body.get("add_special_tokens"):  # aiayn's language models read no BOS or EOS around a text
            raise OpenAIError(400, "add_special_tokens: this server adds none", param="add_special_tokens",
                              code="unsupported")
        ids = encode_with_specials(self.svc.model.run, prompt)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.info()["model_max_length"]})

    @route("/detokenize", "POST")
    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: ``{"tokens"}`` -> ``{"prompt"}``."""
        ids = (await self.lm_body(request, "/detokenize")).get("tokens")
        vocab = self.svc.model.tokenizers.src.vocab_size
        if not isinstance(ids, list) or not all(is_id(i) and i < vocab for i in ids):
            raise OpenAIError(400, f"tokens: expected a list of token ids below {vocab}", param="tokens",
                              code="invalid_type")
        return JSONResponse({"prompt": self.svc.model.tokenizers.src.decode(ids)})

    @route("/tokenizer_info", "GET")
    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info`` (:func:`aiayn.serve.scores.tokenizer_info`)."""
        self.api.authorize(request)
        self.need_lm("/tokenizer_info")
        return JSONResponse(self.info())

    def info(self) -> dict[str, Any]:
        return tokenizer_info(self.svc.model.run, self.api.model_id,
                              None if self.api.completer.template is None else self.api.completer.template.source)

    def need_lm(self, path: str) -> None:
        why = self.svc.kind.refusal("lm_route", path)
        if why is not None:
            raise OpenAIError(400, why, code="wrong_task")
