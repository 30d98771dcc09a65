"""LibreTranslate and OpenAI protocols of ``aiayn serve`` (issue 33), tested with the real clients against a real
server process: ``libretranslatepy`` on the tiny translation run, the ``openai`` package's completions (streamed
and not) on a tiny language model; the API key and the error shapes in-process."""

from __future__ import annotations

import html
import json
import math
import urllib.error
from pathlib import Path

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from conftest import SUM_TOL, greedy_clear_picks, post_held  # noqa: E402  (tests/ is on sys.path under pytest)
from starlette.testclient import TestClient  # noqa: E402

import aiayn  # noqa: E402
from aiayn.decode.generate import fits_in_batch  # noqa: E402
from aiayn.interop import argos  # noqa: E402
from aiayn.serve.app import create_app  # noqa: E402
from aiayn.serve.batcher import Batching  # noqa: E402
from aiayn.serve.completions import StopScan  # noqa: E402
from aiayn.serve.libretranslate import libre_format  # noqa: E402
from benchmarks import serve_load  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
LINES = ["a b c d", "hello world", "the cat sat on the mat"]
LANGUAGES = [{"code": "en", "name": "English", "targets": ["de", "en"]}, {"code": "de", "name": "German",
                                                                         "targets": ["de"]}]


def libre(source: str, translation: str) -> str:
    """A translation as LibreTranslate's routes answer it (its formatting, then HTML entities resolved)."""
    return html.unescape(libre_format(source, translation))


@pytest.fixture(scope="module")
def translator(tiny_run):
    return aiayn.load(tiny_run, device="cpu")


@pytest.fixture(scope="module")
def mt_server(tiny_run):
    proc, url, log = serve_load.start_server(tiny_run)
    yield url
    serve_load.stop_server(proc, timeout=30)


@pytest.fixture(scope="module")
def lm_server(lm_run):
    # gpt-3.5-turbo: the model name LangChain's ChatOpenAI sends unless told another
    proc, url, log = serve_load.start_server(lm_run, "--model-alias", "gpt-3.5-turbo")
    yield url
    serve_load.stop_server(proc, timeout=30)


# LibreTranslate -------------------------------------------------------------------------------------------


def test_libretranslatepy_translates_like_aiayn_translate(mt_server, translator):
    lt_mod = pytest.importorskip("libretranslatepy")
    lt = lt_mod.LibreTranslateAPI(mt_server)
    # one line per request, one request at a time: each decoded alone, as here
    ours = [libre(line, translator.search([line], translator.options(), scores=False)[0][0].text) for line in LINES]
    assert [lt.translate(line, "en", "de") for line in LINES] == ours
    assert lt.translate(LINES[0], "auto", "de") == ours[0]
    assert lt.languages() == LANGUAGES
    assert lt.detect(LINES[0]) == [{"confidence": 100.0, "language": "en"}]  # the run's one source language
    with pytest.raises(urllib.error.HTTPError) as e:  # a language the model does not translate
        lt.translate("a b", "en", "fr")
    assert e.value.code == 400 and "fr is not supported" in json.loads(e.value.read())["error"]
    assert lt.translate(LINES[1], "en", "de") == ours[1]  # and the server goes on


def test_libretranslate_json_lists_alternatives_and_errors(client_mt, translator):
    r = client_mt.post("/translate", json={"q": LINES, "source": "en", "target": "de"})
    ours = [libre(t, h[0].text) for t, h in zip(LINES, translator.search(LINES, translator.options(), scores=False))]
    assert r.status_code == 200 and r.json() == {"translatedText": ours}
    r = client_mt.post("/translate", json={"q": LINES[0], "source": "en", "target": "de", "alternatives": 2})
    nbest = translator.search([LINES[0]], translator.options(nbest=3, beam=max(3, translator.cfg.decode.beam)),
                              scores=False)[0]
    best, *alts = (libre(LINES[0], h.text) for h in nbest)
    want_alts = [a for i, a in enumerate(alts) if a not in (best, "") and a not in alts[:i]]  # filter_unique
    assert r.json() == {"translatedText": best, "alternatives": want_alts}
    for body, status, word in [
        ({"source": "en", "target": "de"}, 400, "missing q"),
        ({"q": 5, "source": "en", "target": "de"}, 400, "q: expected"),
        ({"q": "a", "source": "xx", "target": "de"}, 400, "xx is not supported"),
        ({"q": "a", "source": "en", "target": "de", "format": "pdf"}, 400, "format"),
        ({"q": [], "source": "en", "target": "de"}, 400, "missing q"),
    ]:
        r = client_mt.post("/translate", json=body)
        assert r.status_code == status and word in r.json()["error"], (body, r.text)
    r = client_mt.post("/translate", content=b"x" * (10 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()
    # Forms are taken on LibreTranslate's routes only: aiayn's own API stays JSON-only (415).
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = client_mt.post("/v1/translate", content=b"text=a", headers=form)
    assert r.status_code == 415
    assert client_mt.post("/translate", json={"q": "a b", "source": "en", "target": "de"}).status_code == 200


ARGOS_FLAGS = tuple(argos.ARGOS_FLAGS.split())
ARGOS_LINES = LINES + ["a b c d e f g h", "d c b a", "one two three four five six", "x", "the dog and the cat"]


def test_serve_takes_translates_decoding_flags_for_its_libretranslate_routes(tiny_run, translator, tmp_path, capsys):
    """``aiayn serve RUN`` with Argos' search (``argos.ARGOS_FLAGS``): LibreTranslate's
    /translate answers what ``aiayn translate`` answers with the same flags; aiayn's /v1/translate takes them as
    its defaults, which a request's own options override."""
    import subprocess
    import sys

    src = tmp_path / "src.txt"
    src.write_text("\n".join(ARGOS_LINES) + "\n", encoding="utf-8")
    # one thread in both processes: the same float sums, so the same batch gives the same hypotheses exactly
    cli = subprocess.run([sys.executable, "-m", "aiayn", "translate", str(tiny_run), "--input", str(src), "--device",
                          "cpu", "--threads", "1", *ARGOS_FLAGS], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    proc, url, log = serve_load.start_server(tiny_run, "--threads", "1", *ARGOS_FLAGS)
    conn = serve_load.connect(url)
    try:
        status, got = serve_load.request(conn, "POST", "/translate", {"q": ARGOS_LINES, "source": "en", "target": "de"})
        assert (status, got) == (200, {"translatedText": cli.stdout.splitlines()})
        decode = serve_load.request(conn, "GET", "/v1/model")[1]["decode"]
        assert {k: decode[k] for k in argos.ARGOS_SEARCH} == argos.ARGOS_SEARCH  # the flags say the same search
        native = serve_load.request(conn, "POST", "/v1/translate", {"text": ARGOS_LINES})[1]
        assert [t["text"] for t in native["translations"]] == cli.stdout.splitlines()
        assert {k: native["options"][k] for k in argos.ARGOS_SEARCH} == argos.ARGOS_SEARCH
        run_own = {k: getattr(translator.cfg.decode, k) for k in argos.ARGOS_SEARCH if k != "beam"}
        native = serve_load.request(conn, "POST", "/v1/translate", {"text": LINES, **run_own})[1]
        ours = [h[0].text for h in translator.search(LINES, translator.options(beam=4), scores=False)]
        assert [t["text"] for t in native["translations"]] == ours
    finally:
        conn.close()
        serve_load.stop_server(proc, timeout=30)
    from aiayn.cli import main

    for flags, word in [(("--beam", "0"), "decode.beam"), (("--max-tokens", "64", "--max-batch-tokens", "64"),
                                                             "give one"), (("--nbest", "9"), "nbest=9")]:
        assert main(["serve", str(tiny_run), "--threads", "1", "--port", "0", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and word in err, (flags, err)


@pytest.fixture(scope="module")
def client_mt(translator):
    with TestClient(create_app(translator, batching=Batching(max_wait_ms=2.0)), base_url="http://localhost") as c:
        yield c


def test_api_key_is_asked_by_every_protocol(translator):
    key = "s3cret-key"
    app = create_app(translator, batching=Batching(max_wait_ms=2.0), api_key=key)
    with TestClient(app, base_url="http://localhost") as c:
        q = {"q": "a b", "source": "en", "target": "de"}
        assert c.post("/translate", json=q).status_code == 403
        assert c.post("/translate", json={**q, "api_key": "wrong-key!"}).json() == {"error": "Invalid API key"}
        assert c.post("/translate", json={**q, "api_key": key}).status_code == 200
        assert c.post("/translate", data={**q, "api_key": key}).status_code == 200  # the form libretranslatepy sends
        assert c.post("/v1/translate", json={"text": ["a b"]}).json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/translate", json={"text": ["a b"]},
                      headers={"Authorization": f"Bearer {key}"}).status_code == 200
        r = c.post("/v1/completions", json={"prompt": "a b", "temperature": 0})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert c.get("/health").status_code == 200  # health stays open
        # as LibreTranslate, which has no key check on /languages: a client lists the languages before it has a key
        assert c.get("/languages").status_code == 200
        assert c.request("GET", "/languages", data={"api_key": key}).status_code == 200  # libretranslatepy's GET


def test_a_translation_run_answers_completions_with_its_translation(client_mt, translator):
    for unsupported in ({"echo": True}, {"logprobs": 1}, {"best_of": 2}, {"suffix": "x"}):
        r = client_mt.post("/v1/completions", json={"prompt": "a", **unsupported})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported", unsupported
    r = client_mt.post("/v1/completions", json={"prompt": LINES, "temperature": 0, "max_tokens": 50, "echo": False,
                                                "best_of": 1, "logprobs": None})
    ours = [h[0].text for h in translator.search(LINES, translator.options(), scores=False)]
    assert [c["text"] for c in r.json()["choices"]] == ours and r.json()["object"] == "text_completion"
    r = client_mt.post("/v1/completions", json={"prompt": LINES, "temperature": 0, "stream": True})
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    streamed = ["".join(c["text"] for c in chunks if c["index"] == i) for i in range(len(LINES))]
    assert streamed == ours and sorted(c["index"] for c in chunks if c["finish_reason"] == "stop") == [0, 1, 2]


def test_libretranslate_and_openai_requests_share_model_calls_on_a_translation_run(translator):
    """Requests of both protocols (and aiayn's own) queued together are merged by the batcher into one model call
    when they decode with the same options, and each answers with its slice of that call. The batcher is held
    until all are queued, so no thread timing decides the merge."""
    app = create_app(translator, batching=Batching(max_wait_ms=0.0, max_batch_tokens=100_000))
    calls, real = [], translator.search

    def counting(texts, opts, scores=True, **kwargs):
        calls.append(list(texts))
        return real(texts, opts, scores, **kwargs)

    libre, openai = LINES + ["a a b", "b b"], ["b a", "c c c", "a b a", "c b a", "b c"]
    requests = ([("/translate", {"q": t, "source": "en", "target": "de"}) for t in libre]
                + [("/v1/completions", {"prompt": t, "temperature": 0, "max_tokens": 40}) for t in openai])
    with TestClient(app, base_url="http://localhost") as c, pytest.MonkeyPatch.context() as mp:
        mp.setattr(translator, "search", counting)
        responses = post_held(app, c, requests)
    assert all(r.status_code == 200 for r in responses)
    assert len(calls) == 1 and sorted(calls[0]) == sorted(libre + openai)  # one call, across the protocols
    merged = dict(zip(calls[0], (h[0].text for h in real(calls[0], translator.options(), scores=False))))
    assert [r.json()["translatedText"] for r in responses[:len(libre)]] == [merged[t] for t in libre]
    assert [r.json()["choices"][0]["text"] for r in responses[len(libre):]] == [merged[t] for t in openai]


# OpenAI completions --------------------------------------------------------------------------------------


def test_openai_client_completes_streamed_and_not(lm_server, lm_run):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{lm_server}/v1", api_key="unused", max_retries=0)
    model, alias = client.models.list().data  # the run first, then the server's --model-alias
    assert (model.id, alias.id) == (lm_run.name, "gpt-3.5-turbo")
    gen = aiayn.load(lm_run, device="cpu")
    want = gen.generate("the cat", max_new_tokens=12)  # greedy
    done = client.completions.create(model=model.id, prompt="the cat", max_tokens=12, temperature=0)
    assert done.choices[0].text == want and done.object == "text_completion"
    assert done.usage.prompt_tokens == len("the cat") and done.usage.completion_tokens <= 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.choices[0].finish_reason == ("length" if done.usage.completion_tokens == 12 else "stop")
    pieces = list(client.completions.create(model=model.id, prompt="the cat", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == want
    assert pieces[-1].choices[0].finish_reason == done.choices[0].finish_reason
    # sampling: a seed gives the same text streamed and not; n completions per prompt, each its own seed
    a = client.completions.create(model=model.id, prompt=["the", "a"], max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    b = client.completions.create(model=model.id, prompt=["the", "a"], max_tokens=8, temperature=1.0, seed=7, n=2,
                                  stream=True)
    texts = {}
    for p in b:
        texts[p.choices[0].index] = texts.get(p.choices[0].index, "") + p.choices[0].text
    assert [texts[i] for i in range(4)] == [c.text for c in a.choices]
    # stop: the text ends before the first stop string, streamed or not
    s = client.completions.create(model=model.id, prompt="the cat", max_tokens=30, temperature=0, stop=[" on"])
    longer = gen.generate("the cat", max_new_tokens=30)
    assert s.choices[0].text == longer.split(" on")[0]  # exactly the greedy text, cut before the first " on"
    stopped = " on" in longer or s.usage.completion_tokens < 30  # a stop string, or the model's own EOS
    assert s.choices[0].finish_reason == ("stop" if stopped else "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model.id, prompt="the", max_tokens=10**6)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model.id, prompt="the", temperature="hot")
    assert client.completions.create(model=model.id, prompt="the", max_tokens=2).choices  # still serving


def test_concurrent_completions_on_a_language_model_share_model_calls(lm_run):
    """Completions queued together with the same sampling options run as one batch (prompts of different lengths,
    limits and stops), streamed or not, and each gives the text it gives alone, up to a greedy pick within
    GREEDY_GAP of its runner-up (left padding's other float sums may swap it; at most one prompt has one). A
    prompt too long for a batch (it needs the sliding window) runs alone in the same call. The batcher is held
    until all are queued: no thread timing."""
    gen = aiayn.load(lm_run, device="cpu")
    app = create_app(gen, batching=Batching(max_wait_ms=0.0, max_batch_tokens=100_000))
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0, **extra} for p, n, extra in (
        ("the cat", 12, {}), ("a", 5, {}), ("the dog sat on", 9, {"stop": [" the"]}), ("t", 7, {"stream": True}),
        ("the log", 10, {"stream": True, "stop": ["."]}), ("on the mat. the", 6, {}),
        ("the " * 5, 20, {}),  # 20 + 20 tokens > the model's context of 32: the sliding window, alone
        ("the " * 10, 5, {}))]  # a prompt of 40 tokens: refused, and the others are served
    gen_ok = len(bodies) - 1
    with TestClient(app, base_url="http://localhost") as c:
        responses = post_held(app, c, [("/v1/completions", b) for b in bodies], queued=gen_ok)
        stats = app.state.service.batcher.stats
    assert [r.status_code for r in responses] == [200] * gen_ok + [400], [r.text for r in responses]
    assert responses[-1].json()["error"]["code"] == "context_length_exceeded"
    assert stats.calls == 1 and stats.largest_call == gen_ok  # all queued together: one model call
    tok = gen.tokenizers.src
    near_ties = 0
    for b, r in zip(bodies[:gen_ok], responses):
        full = gen.generate(b["prompt"], max_new_tokens=b["max_tokens"])
        alone = full
        for stop in b.get("stop", []):
            alone = alone.split(stop)[0]
        if b.get("stream"):
            events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        else:
            text = r.json()["choices"][0]["text"]
        if fits_in_batch(gen.run, b["prompt"], b["max_tokens"]):  # batched, left-padded: other float sums
            ids = tok.encode(full)
            clear = greedy_clear_picks(gen.model, tok.encode(b["prompt"]), ids)
            if clear < len(ids):  # pick `clear` is a near tie (this CPU's training): equal up to it, not after
                near_ties += 1
                n = len(tok.decode(ids[:clear]))  # a character model: one id, one character
                assert text[:n] == alone[:n], (b, clear)
                continue
        assert text == alone, b
    assert near_ties <= 1, near_ties  # of the 6 batched prompts


def test_stop_scan_never_shows_what_a_stop_string_removes():
    s = StopScan(("END", "xy"))
    shown = [s.add(p) for p in ["ab", "cE", "N", "D more"]]
    assert "".join(shown) == "abc" and s.stopped and s.finish() == ""
    s = StopScan(("END",))
    assert s.add("aE") == "a" and s.add("x") == "Ex" and s.finish() == ""
    s = StopScan(("END",))
    assert s.add("aEN") == "a" and s.finish() == "EN"


def test_one_place_maps_every_error_to_each_protocols_shape():
    """aiayn.serve.errors alone, without a model: the shape a path answers in (asked of the route tables' classes),
    and each exception in each shape."""
    from starlette.requests import Request

    from aiayn.errors import ConfigError
    from aiayn.serve.batcher import Closed, QueueFull
    from aiayn.serve.errors import ERRORS, LibreError, OpenAIError
    from aiayn.serve.libretranslate import LibreTranslate
    from aiayn.serve.native import NativeRoutes
    from aiayn.serve.openai_api import OpenAIRoutes
    from aiayn.serve.routes import Protocols
    from aiayn.serve.schemas import ApiError
    from aiayn.serve.tokenizer_routes import TokenizerRoutes

    protocols = Protocols((NativeRoutes, LibreTranslate, OpenAIRoutes, TokenizerRoutes))
    assert [protocols.of(p) for p in ("/translate", "/frontend/settings", "/v1/completions", "/v1/nothing",
                                      "/tokenize", "/v1/translate", "/health", "/nothing", "/suggest")] == [
        "libretranslate", "libretranslate", "openai", "openai", "openai", "aiayn", "aiayn", "aiayn", "libretranslate"]
    request = Request({"type": "http", "method": "POST", "path": "/x", "headers": [], "query_string": b""})

    def answer(protocol: str, e: Exception) -> tuple[int, dict, str | None]:
        r = ERRORS[protocol](e, request)
        return r.status_code, json.loads(r.body), r.headers.get("retry-after")

    assert answer("aiayn", QueueFull("full")) == (503, {"error": {"code": "queue_full",
                                                                 "message": "full: retry later"}}, "1")
    assert answer("aiayn", ConfigError("bad")) == (422, {"error": {"code": "invalid_request", "message": "bad"}},
                                                   None)
    assert answer("libretranslate", QueueFull("full")) == (429, {"error": "full: retry later"}, None)
    assert answer("libretranslate", Closed("closing")) == (503, {"error": "closing: retry later"}, None)
    assert answer("libretranslate", ApiError(422, "invalid_request", "bad")) == (400, {"error": "bad"}, None)
    assert answer("libretranslate", LibreError(403, "Invalid API key")) == (403, {"error": "Invalid API key"}, None)
    status, body, _ = answer("openai", QueueFull("full"))
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    status, body, _ = answer("openai", ApiError(413, "line_too_long", "long"))
    assert (status, body["error"]["code"], body["error"]["type"]) == (413, "line_too_long", "invalid_request_error")
    assert answer("openai", OpenAIError(404, "no", param="model"))[1]["error"]["param"] == "model"
    status, body, _ = answer("openai", RuntimeError("boom"))
    assert (status, body["error"]["message"], body["error"]["type"]) == (500, "RuntimeError: boom", "server_error")
    assert json.loads(protocols.error_response("/languages", 405, "method_not_allowed", "no").body) == {"error": "no"}


def error_shape(body: dict) -> str:
    """Which protocol's error shape a refusal's body is in."""
    error = body["error"]
    if isinstance(error, str):
        return "libretranslate"  # {"error": message}
    return {frozenset({"code", "message"}): "aiayn",
            frozenset({"message", "type", "param", "code"}): "openai"}[frozenset(error)]


def test_every_mounted_route_refuses_a_bad_request_in_its_own_protocols_shape(client_mt):
    """Each route of each mounted table (read from the app, no list of paths here), refused by the router (a method
    no route takes), by the guard (a POST that is not JSON) and by its handler (a JSON body that does not parse)."""
    from starlette.routing import Route

    app = client_mt.app.app  # the Starlette app behind the guard
    tables = app.state.protocols.tables
    expected = {spec.path: table.protocol for table in tables for _, spec in table.specs()}
    mounted = [r for r in app.routes if isinstance(r, Route)]
    assert {r.path for r in mounted} == set(expected) and len(mounted) == len(expected) >= 16
    assert set(expected.values()) == {"aiayn", "libretranslate", "openai"}
    for r in mounted:
        answers = {"DELETE": client_mt.request("DELETE", r.path)}
        if "POST" in r.methods:
            answers["text/plain"] = client_mt.post(r.path, content=b"x", headers={"Content-Type": "text/plain"})
            answers["bad JSON"] = client_mt.post(r.path, content=b"{", headers={"Content-Type": "application/json"})
        for how, a in answers.items():
            assert 400 <= a.status_code < 500 and error_shape(a.json()) == expected[r.path], (r.path, how, a.text)
    for path, protocol in [("/suggest", "libretranslate"), ("/v1/embeddings", "openai"), ("/nothing", "aiayn")]:
        a = client_mt.get(path)  # paths a table claims but does not serve, and one nobody claims
        assert a.status_code == 404 and error_shape(a.json()) == protocol, (path, a.text)


def test_libretranslate_and_completion_requests_are_checked_alone():
    """The request checks of each protocol's module, without a model or a server."""
    from aiayn.serve.completions import choices_for, completion_request
    from aiayn.serve.errors import LibreError, OpenAIError
    from aiayn.serve.libretranslate import libre_request
    from aiayn.serve.schemas import Limits

    limits = Limits()
    r = libre_request({"q": ["a", "b"], "source": "auto", "target": "de", "alternatives": "1", "secret": "x"},
                          "en", "de", limits)
    assert (r.texts, r.single, r.source, r.fmt, r.alternatives) == (["a", "b"], False, "auto", "text", 1)
    for fields, message in [({"q": [], "source": "en", "target": "de"}, "missing q"),
                            ({"q": "a", "source": "fr", "target": "de"}, "fr is not supported")]:
        with pytest.raises(LibreError, match=message):
            libre_request(fields, "en", "de", limits)
    # LibreTranslate's limits: none by default (a 2,400-character text, 129 texts), its 400 and message when set
    assert len(libre_request({"q": ["a"] * 129, "source": "en", "target": "de"}, "en", "de", limits).texts) == 129
    assert libre_request({"q": "x" * 2400, "source": "en", "target": "de"}, "en", "de", limits).texts[0] == "x" * 2400
    capped = Limits(char_limit=10, batch_limit=2)
    for q, message in [(["a"] * 3, r"request \(3\) exceeds text limit \(2\)"),
                       ("x" * 11, r"request \(11\) exceeds text limit \(10\)")]:
        with pytest.raises(LibreError, match=message) as e:
            libre_request({"q": q, "source": "en", "target": "de"}, "en", "de", capped)
        assert e.value.status == 400
    assert libre_request({"q": ["x" * 10] * 2, "source": "en", "target": "de"}, "en", "de", capped).texts
    c = completion_request({"prompt": ["x", "y"], "n": 2, "seed": 7, "stop": "\n"}, limits)
    assert [(i, p, s) for i, p, s in choices_for(c)] == [(0, "x", 7), (1, "x", 8), (2, "y", 9), (3, "y", 10)]
    with pytest.raises(OpenAIError, match="unknown parameter 'suffixes'"):
        completion_request({"prompt": "x", "suffixes": 1}, limits)


def test_protocol_benchmark_smoke(tiny_run, lm_run, tmp_path):
    """benchmarks/serve_protocols.py runs end to end (its numbers belong to BENCHMARKS.md, not to a test)."""
    from benchmarks import serve_protocols

    out = tmp_path / "p.json"
    r = serve_protocols.main(["--mt-run", str(tiny_run), "--lm-run", str(lm_run), "--clients", "2", "--requests",
                              "6", "--max-tokens", "4", "--repeats", "1", "--prompts", "6", "--out-json", str(out)])
    assert r["batching"]["errors"] == [] and r["streaming"]["pieces"] >= 1 and r["lm_batching"]["errors"] == []
    assert r["scoring"]["prompts"] == 6 and r["scoring"]["one_request_prompts_per_s"] > 0
    assert all(400 <= x["status"] < 500 and x["shape"] for x in r["batching"]["refusals"])
    assert len(r["batching"]["refusals"]) == len(serve_protocols.BAD_REQUESTS)
    assert json.loads(out.read_text()) == r


def test_a_weak_api_key_is_refused_before_loading(tiny_run, capsys, monkeypatch):
    from aiayn.cli import main

    assert main(["serve", str(tiny_run), "--api-key", "short"]) == 2
    assert "--api-key: expected at least 8" in capsys.readouterr().err
    monkeypatch.setenv("AIAYN_API_KEY", "has space in it")
    assert main(["serve", str(tiny_run)]) == 2
    assert "$AIAYN_API_KEY: expected at least 8" in capsys.readouterr().err  # the setting to act on


# lm-evaluation-harness's requests, chat, fields (issue 43) ----------------------------------------------------


@pytest.fixture(scope="module")
def lm(lm_run):
    return aiayn.load(lm_run, device="cpu")


@pytest.fixture(scope="module")
def client_lm(lm):
    with TestClient(create_app(lm, batching=Batching(max_wait_ms=1.0)), base_url="http://localhost") as c:
        yield c


# Served log-probabilities come from batches of other shapes (rows padded together) than direct_logprobs': compared
# within this. A log-probability is a logit minus a logsumexp, so it carries the rounding of the logits' size, not of
# its own (the whole suite under AIAYN_TEST_ROUNDING=6 moved one of -1.75 by 5.1e-5); a wrong row, token or
# position moves one by 1e-2 or more.
LOGPROB_TOL = dict(rel=1e-5, abs=1e-4)


def direct_logprobs(lm, ids: list[int]) -> torch.Tensor:
    """(T-1, V): the model's own log-softmax after each of ``ids`` but the last, computed here."""
    with torch.no_grad():
        return lm.model(torch.tensor([ids]))[0, :-1].float().log_softmax(-1)


def test_echo_logprobs_are_the_models_log_softmax(client_lm, lm):
    """OpenAI's legacy logprobs object for string and token-id prompts: the first token null, each other the
    model's log-softmax of it given the ones before, top_logprobs its N best, text_offset where each token starts
    in the text; max_tokens 1 adds the greedy next token, max_tokens 0 scores the prompt only."""
    tok = lm.tokenizers.src
    prompt = "the cat sat"
    ids = tok.encode(prompt)
    r = client_lm.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 1,
                                                "temperature": 0})
    [choice] = r.json()["choices"]
    lp = choice["logprobs"]
    full = ids + [int(direct_logprobs(lm, ids + [0])[-1].argmax())]  # the greedy next token, from the last row
    want = direct_logprobs(lm, full)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([float(want[t, full[t + 1]]) for t in range(len(full) - 1)],
                                                     **LOGPROB_TOL)
    assert lp["tokens"] == [tok.decode([i]) for i in full] and choice["text"] == tok.decode(full)
    assert lp["text_offset"] == list(range(len(full)))  # one character per token
    for t, top in enumerate(lp["top_logprobs"][1:]):
        assert sorted(top.values(), reverse=True) == pytest.approx(want[t].topk(3).values.tolist(), **LOGPROB_TOL)
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
    # token ids: one prompt, and a batch of two; max_tokens 0 scores the prompt alone
    for prompt_ids, rows in (([5, 6, 7, 8], [[5, 6, 7, 8]]), ([[5, 6, 7], [9, 10, 11, 12, 13]], None)):
        rows = rows or prompt_ids
        r = client_lm.post("/v1/completions", json={"prompt": prompt_ids, "echo": True, "logprobs": 1,
                                                    "max_tokens": 0})
        assert r.status_code == 200, r.text
        for row, choice in zip(rows, r.json()["choices"], strict=True):
            want = direct_logprobs(lm, row)
            got = choice["logprobs"]["token_logprobs"]
            assert got[0] is None and got[1:] == pytest.approx([float(want[t, row[t + 1]])
                                                                for t in range(len(row) - 1)], **LOGPROB_TOL)
            assert choice["text"] == tok.decode(row) and choice["finish_reason"] == "length"
    # logprobs without echo: the completion's tokens only, offsets in the completion's text
    r = client_lm.post("/v1/completions", json={"prompt": "the", "logprobs": 0, "max_tokens": 3, "temperature": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and None not in lp["token_logprobs"] and lp["text_offset"] == [0, 1, 2]
    assert r.json()["choices"][0]["text"] == lm.generate("the", max_new_tokens=3)
    for bad, word in (({"prompt": [[5, 99999]], "echo": True, "max_tokens": 0}, "vocabulary"),
                      ({"prompt": "the", "logprobs": 1, "stream": True}, "stream"),
                      ({"prompt": "the " * 10, "echo": True, "max_tokens": 0}, "context"),
                      ({"prompt": "the", "max_tokens": 0}, "max_tokens"),
                      ({"prompt": "the", "logprobs": 21}, "logprobs")):
        r = client_lm.post("/v1/completions", json=bad)
        assert r.status_code == 400 and word in r.json()["error"]["message"], (bad, r.text)


def test_a_requests_scored_prompts_share_forward_passes(lm, monkeypatch):
    """Echo / logprobs prompts of one request (a harness's batch) are scored several per forward pass (right-padded
    rows of a causal model): 6 prompts, one pass; each row's numbers are its own (up to float rounding). With a
    pass bounded to 12 padded positions the same prompts take several passes, with the same numbers."""
    import aiayn.decode.logprobs as logprobs

    rows = [[5, 6, 7], [9, 10, 11, 12, 13], [5], [7, 7, 7, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16]]
    passes = []
    real = lm.model.forward

    def counting(tokens):
        passes.append(tuple(tokens.shape))
        return real(tokens)

    body = {"prompt": rows, "echo": True, "logprobs": 2, "max_tokens": 0}
    with TestClient(create_app(lm, batching=Batching(max_wait_ms=0.0)), base_url="http://localhost") as c:
        monkeypatch.setattr(lm.model, "forward", counting)
        one = c.post("/v1/completions", json=body)
        one_passes, passes[:] = list(passes), []
        monkeypatch.setattr(logprobs, "SCORE_TOKENS", 12)
        small = c.post("/v1/completions", json=body)
        small_passes = list(passes)
        monkeypatch.setattr(lm.model, "forward", real)
    assert one_passes == [(len(rows), max(map(len, rows)))]  # one pass, padded to the longest row
    assert len(small_passes) > 1 and all(b * t <= 12 or b == 1 for b, t in small_passes)
    for r in (one, small):
        assert r.status_code == 200, r.text
        for row, choice in zip(rows, sorted(r.json()["choices"], key=lambda x: x["index"]), strict=True):
            want = direct_logprobs(lm, row)
            got = choice["logprobs"]["token_logprobs"]
            assert got[0] is None and got[1:] == pytest.approx([float(want[t, row[t + 1]])
                                                                for t in range(len(row) - 1)], **LOGPROB_TOL)
            top = choice["logprobs"]["top_logprobs"]
            assert all(len(x) == 2 for x in top[1:])  # the request's own top 2 of each position


def test_a_multiple_choice_request_as_lm_eval_sends_it(client_lm, lm):
    """lm-evaluation-harness's local-completions with its remote tokenizer: /tokenizer_info, /tokenize of the
    context and of each answer, one batch of token-id prompts (echo, logprobs 1, max_tokens 1), then its own
    parse (the answer's log-probabilities are token_logprobs[ctxlen:-1], greedy when each is its top one)."""
    info = client_lm.get("/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["model_max_length"] == 32

    def encode(text: str) -> list[int]:
        r = client_lm.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        return r.json()["tokens"]

    assert encode(info["eos_token"]) == [lm.tokenizers.specials.eos]
    context, answers = encode("the dog sat on the"), [" log", " mat", " cat"]
    rows = [context + encode(a) for a in answers]
    r = client_lm.post("/v1/completions", json={"model": "run", "prompt": rows, "temperature": 0, "max_tokens": 1,
                                                "logprobs": 1, "seed": 1234, "echo": True})
    assert r.status_code == 200, r.text
    scores = []
    for choice, row in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), rows, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(row) + 1  # the prompt and the one new token
        mine = lp["token_logprobs"][len(context):-1]
        greedy = all(t == max(top.values()) for t, top in zip(mine, lp["top_logprobs"][len(context):-1]))
        want = direct_logprobs(lm, row)
        direct = [float(want[t - 1, row[t]]) for t in range(len(context), len(row))]
        assert mine == pytest.approx(direct, **LOGPROB_TOL)
        assert greedy == all(int(want[t - 1].argmax()) == row[t] for t in range(len(context), len(row)))
        scores.append(sum(mine))
    assert client_lm.post("/detokenize", json={"tokens": rows[0]}).json() == {"prompt": "the dog sat on the log"}
    assert max(range(3), key=scores.__getitem__) == max(range(3), key=lambda k: sum(
        float(direct_logprobs(lm, rows[k])[t - 1, rows[k][t]]) for t in range(len(context), len(rows[k]))))


def test_openai_chat_client_on_a_language_model_and_a_translation_run(lm_server, mt_server, lm, translator):
    """openai's chat.completions, plain and streamed (with include_usage): a language model answers through the
    documented template, a translation run with the translation of the last user message."""
    openai = pytest.importorskip("openai")
    chat = openai.OpenAI(base_url=f"{lm_server}/v1", api_key="unused", max_retries=0).chat.completions
    messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "cat"}]  # the context is 32
    done = chat.create(model="run", messages=messages, max_tokens=12, temperature=0)
    prompt = "System: be\nUser: cat\nAssistant:"
    want = lm.generate(prompt, max_new_tokens=12).split("\nUser:")[0].lstrip()
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == want
    assert done.usage.prompt_tokens == len(prompt)
    chunks = list(chat.create(model="run", messages=messages, max_tokens=12, temperature=0, stream=True,
                              stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks) and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == done.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == done.choices[0].finish_reason
    two = chat.create(model="run", messages=messages, max_tokens=6, temperature=1.0, seed=3, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as e:
        chat.create(model="run", messages=messages, presence_penalty=1.5)
    assert "presence_penalty" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        chat.create(model="gpt-4o", messages=messages)
    mt = openai.OpenAI(base_url=f"{mt_server}/v1", api_key="unused", max_retries=0).chat.completions
    [model] = openai.OpenAI(base_url=f"{mt_server}/v1", api_key="unused").models.list().data
    messages = [{"role": "user", "content": LINES[0]}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": LINES[2]}]
    ours = translator.search([LINES[2]], translator.options(), scores=False)[0][0].text
    assert mt.create(model=model.id, messages=messages).choices[0].message.content == ours  # beam: no temperature
    pieces = mt.create(model=model.id, messages=messages, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == ours


def test_langchain_chat_openai_on_a_language_model_and_a_translation_run(lm_server, mt_server, lm, translator):
    """LangChain's ChatOpenAI (invoke, stream, batch, async) with its default model name, which the language
    model's server answers to as an alias (--model-alias gpt-3.5-turbo); a translation run by its own name."""
    import asyncio

    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=f"{lm_server}/v1", api_key="unused", max_retries=0, temperature=0,
                                       max_tokens=12)
    assert chat.model_name == "gpt-3.5-turbo"  # LangChain's default: the server's alias
    messages = [("system", "be"), ("human", "cat")]
    want = lm.generate("System: be\nUser: cat\nAssistant:", max_new_tokens=12).split("\nUser:")[0].lstrip()
    reply = chat.invoke(messages)
    assert reply.content == want and reply.response_metadata["model_name"] == "run"
    assert "".join(chunk.content for chunk in chat.stream(messages)) == want
    assert [r.content for r in chat.batch([messages, messages])] == [want, want]
    assert asyncio.run(chat.ainvoke(messages)).content == want
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError):  # a name the server was not given
        langchain_openai.ChatOpenAI(base_url=f"{lm_server}/v1", api_key="unused", max_retries=0,
                                    model="gpt-4o").invoke(messages)
    mt = langchain_openai.ChatOpenAI(base_url=f"{mt_server}/v1", api_key="unused", max_retries=0, model="tiny")
    ours = translator.search([LINES[2]], translator.options(), scores=False)[0][0].text
    assert mt.invoke([("human", LINES[2])]).content == ours
    assert "".join(chunk.content for chunk in mt.stream([("human", LINES[2])])) == ours


def test_litellm_openai_route_chats_plain_and_streamed(lm_server, lm, monkeypatch):
    """litellm's ``openai/`` route (an OpenAI-compatible server at ``api_base``), plain and streamed. litellm is
    not in the clients extra (about 245 MB for this one route, docs/serve.md): skipped where it is not installed."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else its import fetches a price list
    litellm = pytest.importorskip("litellm")
    messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "cat"}]
    want = lm.generate("System: be\nUser: cat\nAssistant:", max_new_tokens=12).split("\nUser:")[0].lstrip()
    args = {"model": "openai/run", "api_base": f"{lm_server}/v1", "api_key": "unused", "messages": messages,
            "max_tokens": 12, "temperature": 0}
    assert litellm.completion(**args).choices[0].message.content == want
    pieces = litellm.completion(**args, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in pieces) == want
    args.pop("messages")
    assert litellm.text_completion(**args, prompt="the").choices[0].text == lm.generate("the", max_new_tokens=12)


def test_model_aliases_are_listed_and_answered(lm):
    """``--model-alias``: /v1/models lists the run first, then each alias; a request naming one is served (the
    answer names the run), another name is 404 naming the option."""
    from aiayn.serve.service import Choices

    app = create_app(lm, batching=Batching(max_wait_ms=1.0), choices=Choices(aliases=("gpt-3.5-turbo", "davinci")))
    with TestClient(app, base_url="http://localhost") as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["run", "gpt-3.5-turbo", "davinci"]
        r = c.post("/v1/completions", json={"model": "davinci", "prompt": "the", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "run"
        r = c.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 404 and "--model-alias" in r.json()["error"]["message"]


# A chat template of the run's own: Hugging Face's convention (BOS and EOS by their names; the roles spelt in
# letters the character model knows; a system message refused by the template itself, as many models' templates do)
OWN_TEMPLATE = """{{ bos_token }}{% for m in messages %}
{% if m.role == 'system' %}{{ raise_exception('this model takes no system message') }}{% endif %}
{{ {'user': 'the ', 'assistant': 'a '}[m.role] }}{{ m.content }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}a {% endif %}"""


def run_with_template(lm_run: Path, where: Path, template: str) -> Path:
    """A copy of the language-model run that carries ``template`` as its chat_template.jinja."""
    import shutil

    run = shutil.copytree(lm_run, where / "run")
    (run / "chat_template.jinja").write_text(template, encoding="utf-8")
    return run


def test_a_runs_own_chat_template_is_what_its_chat_reads(lm_run, tmp_path):
    """A run with chat_template.jinja answers chat as that template renders the messages (here, and as
    transformers renders them): the greedy completion of the rendered prompt, its special-token names read as
    those tokens (/tokenize), plain and streamed, not stripped; /tokenizer_info shows the template; a template
    that raises for a request's messages is a 400 in OpenAI's shape and the server goes on."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    lm = aiayn.load(run_with_template(lm_run, tmp_path, OWN_TEMPLATE), device="cpu")
    messages = [{"role": "user", "content": "cat"}, {"role": "assistant", "content": "sat"},
                {"role": "user", "content": [{"type": "text", "text": "dog"}]}]
    plain = [{"role": m["role"], "content": "dog" if isinstance(m["content"], list) else m["content"]}
             for m in messages]
    rendered = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(OWN_TEMPLATE).render(
        messages=plain, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert rendered == "<s>the cat</s>\na sat</s>\nthe dog</s>\na "  # a turn per line
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:  # transformers is an oracle here, not a need of the server
        render_jinja_template = None
    if render_jinja_template is not None:
        assert render_jinja_template(conversations=[plain], chat_template=OWN_TEMPLATE, add_generation_prompt=True,
                                     bos_token="<s>", eos_token="</s>")[0] == [rendered]
    with TestClient(create_app(lm, batching=Batching(max_wait_ms=1.0)), base_url="http://localhost") as c:
        assert c.get("/tokenizer_info").json()["chat_template"] == OWN_TEMPLATE
        ids = c.post("/tokenize", json={"prompt": rendered}).json()["tokens"]
        sp = lm.tokenizers.specials
        assert ids[0] == sp.bos and ids.count(sp.eos) == 3  # the names in the text are the tokens
        want = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0}).json()
        body = {"messages": messages, "max_tokens": 12, "temperature": 0}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want["choices"][0]["text"]
        assert r.json()["usage"] == want["usage"] and r.json()["usage"]["prompt_tokens"] == len(ids)
        streamed = c.post("/v1/chat/completions", json={**body, "stream": True})
        events = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want["choices"][0]["text"]
        r = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "system", "content": "be"}, *messages]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "chat_template_error" and error["param"] == "messages"
        assert "this model takes no system message" in error["message"] and "\n" not in error["message"]
        again = c.post("/v1/chat/completions", json=body).json()  # the refusal left the server as it was
        assert again["choices"][0]["message"]["content"] == want["choices"][0]["text"]


def test_a_chat_template_that_does_not_parse_stops_serve_before_it_listens(lm_run, tmp_path, capsys):
    """A run's chat_template.jinja with a syntax error: aiayn serve says so in one line (the file and its line)
    and exits 2 before anything listens; create_app refuses it the same way. Without the file, chat reads the
    default template and /tokenizer_info says none."""
    from aiayn.cli import main
    from aiayn.errors import ConfigError

    run = run_with_template(lm_run, tmp_path, "{{ bos_token }}\n{% for m in messages %}{{ m.content }}")
    assert main(["serve", str(run), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chat_template.jinja: line 2:" in err[0] and "endfor" in err[0], err
    with pytest.raises(ConfigError, match="chat_template.jinja"):
        create_app(aiayn.load(run, device="cpu"))
    (run / "chat_template.jinja").unlink()
    app = create_app(aiayn.load(run, device="cpu"), batching=Batching(max_wait_ms=1.0))
    with TestClient(app, base_url="http://localhost") as c:
        assert c.get("/tokenizer_info").json()["chat_template"] is None


def test_every_accepted_completion_field_acts_or_is_refused(client_lm, lm):
    """What the server does not do is refused in OpenAI's shape; what it takes changes the answer: more than 4 stop
    strings (lm-evaluation-harness sends a task's every one), stream_options.include_usage, the model's name."""
    base = {"prompt": "the cat", "max_tokens": 12, "temperature": 0}
    whole = lm.generate("the cat", max_new_tokens=12)
    r = client_lm.post("/v1/completions", json={**base, "prompt": lm.tokenizers.src.encode("the cat")})
    assert r.json()["choices"][0]["text"] == whole  # token ids generate as their text does
    stops = ["zz", "qq", "xx", "yy", " o", "."]
    r = client_lm.post("/v1/completions", json={**base, "stop": stops})
    cut = min((whole.find(s) for s in stops if s in whole), default=len(whole))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == whole[:cut]
    for field, value in (("frequency_penalty", 1.5), ("presence_penalty", -0.5), ("best_of", 2),
                         ("logit_bias", {"5": 1}), ("suffix", "x")):
        r = client_lm.post("/v1/completions", json={**base, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, field
        assert client_lm.post("/v1/completions", json={**base, field: None}).status_code == 200
    assert client_lm.post("/v1/completions", json={**base, "frequency_penalty": 0,
                                                   "presence_penalty": 0.0}).status_code == 200
    r = client_lm.post("/v1/completions", json={**base, "model": "davinci-002"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client_lm.post("/v1/completions", json={**base, "model": "run"}).status_code == 200
    r = client_lm.post("/v1/completions", json={**base, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"  # only with stream, as OpenAI
    r = client_lm.post("/v1/completions", json={**base, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] <= 12
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole


def test_a_translation_run_completes_with_its_own_search_unless_sampling_is_asked(client_mt, translator):
    """A client that sends no temperature (the openai package's default) gets the run's beam search, not OpenAI's
    default temperature 1; a temperature > 0 given samples (the same seed, the same draw)."""
    beam = [h[0].text for h in translator.search(LINES, translator.options(), scores=False)]
    r = client_mt.post("/v1/completions", json={"prompt": LINES, "max_tokens": 50})
    assert [c["text"] for c in r.json()["choices"]] == beam
    drawn = translator.search([LINES[2]], translator.options(sample=True, temperature=1.0, seed=5, nbest=1),
                              scores=False)[0][0].text
    r = client_mt.post("/v1/completions", json={"prompt": LINES[2], "temperature": 1.0, "seed": 5})
    assert r.json()["choices"][0]["text"] == drawn


def test_libretranslate_parity_fields_forms_html_detect_settings(client_mt, translator):
    """As LibreTranslate: fields it does not read are ignored (its `secret` too), a repeated form field counts once
    (its first value), format html translates the text between the tags and keeps the markup, /detect answers the
    run's source language, /frontend/settings what its web page reads."""
    def best(texts, formatted=True):
        found = translator.search(texts, translator.options(), scores=False)
        return [libre(t, h[0].text) if formatted else h[0].text for t, h in zip(texts, found)]

    q = {"q": LINES[0], "source": "en", "target": "de"}
    r = client_mt.post("/translate", json={**q, "secret": "s", "colour": 1})
    assert r.status_code == 200 and r.json() == {"translatedText": best([LINES[0]])[0]}
    r = client_mt.post("/translate", content=f"q={LINES[0]}&q={LINES[1]}&source=en&target=de".encode(),
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.json() == {"translatedText": best([LINES[0]])[0]}
    doc = f'<p class="a&amp;b">{LINES[0]} <b>{LINES[1]}</b></p><!-- x --><script>if (a < b) {{}}</script>.'
    r = client_mt.post("/translate", json={**q, "q": [doc, LINES[2]], "format": "html"})
    a, b = (html.escape(t, quote=False) for t in best([LINES[0], LINES[1]], formatted=False))
    want = f'<p class="a&amp;b">{a} <b>{b}</b></p><!-- x --><script>if (a < b) {{}}</script>.'
    assert r.json() == {"translatedText": [want, best([LINES[2]])[0]]}  # html: not formatted, as LibreTranslate
    r = client_mt.post("/detect", data={"q": LINES[0]})
    assert r.status_code == 200 and r.json() == [{"confidence": 100.0, "language": "en"}]
    assert client_mt.post("/detect", json={"q": []}).json() == {"error": "Invalid request: missing q parameter"}
    settings = client_mt.get("/frontend/settings").json()
    assert settings["language"] == {"source": {"code": "auto", "name": "Auto Detect"},
                                    "target": {"code": "de", "name": "German"}}  # LibreTranslate's defaults
    assert settings["charLimit"] == -1 and settings["keyRequired"] is False and settings["filesTranslation"] is False
    # identity pairs, as Argos' IdentityTranslation answers them in LibreTranslate: the text as it is
    for source, target in (("en", "en"), ("de", "de"), ("auto", "en")):
        r = client_mt.post("/translate", json={"q": ["a b", "<b>x</b>"], "source": source, "target": target,
                                               "alternatives": 2})
        assert r.status_code == 200 and r.json()["translatedText"] == ["a b", "<b>x</b>"], (source, target)
        assert r.json()["alternatives"] == [[], []]
    for source, target in (("de", "en"), ("auto", "de"), ("fr", "fr")):  # the model's one direction, no other
        r = client_mt.post("/translate", json={"q": "a b", "source": source, "target": target})
        assert r.status_code == (200 if target == "de" else 400), (source, target)


def test_refusals_before_a_route_come_in_the_protocols_shape(client_mt, client_lm):
    """404, 405 and 415 in OpenAI's error shape on /v1/... (aiayn's own routes keep theirs) and vLLM's tokenizer
    routes, in LibreTranslate's on its routes."""
    r = client_lm.post("/v1/embeddings", json={"input": "a"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = client_lm.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = client_lm.post("/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert "type" in client_lm.get("/tokenize").json()["error"]
    r = client_mt.get("/translate")
    assert r.status_code == 405 and isinstance(r.json()["error"], str)
    r = client_mt.post("/translate", content=b"q=a", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and isinstance(r.json()["error"], str)
    r = client_mt.post("/v1/translate", content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.json()["error"] == {"code": "unsupported_media_type", "message": r.json()["error"]["message"]}


def lm_eval_rolling_windows(tokens: list[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-evaluation-harness 0.4.x's (context, continuation) pairs of a rolling loglikelihood, as its code builds
    them (``TemplateAPI.loglikelihood_rolling``: ``utils.get_rolling_token_windows`` with ``max_seq_len =
    max_length - 2``, ``context_len=1``, then ``utils.make_disjoint_window``), written out here as a reference that
    does not share aiayn's code."""
    max_seq_len, context_len = max_length - 2, 1
    pairs = []
    pred_len, predicted = max_seq_len - context_len + 1, 0
    first_seq_len = min(max_seq_len, len(tokens))
    pairs.append(([prefix] + tokens[:first_seq_len - 1], tokens[:first_seq_len]))
    predicted += first_seq_len
    while predicted < len(tokens):
        window_pred_len = min(len(tokens) - predicted, pred_len)
        window_end = predicted + window_pred_len
        pairs.append((tokens[window_end - max_seq_len - 1:window_end - 1],
                      tokens[window_end - window_pred_len:window_end]))
        predicted += window_pred_len
    return [(a[:len(a) - (len(b) - 1)], b) for a, b in pairs]


def test_rolling_windows_are_lm_evaluation_harnesses():
    from aiayn.eval.rolling import rolling_windows

    for n in (1, 2, 5, 29, 30, 31, 59, 60, 61, 100):
        for max_length in (3, 4, 10, 32):
            tokens = list(range(10, 10 + n))
            want = [(ctx + cont, len(cont)) for ctx, cont in lm_eval_rolling_windows(tokens, 1, max_length)]
            assert rolling_windows(tokens, 1, max_length) == want, (n, max_length)
            assert sum(k for _, k in want) == n and all(len(seq) <= max_length - 1 for seq, _ in want)


ROLLING_TEXT = "the dog sat on the log. the cat sat on the mat.\nthe cat sat on the log. " * 2


def test_evaluate_rolling_equals_the_servers_echo_logprobs_as_lm_eval_sums_them(client_lm, lm, lm_run, tmp_path,
                                                                                capsys):
    """Perplexity equality (issue 43): ``aiayn evaluate LM --src FILE --rolling --max-length 32`` gives the sum that
    lm-eval's rolling loglikelihood gets from the server: its windows (the first after <s>), each sent as
    lm-eval's local-completions sends it (token ids, echo, logprobs 1, max_tokens 1) and summed as it parses the
    answer (``token_logprobs[ctxlen:-1]``)."""
    from aiayn.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text(ROLLING_TEXT, encoding="utf-8")
    assert main(["evaluate", str(lm_run), "--src", str(doc), "--rolling", "--max-length", "32", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    result = json.loads((lm_run / "eval" / "rolling_doc.json").read_text(encoding="utf-8"))
    assert "rolling windows" in out and result["data"]["max_length"] == 32
    info = client_lm.get("/tokenizer_info").json()
    bos = client_lm.post("/tokenize", json={"prompt": info["bos_token"]}).json()["tokens"]
    tokens = client_lm.post("/tokenize", json={"prompt": ROLLING_TEXT}).json()["tokens"]
    pairs = lm_eval_rolling_windows(tokens, bos[0], 32)
    total = 0.0
    for ctx, cont in pairs:
        r = client_lm.post("/v1/completions", json={"model": "run", "prompt": ctx + cont, "echo": True, "logprobs": 1,
                                                    "max_tokens": 1, "temperature": 0, "seed": 1234})
        assert r.status_code == 200, r.text
        total += sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(ctx):-1])
    assert len(pairs) == result["data"]["windows"] > 2 and len(tokens) == result["data"]["n_tokens"]
    assert result["scores"]["loglikelihood"] == pytest.approx(total, **SUM_TOL)  # windows of other shapes
    words = len(ROLLING_TEXT.split()) + 1  # lm-eval's re.split(r"\s+") also counts the empty piece after the end
    assert result["scores"]["word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-4)
    # the blocks aiayn evaluate scores by default are another number: no <s>, the training blocks of the valid text
    assert main(["evaluate", str(lm_run), "--max-length", "32"]) == 2
    assert main(["evaluate", str(lm_run), "--src", str(doc), "--rolling", "--max-length", "33"]) == 2
    assert "3 to the model's context (32)" in capsys.readouterr().err


LM_EVAL_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
{rest}"""


def test_lm_evaluation_harness_runs_every_task_kind(request, lm, tmp_path):
    """lm-evaluation-harness's local-completions, its default tokenizer setting (it finds /tokenizer_info), on a
    local task of each kind; the rolling loglikelihood of a text of several windows is ``aiayn evaluate --rolling``'s
    (and its word perplexity too). lm-eval comes with the clients extra (make test installs it); $AIAYN_LM_EVAL
    names another executable, else `lm_eval` beside this Python or on the PATH; skipped without one."""
    import os
    import shutil
    import subprocess
    import sys

    beside = Path(sys.executable).with_name("lm_eval")  # .venv/bin/python -m pytest: .venv/bin is not on the PATH
    exe = os.environ.get("AIAYN_LM_EVAL") or (str(beside) if beside.is_file() else shutil.which("lm_eval"))
    if not exe:
        pytest.skip("lm-evaluation-harness not installed (the clients extra; $AIAYN_LM_EVAL or lm_eval on the PATH)")
    lm_server = request.getfixturevalue("lm_server")  # started only when lm-eval is there
    rows = {"mc": [{"context": "the dog sat on the", "choices": [" log", " mat"], "label": 0}],
            "ll": [{"context": "the cat sat on", "continuation": " the mat."}],
            "roll": [{"text": ROLLING_TEXT}],
            "gen": [{"context": "the cat sat on the", "target": " mat"}]}
    rest = {"mc": ('multiple_choice', 'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
                   'doc_to_target: "{{label}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n'),
            "ll": ("loglikelihood", 'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
                   'target_delimiter: ""\nmetric_list:\n  - metric: acc\n'),
            "roll": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                     'metric_list:\n  - metric: word_perplexity\n'),
            "gen": ("generate_until", 'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
                    'generation_kwargs:\n  until: ["\\n", ".", "x", "y", "z"]\n  max_gen_toks: 4\n'
                    'metric_list:\n  - metric: exact_match\n')}
    for name, data in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
        kind, text = rest[name]
        task = LM_EVAL_TASK.format(name=f"aiayn_{name}", data=tmp_path / f"{name}.jsonl", kind=kind, rest=text)
        (tmp_path / f"{name}.yaml").write_text(task, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([exe, "run", "--model", "local-completions", "--model_args",
                        f"model=run,base_url={lm_server}/v1/completions,max_length=32",
                        "--tasks", "aiayn_mc,aiayn_ll,aiayn_roll,aiayn_gen", "--include_path", str(tmp_path),
                        "--output_path", str(tmp_path / "out"), "--log_samples"],
                       env={**env, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    [samples] = (tmp_path / "out").rglob("samples_aiayn_roll_*.jsonl")
    got = float(json.loads(samples.read_text().splitlines()[0])["filtered_resps"][0])
    from aiayn.eval.evaluate import EvalData, evaluate_run

    (tmp_path / "doc.txt").write_text(ROLLING_TEXT, encoding="utf-8")
    ours = evaluate_run(lm.path, EvalData(src=str(tmp_path / "doc.txt"), rolling=True, max_length=32), device="cpu")
    assert ours["data"]["windows"] > 2 and got == pytest.approx(ours["scores"]["loglikelihood"], **SUM_TOL)
    [results] = (tmp_path / "out").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]["aiayn_roll"]["word_perplexity,none"]
    assert theirs == pytest.approx(ours["scores"]["word_perplexity"], rel=1e-4)
