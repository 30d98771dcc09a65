"""LibreTranslate and OpenAI protocols of ``aiayn serve`` (issue 33), tested with the real clients against a real
server process: ``libretranslatepy`` on the tiny translation run, the ``openai`` package's completions (streamed
and not) on a tiny language model; the API key and the error shapes in-process."""

from __future__ import annotations

import json
import urllib.error
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from conftest import GREEDY_GAP, greedy_gap, post_held  # noqa: E402  (tests/ is on sys.path under pytest)
from starlette.testclient import TestClient  # noqa: E402

import aiayn  # noqa: E402
from aiayn.decode.generate import fits_in_batch  # noqa: E402
from aiayn.serve.app import create_app  # noqa: E402
from aiayn.serve.protocols import StopScan  # noqa: E402
from benchmarks import serve_load  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
LINES = ["a b c d", "hello world", "the cat sat on the mat"]


@pytest.fixture(scope="module")
def translator(tiny_run):
    return aiayn.load(tiny_run, device="cpu")


@pytest.fixture(scope="module")
def mt_server(tiny_run):
    proc, url, log = serve_load.start_server(tiny_run)
    yield url
    serve_load.stop_server(proc, timeout=30)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A character language model trained a few updates on a small text (the protocol, not the text, is tested)."""
    from aiayn.train.run import train_from_config

    d = tmp_path_factory.mktemp("lm")
    (d / "text.txt").write_text("the cat sat on the mat. the dog sat on the log.\n" * 200, encoding="utf-8")
    (d / "lm.yaml").write_text(f"""task: lm
model: {{d_model: 32, n_heads: 2, d_ff: 64, n_decoder_layers: 2, dropout: 0.0, max_positions: 64}}
data: {{train_src: {d / 'text.txt'}, tokenizer: char, block_size: 32, batch_size: 8}}
train: {{max_updates: 30, warmup: 10, eval_every: 30, save_every: 30, log_every: 10, threads: 1}}
""", encoding="utf-8")
    train_from_config(d / "lm.yaml", d / "run", progress=False)
    return d / "run"


@pytest.fixture(scope="module")
def lm_server(lm_run):
    proc, url, log = serve_load.start_server(lm_run)
    yield url
    serve_load.stop_server(proc, timeout=30)


# LibreTranslate -------------------------------------------------------------------------------------------


def test_libretranslatepy_translates_like_aiayn_translate(mt_server, translator):
    lt_mod = pytest.importorskip("libretranslatepy")
    lt = lt_mod.LibreTranslateAPI(mt_server)
    # one line per request, one request at a time: each decoded alone, as here
    ours = [translator.search([line], translator.options(), scores=False)[0][0].text for line in LINES]
    assert [lt.translate(line, "en", "de") for line in LINES] == ours
    assert lt.translate(LINES[0], "auto", "de") == ours[0]
    assert lt.languages() == [{"code": "en", "name": "English", "targets": ["de"]}]
    with pytest.raises(urllib.error.HTTPError) as e:  # a language the model does not translate
        lt.translate("a b", "en", "fr")
    assert e.value.code == 400 and "fr is not supported" in json.loads(e.value.read())["error"]
    assert lt.translate(LINES[1], "en", "de") == ours[1]  # and the server goes on


def test_libretranslate_json_lists_alternatives_and_errors(client_mt, translator):
    r = client_mt.post("/translate", json={"q": LINES, "source": "en", "target": "de"})
    ours = [h[0].text for h in translator.search(LINES, translator.options(), scores=False)]
    assert r.status_code == 200 and r.json() == {"translatedText": ours}
    r = client_mt.post("/translate", json={"q": LINES[0], "source": "en", "target": "de", "alternatives": 2,
                                           "format": "html"})
    nbest = translator.search([LINES[0]], translator.options(nbest=3, beam=max(3, translator.cfg.decode.beam)),
                              scores=False)[0]
    assert r.json() == {"translatedText": nbest[0].text, "alternatives": [h.text for h in nbest[1:]]}
    for body, status, word in [
        ({"source": "en", "target": "de"}, 400, "missing q"),
        ({"q": 5, "source": "en", "target": "de"}, 400, "q: expected"),
        ({"q": "a", "source": "xx", "target": "de"}, 400, "xx is not supported"),
        ({"q": "a", "source": "en", "target": "de", "format": "pdf"}, 400, "format"),
        ({"q": "a", "source": "en", "target": "de", "colour": 1}, 400, "unknown parameter 'colour'"),
        ({"q": ["a"] * 65, "source": "en", "target": "de"}, 413, "limit is 64"),
        ({"q": "x" * 2001, "source": "en", "target": "de"}, 413, "2001 characters"),
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


@pytest.fixture(scope="module")
def client_mt(translator):
    with TestClient(create_app(translator, max_wait_ms=2.0), base_url="http://localhost") as c:
        yield c


def test_api_key_is_asked_by_every_protocol(translator):
    key = "s3cret-key"
    with TestClient(create_app(translator, max_wait_ms=2.0, api_key=key), base_url="http://localhost") as c:
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
        assert c.get("/languages").status_code == 403
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
    app = create_app(translator, max_wait_ms=0.0, max_batch_tokens=100_000)
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
    [model] = client.models.list().data
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
    limits and stops), streamed or not, and each gives the text it gives alone (greedy picks with a checked margin,
    so left padding's other float sums cannot swap them); a prompt too long for a batch (it needs the sliding
    window) runs alone in the same call. The batcher is held until all are queued: no thread timing."""
    gen = aiayn.load(lm_run, device="cpu")
    app = create_app(gen, max_wait_ms=0.0, max_batch_tokens=100_000)
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
    assert "no new token fits" in responses[-1].json()["error"]["message"]
    assert stats.calls == 1 and stats.largest_call == gen_ok  # all queued together: one model call
    tok = gen.tokenizers.src
    for b, r in zip(bodies[:gen_ok], responses):
        alone = gen.generate(b["prompt"], max_new_tokens=b["max_tokens"])
        if fits_in_batch(gen.run, b["prompt"], b["max_tokens"]):  # batched (left-padded): equal by a clear margin
            assert greedy_gap(gen.model, tok.encode(b["prompt"]), tok.encode(alone)) > GREEDY_GAP, b
        for stop in b.get("stop", []):
            alone = alone.split(stop)[0]
        if b.get("stream"):
            events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        else:
            text = r.json()["choices"][0]["text"]
        assert text == alone, b


def test_stop_scan_never_shows_what_a_stop_string_removes():
    s = StopScan(("END", "xy"))
    shown = [s.add(p) for p in ["ab", "cE", "N", "D more"]]
    assert "".join(shown) == "abc" and s.stopped and s.finish() == ""
    s = StopScan(("END",))
    assert s.add("aE") == "a" and s.add("x") == "Ex" and s.finish() == ""
    s = StopScan(("END",))
    assert s.add("aEN") == "a" and s.finish() == "EN"


def test_protocol_benchmark_smoke(tiny_run, lm_run, tmp_path):
    """benchmarks/serve_protocols.py runs end to end (its numbers belong to BENCHMARKS.md, not to a test)."""
    from benchmarks import serve_protocols

    out = tmp_path / "p.json"
    r = serve_protocols.main(["--mt-run", str(tiny_run), "--lm-run", str(lm_run), "--clients", "2", "--requests",
                              "6", "--max-tokens", "4", "--repeats", "1", "--out-json", str(out)])
    assert r["batching"]["errors"] == [] and r["streaming"]["pieces"] >= 1 and r["lm_batching"]["errors"] == []
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
