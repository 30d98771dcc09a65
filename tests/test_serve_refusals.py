"""What ``aiayn serve`` refuses, and when: the Host allow-list, JSON-only POSTs, CORS off unless asked, values
that crashed it, the attention route's limit, the API key (where it may come from, its type, never in a URL or a
log), bad flags before it starts, and a completion's sampling values, prompt length and the full queue refused
before any stream's 200, in the protocol's shape. (Issues 32 and 44.)
"""

from __future__ import annotations

import json

import pytest
from refusals import one_line  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.usefixtures("one_thread")


# --- a server with one CORS origin ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_run):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    import aiayn
    from aiayn.serve.app import Access, create_app
    from aiayn.serve.batcher import Batching

    tr = aiayn.load(tiny_run, device="cpu")
    app = create_app(tr, batching=Batching(max_wait_ms=1.0), access=Access(cors="https://tools.example"))
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def post(client, path: str, body, **headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=data, headers={"Content-Type": "application/json", **headers})


def test_host_header_must_name_this_server(client):
    r = client.get("/v1/model", headers={"Host": "attacker.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    r = post(client, "/v1/translate", {"text": ["a b"]}, Host="attacker.example:8000")
    assert r.status_code == 403
    for ok in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert client.get("/health", headers={"Host": ok}).status_code == 200, ok


def test_posts_must_be_json_and_cors_is_off_unless_asked(client):
    r = client.post("/v1/translate", content=b'{"text": ["a b"]}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = client.post("/v1/translate", content=b'{"text": ["a b"]}')  # no Content-Type at all
    assert r.status_code == 415
    # another site's page: refused, and no CORS header lets its browser read anything
    r = post(client, "/v1/translate", {"text": ["a b"]}, Origin="https://evil.example")
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = client.options("/v1/translate", headers={"Origin": "https://evil.example",
                                                  "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # the one origin --cors names: preflight and request answered with its header
    r = client.options("/v1/translate", headers={"Origin": "https://tools.example",
                                                  "Access-Control-Request-Method": "POST"})
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "https://tools.example"
    r = post(client, "/v1/translate", {"text": ["a b"]}, Origin="https://tools.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://tools.example"
    r = post(client, "/v1/translate", {"text": ["a b"]}, Origin="http://localhost")  # the page itself
    assert r.status_code == 200


@pytest.mark.parametrize("body, status, code", [
    (b'{"text": ["a"], "beam": ' + b"9" * 5001 + b"}", 400, "bad_json"),
    (b'{"text": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 400, "bad_json"),
    (json.dumps({"text": ["a"], "sample": True, "seed": 2**70}).encode(), 422, "out_of_range"),
    (json.dumps({"text": ["a"], "sample": True, "temperature": 1e-320}).encode(), 422, "out_of_range"),
], ids=["5001-digit number", "400 KB of nesting", "seed 2**70", "temperature 1e-320"])
def test_values_that_crashed_the_server_are_4xx_and_it_keeps_serving(client, body, status, code):
    r = post(client, "/v1/translate", body)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert post(client, "/v1/translate", {"text": ["a b"]}).status_code == 200


def test_attention_covers_the_whole_target_or_refuses_it(client, tiny_run):
    limit = client.get("/v1/model").json()["limits"]["attention_tokens"]
    long = " ".join(["alpha"] * 301)
    r = post(client, "/v1/attention", {"text": "a b", "target": long})
    assert r.status_code == 413 and f"at most {limit - 1}" in r.json()["error"]["message"]
    cross = post(client, "/v1/attention", {"text": "a b", "target": "alpha bravo"}).json()["attention"]["cross"]
    assert cross["queries"][0] == "<s>" and cross["predicts"][-1] == "</s>"  # the whole target, and its end


@pytest.mark.parametrize("flag, value, message", [
    ("--port", "70000", "--port 70000: expected 1-65535"),
    ("--max-wait-ms", "nan", "--max-wait-ms nan"),
    ("--max-wait-ms", "inf", "--max-wait-ms inf"),
    ("--cors", "evil", "expected an origin"),
])
def test_serve_refuses_bad_values_before_it_starts(flag, value, message, tiny_run, capsys):
    pytest.importorskip("starlette")
    assert message in one_line(capsys, ["serve", str(tiny_run), flag, value, "--device", "cpu"])


# --- a server with an API key and --max-queue 2 --------------------------------------------------------------------


@pytest.fixture(scope="module")
def translator(tiny_run):
    import aiayn

    return aiayn.load(tiny_run, device="cpu")


@pytest.fixture(scope="module")
def keyed_client(translator):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from aiayn.serve.app import Access, create_app
    from aiayn.serve.batcher import Batching

    app = create_app(translator, batching=Batching(max_wait_ms=1.0, max_queue=2),
                     access=Access(cors="https://tools.example"), api_key="s3cret-key")
    with TestClient(app, base_url="http://localhost") as c:
        yield c


AUTH = {"Authorization": "Bearer s3cret-key"}


def test_every_route_samples_with_a_tiny_top_p(keyed_client):
    r = keyed_client.post("/v1/translate", json={"text": ["a b c"], "sample": True, "top_p": 1e-300, "seed": 1},
                          headers=AUTH)
    greedy = keyed_client.post("/v1/translate", json={"text": ["a b c"], "beam": 1}, headers=AUTH)
    assert r.status_code == 200 and r.json()["translations"][0]["text"] == greedy.json()["translations"][0]["text"]
    r = keyed_client.post("/v1/completions", json={"prompt": "a b c", "temperature": 1, "top_p": 1e-300}, headers=AUTH)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value", [("top_p", 0), ("temperature", 1e-300)])
def test_a_refused_sampling_value_is_a_400_before_any_stream(keyed_client, stream, field, value):
    body = {"prompt": "a b c", "temperature": 1, field: value, "stream": stream}
    r = keyed_client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "out_of_range" and err["message"].startswith(field), err


@pytest.mark.parametrize("field, value", [("top_p", 0), ("temperature", 1e-300)])
def test_a_chat_stream_checks_its_sampling_values_and_prompt_before_its_200(keyed_client, field, value):
    """Chat completions go through the completions' checks: a refused sampling value or a message too long for
    the model is a 4xx in OpenAI's shape, not a data: error event after the 200."""
    body = {"messages": [{"role": "user", "content": "a b c"}], "temperature": 1, field: value, "stream": True}
    r = keyed_client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["code"] == "out_of_range"
    body = {"messages": [{"role": "user", "content": " ".join(["alpha"] * 301)}], "stream": True}
    r = keyed_client.post("/v1/chat/completions", json=body, headers=AUTH)  # OpenAI's 400 for a too-long text
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("messages", "context_length_exceeded")


def test_a_prompt_too_long_for_the_model_is_refused_before_any_stream(keyed_client):
    body = {"prompt": ["a b", " ".join(["alpha"] * 301)], "temperature": 0, "stream": True}
    r = keyed_client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["message"].startswith("prompt[1]: ")
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_stream_the_queue_cannot_take_is_refused_before_its_200(keyed_client):
    from concurrent.futures import ThreadPoolExecutor

    batcher = keyed_client.app.state.service.batcher
    with ThreadPoolExecutor(2) as pool:
        with batcher.hold():  # --max-queue 2: two requests wait, the stream would be the third
            waiting = [pool.submit(keyed_client.post, "/v1/translate", json={"text": [f"a b {i}"]}, headers=AUTH)
                       for i in range(2)]
            assert batcher.wait_queued(2)
            r = keyed_client.post("/v1/completions", json={"prompt": "a b", "temperature": 0, "stream": True},
                                  headers=AUTH)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
        assert all(f.result().status_code == 200 for f in waiting)


def test_the_choices_of_one_request_are_one_job(keyed_client):
    """--max-queue 2 and a seeded 4-choice completion on an idle server: one job, answered; the same seed
    gives the same choices again (each draw alone, as before)."""
    stats = keyed_client.app.state.service.batcher.stats
    jobs = stats.jobs
    body = {"prompt": "a b c", "temperature": 1.0, "n": 4, "seed": 7}
    r = keyed_client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4 and stats.jobs == jobs + 1, r.text
    again = keyed_client.post("/v1/completions", json=body, headers=AUTH).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in r.json()["choices"]]


def test_a_host_that_only_starts_with_a_loopback_address_is_refused(keyed_client):
    for bad in ("[::1].evil.example", "[::1]evil", "[::1]:80.evil.example", "[::1"):
        r = keyed_client.get("/health", headers={"Host": bad})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", bad
    for ok in ("[::1]", "[::1]:8000"):
        assert keyed_client.get("/health", headers={"Host": ok}).status_code == 200, ok


def test_the_cors_origin_may_send_the_api_key(keyed_client):
    pre = keyed_client.options("/v1/translate", headers={
        "Origin": "https://tools.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert pre.status_code == 204 and {"authorization", "content-type"} <= allowed
    r = keyed_client.post("/v1/translate", json={"text": ["a b"]}, headers={"Origin": "https://tools.example", **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://tools.example"


@pytest.mark.parametrize("api_key, status, word", [
    (12345678, 400, "api_key: expected a string, got int"),
    (["s3cret-key"], 400, "api_key: expected a string, got list"),
    ({"k": 1}, 400, "api_key: expected a string, got dict"),
    ("wrong-key", 403, "Invalid API key"),
])
def test_libretranslate_api_key_of_another_type_is_a_400(keyed_client, api_key, status, word):
    q = {"q": "a b", "source": "en", "target": "de"}
    for path, body in (("/translate", q), ("/detect", {"q": "a b"})):  # /languages reads no key (LibreTranslate)
        r = keyed_client.post(path, json={**body, "api_key": api_key})
        assert r.status_code == status and word in r.json()["error"], (path, r.text)
    assert keyed_client.post("/translate", json={**q, "api_key": "s3cret-key"}).status_code == 200


def test_an_api_key_in_the_url_is_refused_and_never_logged(keyed_client):
    import logging

    from aiayn.serve import RedactKeys

    q = {"q": "a b", "source": "en", "target": "de", "api_key": "s3cret-key"}
    r = keyed_client.post("/translate?api_key=s3cret-key", json=q)
    assert r.status_code == 400 and "not in the URL" in r.json()["error"]
    r = keyed_client.post("/translate?api_key=s3cret-key", data={k: v for k, v in q.items() if k != "api_key"})
    assert r.status_code == 400
    # uvicorn's access line of such a request: the key is hidden
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "POST", "/translate?x=1&API_KEY=s3cret-key&y=2", "1.1", 400), None)
    assert RedactKeys().filter(record) and "s3cret" not in record.getMessage() and "&y=2" in record.getMessage()


def test_a_libretranslate_text_too_long_for_the_model_is_named_q(keyed_client):
    r = keyed_client.post("/translate", json={"q": ["a b", " ".join(["alpha"] * 301)], "source": "en", "target": "de",
                                              "api_key": "s3cret-key"})
    assert r.status_code == 413 and r.json()["error"].startswith("q[1] sentence[0]: "), r.text


def test_a_weak_key_from_the_environment_is_named(tiny_run, capsys, monkeypatch):
    pytest.importorskip("starlette")
    monkeypatch.setenv("AIAYN_API_KEY", "abc")
    assert "$AIAYN_API_KEY: expected at least 8" in one_line(capsys, ["serve", str(tiny_run)])


def test_a_summarization_run_refuses_completions_and_chats_in_its_own_words(tiny_run):
    """A summarization run loads as a translator, but answers no completion: its task's refusal, whether a chat
    holds a user message or not (the translation completer's "no user message" is not its answer)."""
    import dataclasses

    from starlette.testclient import TestClient

    from aiayn.decode.translator import Translator
    from aiayn.run.directory import Run, load_run
    from aiayn.serve.app import create_app
    from aiayn.serve.batcher import Batching

    run = load_run(tiny_run, "cpu")
    run = Run(run.path, dataclasses.replace(run.cfg, task="summarization"), run.model, run.tokenizers)
    why = "this server runs a summarization run; completions need a language model or a translation run"
    with TestClient(create_app(Translator(run), batching=Batching(max_wait_ms=1.0)), base_url="http://localhost") as c:
        for path, body in (("/v1/completions", {"prompt": "a b"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}]}),
                           ("/v1/chat/completions", {"messages": [{"role": "system", "content": "a b"}]})):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task", (path, r.text)
            assert r.json()["error"]["message"] == why
