"""aiayn's own API of ``aiayn serve`` (the protocols of the ecosystem are :mod:`aiayn.serve.libretranslate`'s and
:mod:`aiayn.serve.openai_api`'s).

==========================  ========================================================================
``GET /``                   the attention explorer page (static/, served by the package, no CDN)
``GET /health``             {"status": "ok", "queued", "jobs", "calls", "items", "cancelled"} (batcher counters)
``GET /v1/model``           task, run, device, precision, parameters, config, limits, batching, page
``POST /v1/translate``      {"text": [...], any DecodeOptions field} -> {"translations": [...]}, in order
``POST /v1/generate``       language-model runs: {"prompt", "max_new_tokens", "temperature", ...}
``POST /v1/attention``      {"text", "target"?} -> tokens and attention probabilities (L x H x Q x K)
==========================  ========================================================================

Every error is JSON, ``{"error": {"code", "message"}}`` (codes: :mod:`aiayn.serve.schemas`; the mapping:
:func:`aiayn.serve.errors.aiayn_error`): a bad request gets its 4xx, a full queue 503, a failing model 500, and
the server goes on serving. All model work runs on the batcher's worker thread (:mod:`aiayn.serve.batcher`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from aiayn.config import Config
from aiayn.data.pipeline import corpus_of
from aiayn.decode.generate import Generator
from aiayn.decode.stream import hypothesis_json
from aiayn.decode.translator import Translation
from aiayn.model.transformer import count_parameters
from aiayn.run.directory import Run
from aiayn.serve.routes import RouteTable, route
from aiayn.serve.schemas import ApiError, attention_request, generate_request, parse_body, read_body, translate_request
from aiayn.serve.service import Service
from aiayn.task import TASKS, Task
from aiayn.viz.attention import KINDS, attention_data, attention_reader

STATIC = Path(__file__).resolve().parent / "static"

TRANSLATE, GENERATE = "/v1/translate", "/v1/generate"
# The route that serves a run, by what ``aiayn.load`` gives for its task (``Task.loader``): the task table names
# no HTTP path, and a new task that loads as a translator or a generator is served with no edit here.
ROUTES: Mapping[str, str] = MappingProxyType({"translator": TRANSLATE, "generator": GENERATE})


def route_of(kind: Task) -> str:
    """aiayn's own route that serves a run of task ``kind``."""
    return ROUTES[kind.loader]


# What the attention explorer page (static/app.js) calls its text box and its button, by what the run was trained
# on (its data.pipeline.Corpus): the page asks the server rather than comparing task names, so a new task whose
# corpus is one of these shows in its own words; another corpus shows as a translation.
PAGE_WORDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "pairs": ("Sentence", "Translate"), "documents": ("Document", "Summarize"),
    "stream": ("Prompt", "Continue"), "rows": ("Prompt", "Continue")})


def page_json(cfg: Config) -> dict[str, str]:
    """What /v1/model tells the page: the route that serves the run (its request and its fields), the model's
    architecture (its attention maps' axes) and the words of its text box and button (:data:`PAGE_WORDS`)."""
    source, action = PAGE_WORDS.get(corpus_of(cfg).name, PAGE_WORDS["pairs"])
    return {"route": route_of(cfg.kind), "architecture": cfg.kind.architecture, "source": source, "action": action}


def need(kind: Task, path: str) -> None:
    """A 400 ``wrong_task`` naming the tasks ``path`` serves and the route a run of ``kind`` has."""
    if route_of(kind) != path:
        wanted = " or ".join(t.label for t in TASKS.values() if route_of(t) == path)
        raise ApiError(400, "wrong_task", f"{path} needs a {wanted} run; this server runs a "
                                          f"{kind.label} run (use {route_of(kind)})")


def translation_json(hyps: list[Translation]) -> dict[str, Any]:
    """One input's result: the best hypothesis' fields, and all of them best first under ``nbest``."""
    if not hyps:  # an empty input line: an empty output, as `aiayn translate` writes
        return {"text": "", "score": None, "logprob": None, "tokens": [], "nbest": []}
    return {**hypothesis_json(hyps[0]), "nbest": [hypothesis_json(h) for h in hyps]}


def attention_json(run: Run, text: str, target: str | None) -> bytes:
    """The response body of /v1/attention, rendered on the worker thread (it can be large)."""
    data = attention_data(run, text, target)
    kinds = {}
    for kind, m in data.maps.items():
        L, H, Q, K = m.weights.shape
        kinds[kind] = {"title": KINDS[kind], "layers": L, "heads": H, "queries": m.queries, "keys": m.keys,
                       "predicts": m.predicts,  # decoder rows: the token each step predicts (None: encoder)
                       "weights": np.round(m.weights, 5).tolist()}  # (L, H, Q, K), each row sums to 1
    body = {"task": run.cfg.task, "source": data.src, "target": data.tgt, "generated": data.generated,
            "attention": kinds}
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


class NativeRoutes(RouteTable):
    """aiayn's own routes over ``svc``."""

    protocol = "aiayn"

    def __init__(self, svc: Service) -> None:
        self.svc = svc

    async def body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, once its key is checked."""
        self.svc.check_key(request)
        return parse_body(await read_body(request, self.svc.limits), self.svc.limits)

    @route("/")
    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    @route("/health")
    async def health(self, request: Request) -> Response:
        svc = self.svc
        s = svc.batcher.stats
        return JSONResponse({"status": "ok", "queued": svc.batcher.queued, "jobs": s.jobs, "calls": s.calls,
                             "items": s.items, "cancelled": s.cancelled, "busy_s": round(s.busy_s, 6),
                             "uptime_s": round(time.time() - svc.started, 3)})

    @route("/v1/model")
    async def model_info(self, request: Request) -> Response:
        svc = self.svc
        svc.check_key(request)
        m = svc.model
        return JSONResponse({
            "task": svc.task, "run": str(m.path), "device": str(m.device),
            # int8, and bf16 on a CPU: fp32 weights, int8 / bf16 linear layers (aiayn.linear)
            "precision": ({"int8": "int8", "bf16": "bfloat16"}.get(m.run.precision)
                          or str(next(m.model.parameters()).dtype).removeprefix("torch.")),
            "precision_why": m.run.precision_why,
            "parameters": count_parameters(m.model), "config": m.cfg.to_dict(),
            "decode": dataclasses.asdict(svc.decode),  # the run's decode section with the server's decoding flags
            "limits": {**dataclasses.asdict(svc.limits), "attention_tokens": m.cfg.model.max_positions},
            "batching": {"max_batch_tokens": svc.budget, "max_wait_ms": svc.max_wait_ms, "max_queue": svc.max_queue},
            "page": page_json(m.cfg),  # what the attention explorer page shows (static/app.js)
        })

    @route(TRANSLATE, "POST")
    async def translate(self, request: Request) -> Response:
        body = await self.body(request)
        need(self.svc.kind, TRANSLATE)
        texts, opts = translate_request(body, self.svc.decode, self.svc.limits)
        found, opts = await self.svc.translate(texts, opts)
        return JSONResponse({"translations": [translation_json(h) for h in found],
                             "options": dataclasses.asdict(opts)})

    @route(GENERATE, "POST")
    async def generate(self, request: Request) -> Response:
        body = await self.body(request)
        need(self.svc.kind, GENERATE)
        gen: Generator = self.svc.model
        prompt, opts = generate_request(body, self.svc.generate_options(), self.svc.limits)
        [text] = await self.svc.batcher.run(None, [prompt], 1, lambda items: [gen.generate(p, opts) for p in items])
        return JSONResponse({"prompt": prompt, "text": text, "options": dataclasses.asdict(opts)})

    @route("/v1/attention", "POST")
    async def attention(self, request: Request) -> Response:
        body = await self.body(request)
        text, target = attention_request(body, self.svc.limits)
        run = self.svc.run
        reader = attention_reader(run)  # what the run's model reads: a text, and an encoder-decoder's target
        room, steps = reader.source_room(run.cfg), reader.target_room(run.cfg)
        n = len(run.tokenizers.src.encode(text))
        if n > room:
            raise ApiError(413, "line_too_long", f"text: {n} tokens, the model takes at most {room}")
        if target is not None and steps is not None:
            m = len(run.tokenizers.tgt.encode(target))
            if m > steps:  # the whole target or nothing: a map of its first positions would mislead
                raise ApiError(413, "line_too_long", f"target: {m} tokens, the decoder reads at most {steps} "
                                                     "after its start token (the model's positions)")
        [payload] = await self.svc.batcher.run(None, [text], 1,
                                               lambda items: [attention_json(run, items[0], target)])
        return Response(payload, media_type="application/json")
