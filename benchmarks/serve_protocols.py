"""The ecosystem protocols of ``aiayn serve`` under measurement: time to the first streamed token of an OpenAI
completion against its whole time, LibreTranslate requests per model call under concurrent clients, and how fast
a bad request is refused.

    python -m benchmarks.serve_protocols --mt-run RUN --lm-run RUN [--clients 8] [--requests 64] [--out-json F]
    python -m benchmarks.serve_protocols --lm-run RUN --sections scoring   # one part alone

- Streaming: ``POST /v1/completions`` with ``stream: true`` (greedy, ``--max-tokens`` tokens), timed from the
  request to the first event carrying text and to ``[DONE]``, ``--repeats`` times; the server's decoding step
  time is the total over the tokens streamed. Goal (issue 33): the first token within one decoding step of the
  request starting, i.e. time to first token <= the request overhead + one step.
- Batching: ``--clients`` threads on the translation run, half sending ``POST /translate`` (LibreTranslate, one
  sentence), half ``POST /v1/completions`` (OpenAI, the sentence as the prompt, greedy), in a loop until
  ``--requests`` are answered; ``/health``'s jobs / calls before and after give the requests per model call
  (> 1: concurrent requests share calls; both protocols decode with the run's options, so they share them).
- Batching on a language model: ``--clients`` threads send greedy ``POST /v1/completions`` (prompts of different
  lengths, ``--max-tokens`` tokens) until ``--requests`` are answered: requests per model call, as above.
- Scoring on a language model, as lm-evaluation-harness's loglikelihood tasks ask for it: ``--prompts`` prompts
  (8 to 200 characters, at most the model's context; a fixed seed) with ``echo``, ``logprobs: 1`` and
  ``max_tokens: 0``, sent as one request (a harness batch) and as one request each, one after the other;
  prompts/s of each (median of ``--repeats``) and their ratio (> 1: a request's prompts share forward passes).
- Refusals: each bad request of the list below, timed; every one must be a 4xx in the protocol's shape.

Servers run as ``python -m aiayn serve RUN --port 0 --device cpu`` subprocesses (benchmarks.serve_load).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from benchmarks import serve_load

BAD_REQUESTS = [  # (path, body, what it tests)
    ("/translate", {"q": 5, "source": "en", "target": "de"}, "LibreTranslate: wrong type"),
    ("/translate", {"q": "a", "source": "en", "target": "xx"}, "LibreTranslate: unknown language"),
    ("/translate", {"q": "x" * (10 << 20), "source": "en", "target": "de"}, "LibreTranslate: 10 MB body"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**9}, "OpenAI: huge max_tokens"),
    ("/v1/completions", {"prompt": 5}, "OpenAI: wrong type"),
    ("/v1/completions", {"prompt": "x" * (10 << 20)}, "OpenAI: 10 MB body"),
]


SECTIONS = ("streaming", "batching", "lm_batching", "scoring")


def _post_raw(url: str, path: str, body: Any) -> tuple[int, bytes, float]:
    data = json.dumps(body).encode()
    start = time.perf_counter()
    with closing(serve_load.connect(url)) as conn:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        payload = r.read()
    return r.status, payload, time.perf_counter() - start


def stream_once(url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streamed completion: seconds to the first text event and to [DONE], and the events with text."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    host = url.split("://", 1)[1]
    conn = http.client.HTTPConnection(host, timeout=120)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    first, pieces, buf = None, 0, b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                total = time.perf_counter() - start
                conn.close()
                return {"first_s": first if first is not None else total, "total_s": total, "pieces": pieces}
            text = json.loads(data)["choices"][0]["text"]
            if text:
                pieces += 1
                if first is None:
                    first = time.perf_counter() - start
    raise RuntimeError("the stream ended without [DONE]")


def streaming(lm_run: str, max_tokens: int, repeats: int) -> dict[str, Any]:
    proc, url, _ = serve_load.start_server(lm_run)
    try:
        stream_once(url, "the", 4)  # warm
        runs = [stream_once(url, "the", max_tokens) for _ in range(repeats)]
        overhead = [_post_raw(url, "/v1/completions", {"prompt": "the", "max_tokens": 1, "temperature": 0})[2]
                    for _ in range(repeats)]
    finally:
        serve_load.stop_server(proc)
    step = statistics.median(r["total_s"] / max(r["pieces"], 1) for r in runs)
    first = statistics.median(r["first_s"] for r in runs)
    one_token = statistics.median(overhead)
    return {"max_tokens": max_tokens, "repeats": repeats, "first_token_s": round(first, 4),
            "total_s": round(statistics.median(r["total_s"] for r in runs), 4), "step_s": round(step, 4),
            "one_token_request_s": round(one_token, 4), "pieces": runs[0]["pieces"],
            "first_within_one_step": first <= one_token + step}


def _drive(clients: int, requests: int, send: Callable[[int, int], int]) -> tuple[float, list[int]]:
    """``clients`` threads call ``send(client, i)`` (returns an HTTP status) until ``requests`` calls are made,
    client k taking i = k, k + clients, ...: the wall time and every status other than 200."""
    left, lock, errors = [requests], threading.Lock(), []

    def client(k: int) -> None:
        i = k
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            status = send(k, i)
            if status != 200:
                errors.append(status)
            i += clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, errors


def batching(mt_run: str, clients: int, requests: int) -> dict[str, Any]:
    proc, url, _ = serve_load.start_server(mt_run, "--max-wait-ms", "20")
    texts, _ = serve_load.sentences(mt_run, limit=200)
    try:
        with closing(serve_load.connect(url)) as conn:
            before = serve_load.request(conn, "GET", "/health")[1]

        def send(k: int, i: int) -> int:
            text = texts[i % len(texts)]
            if k % 2 == 0:  # half the clients speak LibreTranslate, half OpenAI's completions
                return _post_raw(url, "/translate", {"q": text, "source": "en", "target": "de"})[0]
            return _post_raw(url, "/v1/completions", {"prompt": text, "temperature": 0, "max_tokens": 64})[0]

        wall, errors = _drive(clients, requests, send)
        with closing(serve_load.connect(url)) as conn:
            after = serve_load.request(conn, "GET", "/health")[1]
        refusals = []
        for path, body, what in BAD_REQUESTS:
            if path.startswith("/v1/completions"):
                continue  # a translation run answers completions too, but the LM server measures them
            status, payload, seconds = _post_raw(url, path, body)
            refusals.append({"what": what, "status": status, "ms": round(1000 * seconds, 1),
                             "shape": "error" in json.loads(payload)})
    finally:
        serve_load.stop_server(proc)
    jobs, calls = after["jobs"] - before["jobs"], after["calls"] - before["calls"]
    return {"clients": clients, "requests": requests, "errors": errors, "wall_s": round(wall, 2),
            "requests_per_call": round(jobs / max(calls, 1), 2), "refusals": refusals}


def lm_batching(lm_run: str, clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    """``clients`` threads send greedy ``/v1/completions`` to the language model until ``requests`` are answered
    (prompts of 1-4 words, so of different lengths): requests per model call from ``/health``."""
    proc, url, _ = serve_load.start_server(lm_run, "--max-wait-ms", "20")
    prompts = ["the", "the cat", "a dog sat", "on the mat now", "to be or", "what is", "my lord", "and then"]
    try:
        with closing(serve_load.connect(url)) as conn:
            before = serve_load.request(conn, "GET", "/health")[1]
        wall, errors = _drive(clients, requests, lambda k, i: _post_raw(
            url, "/v1/completions", {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                                     "temperature": 0})[0])
        with closing(serve_load.connect(url)) as conn:
            after = serve_load.request(conn, "GET", "/health")[1]
    finally:
        serve_load.stop_server(proc)
    jobs, calls = after["jobs"] - before["jobs"], after["calls"] - before["calls"]
    return {"clients": clients, "requests": requests, "max_tokens": max_tokens, "errors": errors,
            "wall_s": round(wall, 2), "requests_per_call": round(jobs / max(calls, 1), 2)}


def scoring(lm_run: str, prompts: int, repeats: int) -> dict[str, Any]:
    """``prompts`` echo / logprobs prompts scored as one request and as one request each: prompts/s of each."""
    import random

    words = "the cat sat on a mat and my lord is to be or not what then now here".split()
    rng = random.Random(0)
    one = {"echo": True, "logprobs": 1, "max_tokens": 0}
    proc, url, _ = serve_load.start_server(lm_run)
    try:
        with closing(serve_load.connect(url)) as conn:  # characters >= tokens: a prompt of ctx characters fits
            ctx = serve_load.request(conn, "GET", "/tokenizer_info")[1]["model_max_length"]
        texts = []
        for _ in range(prompts):
            text, limit = "", rng.randint(min(8, ctx), min(200, ctx))
            while len(text) < limit:
                text += rng.choice(words) + " "
            texts.append(text[:limit])
        _post_raw(url, "/v1/completions", {**one, "prompt": texts[:2]})  # warm-up
        together, apart = [], []
        for _ in range(repeats):
            status, payload, seconds = _post_raw(url, "/v1/completions", {**one, "prompt": texts})
            if status != 200:
                raise RuntimeError(f"scoring request answered {status}: {payload[:300]!r}")
            together.append(seconds)
            start = time.perf_counter()
            for text in texts:
                if _post_raw(url, "/v1/completions", {**one, "prompt": text})[0] != 200:
                    raise RuntimeError("a one-prompt scoring request failed")
            apart.append(time.perf_counter() - start)
    finally:
        serve_load.stop_server(proc)
    t, a = statistics.median(together), statistics.median(apart)
    return {"prompts": prompts, "characters": [min(map(len, texts)), max(map(len, texts))], "repeats": repeats,
            "one_request_prompts_per_s": round(prompts / t, 1), "one_each_prompts_per_s": round(prompts / a, 1),
            "one_request_over_one_each": round(a / t, 2)}


def openai_refusals(lm_run: str) -> list[dict[str, Any]]:
    proc, url, _ = serve_load.start_server(lm_run)
    try:
        out = []
        for path, body, what in BAD_REQUESTS:
            if not path.startswith("/v1/completions"):
                continue
            status, payload, seconds = _post_raw(url, path, body)
            out.append({"what": what, "status": status, "ms": round(1000 * seconds, 1),
                        "shape": "error" in json.loads(payload)})
    finally:
        serve_load.stop_server(proc)
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mt-run", help="a translation run (needed by the batching section)")
    p.add_argument("--lm-run", required=True)
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=64, help="scoring: prompts of one request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-json", default=None)
    a = p.parse_args(argv)
    if "batching" in a.sections and not a.mt_run:
        p.error("the batching section needs --mt-run")
    result: dict[str, Any] = {}
    if "streaming" in a.sections:
        result["streaming"] = streaming(a.lm_run, a.max_tokens, a.repeats)
    if "batching" in a.sections:
        result["batching"] = batching(a.mt_run, a.clients, a.requests)
        result["batching"]["refusals"] += openai_refusals(a.lm_run)
    if "lm_batching" in a.sections:
        result["lm_batching"] = lm_batching(a.lm_run, a.clients, a.requests, a.max_tokens)
    if "scoring" in a.sections:
        result["scoring"] = scoring(a.lm_run, a.prompts, a.repeats)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out_json:
        Path(a.out_json).write_text(text + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
