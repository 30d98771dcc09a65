"""``aiayn serve``: the API on the tiny trained run through an in-process client (Starlette's TestClient),
the dynamic batcher on its own, SIGTERM on a real server process, and the load test's --smoke run."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import threading
import time
from contextlib import closing

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from conftest import post_held  # noqa: E402  (tests/ is on sys.path under pytest)
from starlette.testclient import TestClient  # noqa: E402

import aiayn  # noqa: E402
from aiayn.errors import ConfigError  # noqa: E402
from aiayn.serve.app import create_app  # noqa: E402
from aiayn.serve.batcher import Batcher, Batching, Job, QueueFull  # noqa: E402
from aiayn.serve.schemas import Limits  # noqa: E402
from benchmarks import serve_load  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = ["a b c d", "hello world", "", "the cat sat on the mat", "x y", "one two three four five six"]


@pytest.fixture(scope="module")
def translator(tiny_run):
    return aiayn.load(tiny_run, device="cpu")


@pytest.fixture(scope="module")
def client(translator):
    with TestClient(create_app(translator, batching=Batching(max_wait_ms=2.0)), base_url="http://localhost") as c:
        yield c


def _post(client, path, body, content_type="application/json", **headers):
    headers = {"Content-Type": content_type, **headers} if content_type else headers
    return client.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode(), headers=headers)


def test_translate_keeps_order_and_equals_translator(client, translator):
    r = _post(client, "/v1/translate", {"text": SENTENCES, "beam": 2})
    assert r.status_code == 200, r.text
    got = [t["text"] for t in r.json()["translations"]]
    assert got == translator.translate(SENTENCES, beam=2)
    assert got[2] == "" and r.json()["translations"][2]["nbest"] == []
    assert any(got)  # the toy model does answer something
    # one at a time gives what the translator gives one at a time (all together vs one at a time, which sums
    # floats in another order, is test_translate.py::test_batched_equals_one_by_one's, up to tied scores)
    for s in SENTENCES:
        r = _post(client, "/v1/translate", {"text": [s], "beam": 2})
        assert r.json()["translations"][0]["text"] == translator.translate([s], beam=2)[0]


def test_nbest_is_sorted_and_matches_translator(client, translator):
    r = _post(client, "/v1/translate", {"text": ["a b c d", "x y"], "beam": 3, "nbest": 3})
    assert r.status_code == 200, r.text
    want = translator.translate_hypotheses(["a b c d", "x y"], beam=3, nbest=3)
    for item, hyps in zip(r.json()["translations"], want):
        assert [h["text"] for h in item["nbest"]] == [h.text for h in hyps]
        scores = [h["score"] for h in item["nbest"]]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True)
        assert item["text"] == item["nbest"][0]["text"] and item["score"] == pytest.approx(hyps[0].score)
        assert item["tokens"] == hyps[0].tokens


def test_same_output_as_aiayn_translate(client, tiny_run, tmp_path, capsys):
    from aiayn.cli import main

    src = tmp_path / "in.txt"
    src.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    assert main(["translate", str(tiny_run), "--input", str(src), "--output", str(out), "--beam", "2",
                 "--device", "cpu"]) == 0
    served = [t["text"] for t in _post(client, "/v1/translate", {"text": SENTENCES, "beam": 2}).json()["translations"]]
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == served


BIG = b'{"text": ["' + b"a" * (1 << 20) + b'"]}'
BAD_REQUESTS = [  # (body, status, code, a word the message must contain)
    (b'{"text": ', 400, "bad_json", "JSON"),
    (b'["a"]', 400, "bad_json", "object"),
    (b'{"text": ["caf\xe9"]}', 400, "invalid_utf8", "UTF-8"),
    (BIG, 413, "body_too_large", "limit"),
    ({}, 422, "missing_field", "text"),
    ({"txt": ["a"]}, 422, "unknown_field", "txt"),
    ({"text": 5}, 422, "bad_type", "text"),
    ({"text": ["a", 7]}, 422, "bad_type", "text[1]"),
    ({"text": ["a"], "beam": "4"}, 422, "bad_type", "beam"),
    ({"text": ["a"], "beam": True}, 422, "bad_type", "beam"),
    ({"text": ["a"], "beam": 2.5}, 422, "bad_type", "beam"),
    ({"text": ["a"], "beam": 0}, 422, "out_of_range", "beam"),
    ({"text": ["a"], "beam": 17}, 422, "out_of_range", "beam"),
    ({"text": ["a"], "beam": 2, "nbest": 3}, 422, "out_of_range", "nbest"),
    ({"text": ["a"], "nbest": 0}, 422, "out_of_range", "nbest"),
    (b'{"text": ["a"], "alpha": NaN}', 422, "out_of_range", "alpha"),
    ({"text": ["a"], "length_penalty": "loud"}, 422, "out_of_range", "length_penalty"),
    ({"text": ["a"], "max_tokens": 9}, 422, "unknown_field", "max_tokens"),
    ({"text": ["a"] * 129}, 413, "too_many_sentences", "129"),
    ({"text": ["a" * 2001]}, 413, "line_too_long", "text[0]"),
    ({"text": ["ok", "a b " * 200]}, 413, "line_too_long", "text[1]"),  # over the model's 64 positions
]


@pytest.mark.parametrize("body,status,code,word", BAD_REQUESTS, ids=[c for _, _, c, _ in BAD_REQUESTS])
def test_bad_request_gets_its_4xx_and_the_server_goes_on(client, body, status, code, word):
    r = _post(client, "/v1/translate", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and word in err["message"] and "\n" not in err["message"]
    ok = _post(client, "/v1/translate", {"text": ["a b"]})
    assert ok.status_code == 200 and len(ok.json()["translations"]) == 1


def test_the_server_owns_the_route_of_each_task():
    """The task table names no HTTP path: aiayn's own API maps what a task loads as to its route, and a run of
    another task is told, in one line, which route it has."""
    from aiayn.serve.native import GENERATE, TRANSLATE, need, route_of
    from aiayn.serve.schemas import ApiError
    from aiayn.task import TASKS

    assert {name: route_of(t) for name, t in TASKS.items()} == {
        "translation": TRANSLATE, "summarization": TRANSLATE, "lm": GENERATE}
    assert (TRANSLATE, GENERATE) == ("/v1/translate", "/v1/generate")  # the HTTP API, unchanged for users
    need(TASKS["summarization"], TRANSLATE)
    with pytest.raises(ApiError) as e:
        need(TASKS["lm"], TRANSLATE)
    assert (e.value.status, e.value.code, e.value.message) == (
        400, "wrong_task", "/v1/translate needs a translation or summarization run; this server runs a "
                           "language-model (task lm) run (use /v1/generate)")


def test_other_endpoints_refuse_bad_requests(client):
    r = _post(client, "/v1/generate", {"prompt": "a"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task" and "translation" in r.text
    r = _post(client, "/v1/attention", {"text": "  "})
    assert r.status_code == 422 and r.json()["error"]["code"] == "out_of_range"
    r = _post(client, "/v1/attention", {"text": "a", "target": 3})
    assert r.status_code == 422 and "target" in r.json()["error"]["message"]
    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/v1/translate")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_model_error_gives_500_then_serves(client, translator, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(translator, "search", broken)
    r = _post(client, "/v1/translate", {"text": ["a b"]})
    assert r.status_code == 500
    assert r.json()["error"] == {"code": "model_error", "message": "RuntimeError: CUDA out of memory (simulated)"}
    monkeypatch.undo()
    assert _post(client, "/v1/translate", {"text": ["a b"]}).status_code == 200
    assert client.get("/health").json()["status"] == "ok"


def test_a_lone_request_after_a_lone_call_is_not_held_for_company():
    """One client sending one request at a time: after a model call that ran its one request, with none arriving
    meanwhile, its next request runs at once instead of waiting --max-wait-ms for others (a minute here; the
    30 s bounds only say that it did not wait it). Company that does come is merged: the merging tests."""
    b = Batcher(max_batch_tokens=4096, max_wait_ms=60_000)
    try:
        assert b.submit(Job(group=None, items=[1], cost=1, run=lambda xs: xs)).result(timeout=30) == [1]
        assert b.submit(Job(group="g", items=[2], cost=1, run=lambda xs: xs)).result(timeout=30) == [2]
        assert b.submit(Job(group="g", items=[3], cost=1, run=lambda xs: xs)).result(timeout=30) == [3]
    finally:
        b.close(timeout=60)


def test_the_next_requests_of_a_calls_clients_join_the_request_queued_meanwhile():
    """A request queued while a call ran (here, long past its own wait) waits up to --max-wait-ms after that call's
    answer, so the answered client's next request joins it: one call, not two clients taking turns at the model in
    half-size calls."""
    seen, gate = [], threading.Event()

    def run(items):
        gate.wait(30)
        seen.append(list(items))
        return list(items)

    b = Batcher(max_batch_tokens=2, max_wait_ms=30_000)
    try:
        answered = b.submit(Job(group=None, items=["first client"], cost=1, run=run))
        queued = b.submit(Job(group="g", items=["second client"], cost=1, run=run, arrived=time.monotonic() - 100))
        gate.set()
        assert answered.result(30) == ["first client"]
        # fills the budget: no waiting
        follow_up = b.submit(Job(group="g", items=["first client again"], cost=1, run=run))
        assert queued.result(30) == ["second client"] and follow_up.result(30) == ["first client again"]
        assert seen == [["first client"], ["second client", "first client again"]]
    finally:
        b.close(timeout=60)


def test_a_call_does_not_wait_once_the_last_calls_clients_are_back():
    """Eight clients, each sending its next request when answered: once as many requests wait as the last call ran,
    the call runs, instead of idling the model for the rest of --max-wait-ms (a minute here; the 30 s bounds only say
    that it did not wait it)."""
    seen = []

    def run(items):
        seen.append(list(items))
        return list(items)

    b = Batcher(max_batch_tokens=4096, max_wait_ms=60_000)
    try:
        with b.hold():  # a first call of two (both long past their wait)
            first = [b.submit(Job(group="g", items=[i], cost=1, run=run, arrived=time.monotonic() - 100))
                     for i in (1, 2)]
            b.wait_queued(2)
        assert [f.result(30) for f in first] == [[1], [2]]
        again = [b.submit(Job(group="g", items=[i], cost=1, run=run)) for i in (3, 4)]
        assert [f.result(30) for f in again] == [[3], [4]]
        assert seen == [[1, 2], [3, 4]]
    finally:
        b.close(timeout=60)


def _settles(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Counts the batcher's answers to ``loop``: the jobs of each callback that gives awaiting requests their
    outcome (other callbacks, such as run_in_executor's, pass through)."""
    sizes: list[int] = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        if getattr(callback, "__name__", "") == "_settle":
            sizes.append(len(args[0]))
        return real(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    return sizes


@pytest.mark.parametrize("fails", [False, True])
def test_a_calls_answers_reach_the_event_loop_in_one_callback(fails):
    """Four requests awaited on the event loop share one call: their results (or the model's error) reach the loop
    in one callback, not one each (each woke the loop and took the interpreter from the model's thread)."""
    def run(items):
        if fails:
            raise RuntimeError("the model failed (simulated)")
        return [x * 10 for x in items]

    async def main() -> tuple[list, list[int]]:
        sizes = _settles(asyncio.get_running_loop())
        b = Batcher(max_batch_tokens=4096, max_wait_ms=0)  # held, then all four are queued: one call
        try:
            with b.hold():
                tasks = [asyncio.ensure_future(b.run("g", [i], 1, run)) for i in range(4)]
                await asyncio.get_running_loop().run_in_executor(None, b.wait_queued, 4)
            return await asyncio.gather(*tasks, return_exceptions=True), sizes
        finally:
            b.close(timeout=60)

    results, sizes = asyncio.run(main())
    if fails:
        assert all(isinstance(r, RuntimeError) and "simulated" in str(r) for r in results)
    else:
        assert results == [[0], [10], [20], [30]]
    assert sizes == [4]


def test_a_cancelled_request_leaves_the_queue_before_its_call():
    """A request whose awaiting task is cancelled (its client went away) while it waits in the queue is not run: its
    neighbours' call runs without it, and it is not counted."""
    seen = []

    def run(items):
        seen.append(list(items))
        return list(items)

    async def main() -> list:
        b = Batcher(max_batch_tokens=4096, max_wait_ms=0)  # held, then both left are queued: one call
        try:
            with b.hold():
                tasks = [asyncio.ensure_future(b.run("g", [i], 1, run)) for i in range(3)]
                await asyncio.get_running_loop().run_in_executor(None, b.wait_queued, 3)
                tasks[1].cancel()
                await asyncio.sleep(0)  # the cancellation reaches the job
            done = await asyncio.gather(*tasks, return_exceptions=True)
            assert b.stats.jobs == 2
            return done
        finally:
            b.close(timeout=60)

    done = asyncio.run(main())
    assert done[0] == [0] and isinstance(done[1], asyncio.CancelledError) and done[2] == [2]
    assert seen == [[0, 2]]


def test_workers_run_calls_side_by_side():
    """Two workers: a call that waits until another call has started finishes, which one worker never would (the
    second call would queue behind it); each worker's setup ran on its own thread; a call's stop question
    (call_cancelled) is its own worker's."""
    started, both = threading.Barrier(2, timeout=30), []
    b = Batcher(max_batch_tokens=1, max_wait_ms=0, workers=2)  # a budget of 1: one job a call
    try:
        threads: set = set()
        b.setup(lambda worker: threads.add((worker, threading.current_thread().name)))
        assert threads == {(0, "aiayn-serve-model-0"), (1, "aiayn-serve-model-1")}

        def run(items):
            started.wait()  # raises BrokenBarrierError after 30 s alone
            both.append(b.call_cancelled())
            return list(items)

        gone = threading.Event()
        gone.set()
        jobs = [b.submit(Job(group="g", items=[i], cost=1, run=run, cancelled=gone if i == 0 else None))
                for i in range(2)]
        assert sorted(f.result(60)[0] for f in jobs) == [0, 1]
        assert sorted(both) == [False, True]  # the cancelled job's call, and the other one's
        assert b.stats.calls == 2 and b.stats.jobs == 2
    finally:
        b.close(timeout=60)


def test_workers_take_every_job_once():
    """Three workers, 300 jobs of three groups submitted from four threads: every job runs once, in a call of its
    own group, and gets its own results; the counters add up; close finishes what is queued."""
    calls: list = []
    lock = threading.Lock()

    def run(items):
        with lock:
            calls.append(list(items))
        time.sleep(0.001)
        return [x * 10 for x in items]

    b = Batcher(max_batch_tokens=8, max_wait_ms=2, max_queue=1000, workers=3)
    futures: dict = {}

    def client(k):
        for i in range(k, 300, 4):
            futures[i] = b.submit(Job(group=i % 3, items=[i], cost=1, run=run))

    try:
        senders = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
    finally:
        b.close(timeout=120)
    assert {i: f.result(0) for i, f in futures.items()} == {i: [i * 10] for i in range(300)}
    ran = sorted(x for call in calls for x in call)
    assert ran == list(range(300)) and all(len({x % 3 for x in call}) == 1 for call in calls)
    assert b.stats.jobs == 300 and b.stats.items == 300 and b.stats.calls == len(calls) and b.queued == 0


def test_workers_out_of_range_are_refused():
    from aiayn.serve.server import ServeOptions

    for bad in (0, 65):
        for build in (Batcher, Batching, ServeOptions):
            with pytest.raises(ConfigError, match=f"--workers {bad}: expected 1-64"):
                build(workers=bad)


def test_health_and_model(client, translator):
    from aiayn.model.transformer import count_parameters

    assert _post(client, "/v1/translate", {"text": ["a b"]}).status_code == 200  # counted whatever ran before
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["calls"] >= 1 and h["jobs"] >= h["calls"] and h["busy_s"] > 0
    m = client.get("/v1/model").json()
    assert m["task"] == "translation" and m["device"] == "cpu" and m["precision"] == "float32"
    assert m["parameters"] == count_parameters(translator.model)
    assert m["config"]["model"]["n_heads"] == 2 and m["limits"]["max_sentences"] == 128
    assert m["page"] == {"route": "/v1/translate", "architecture": "encoder-decoder", "source": "Sentence",
                         "action": "Translate"}


def test_the_page_is_told_what_the_run_offers_by_its_corpus():
    """/v1/model's ``page`` (what static/app.js shows: the route it asks, the axes of its maps, its words) comes from
    the run's route, architecture and corpus, not from its task's name: a summarizer's documents, a language model's
    prompt (of running text or of "document <sep> summary" rows)."""
    from aiayn.config import Config, DataConfig
    from aiayn.serve.native import STATIC, page_json
    from aiayn.task import TASKS

    assert page_json(Config(task="summarization")) == {"route": "/v1/translate", "architecture": "encoder-decoder",
                                                       "source": "Document", "action": "Summarize"}
    lm = {"route": "/v1/generate", "architecture": "decoder-only", "source": "Prompt", "action": "Continue"}
    assert page_json(Config(task="lm")) == page_json(Config(task="lm", data=DataConfig(format="jsonl"))) == lm
    page = (STATIC / "app.js").read_text(encoding="utf-8")
    assert "m.page" in page and not [name for name in TASKS if f'"{name}"' in page]  # the page names no task


def test_attention_maps(client, translator):
    r = _post(client, "/v1/attention", {"text": "a b c"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["generated"] and d["target"] == translator.translate("a b c", beam=1)
    cfg = translator.cfg.model
    src_toks = translator.tokenizers.src.pieces("a b c") + ["</s>"]
    for kind, layers in (("encoder", cfg.n_encoder_layers), ("decoder_self", cfg.n_decoder_layers),
                         ("cross", cfg.n_decoder_layers)):
        k = d["attention"][kind]
        w = k["weights"]
        assert (k["layers"], k["heads"]) == (layers, cfg.n_heads) == (len(w), len(w[0]))
        assert len(w[0][0]) == len(k["queries"]) and len(w[0][0][0]) == len(k["keys"])
        for row in (r for layer in w for head in layer for r in head):
            assert sum(row) == pytest.approx(1.0, abs=1e-4)
    assert d["attention"]["cross"]["keys"] == src_toks == d["attention"]["encoder"]["queries"]
    # A given target: the decoder's queries are <s> + its pieces.
    d = _post(client, "/v1/attention", {"text": "a b c", "target": "c b a"}).json()
    assert not d["generated"]
    assert d["attention"]["cross"]["queries"] == ["<s>"] + translator.tokenizers.tgt.pieces("c b a")


def test_page_and_static_files_are_served_without_cdn(client):
    html = client.get("/")
    assert html.status_code == 200 and "text/html" in html.headers["content-type"]
    assert 'id="maps"' in html.text and '<label for="src"' in html.text and 'src="/static/app.js"' in html.text
    for path in re.findall(r'(?:src|href)="([^"]+)"', html.text):
        assert path.startswith("/static/"), path  # nothing from elsewhere
        assert client.get(path).status_code == 200
    js = client.get("/static/app.js").text
    assert set(re.findall(r"https?://[^\s\"'`]+", js)) == {"http://www.w3.org/2000/svg"}  # the SVG namespace only
    assert "data-weight" in js and "aria-label" in js


def test_concurrent_requests_share_model_calls_and_give_the_same_answers(translator):
    """Requests queued together are merged per decoding options (beam 2 and beam 1 never share a call), and
    each gets its own slice of that call's answers. The batcher is held until all are queued (no timing)."""
    app = create_app(translator, batching=Batching(max_wait_ms=0.0, max_batch_tokens=100_000))
    calls: list[tuple[list[str], int]] = []
    real = translator.search

    def counting(texts, opts, scores=True, **kwargs):
        calls.append((list(texts), opts.beam))
        return real(texts, opts, scores, **kwargs)

    texts = [s for s in SENTENCES if s] + ["b a", "c c c"]
    bodies = [{"text": [t], "beam": 2} for t in texts] + [{"text": [t], "beam": 1} for t in texts[:3]]
    with TestClient(app, base_url="http://localhost") as c, pytest.MonkeyPatch.context() as mp:
        mp.setattr(translator, "search", counting)
        responses = post_held(app, c, [("/v1/translate", b) for b in bodies])
        stats = app.state.service.batcher.stats
    assert all(r.status_code == 200 for r in responses)
    # One call per group, holding every request of it (in arrival order, which the threads decide).
    assert len(calls) == 2 and {beam: sorted(t) for t, beam in calls} == {2: sorted(texts), 1: sorted(texts[:3])}
    assert stats.calls == 2 and stats.largest_call == len(texts)
    for texts_of_call, beam in calls:  # each answer is its slice of the merged call, recomputed the same way
        want = dict(zip(texts_of_call, (h[0].text for h in real(texts_of_call, translator.options(beam=beam)))))
        for b, r in zip(bodies, responses):
            if b["beam"] == beam:
                assert r.json()["translations"][0]["text"] == want[b["text"][0]], b
                assert r.json()["options"]["beam"] == beam


def test_full_queue_gives_503_then_serves(translator):
    app = create_app(translator, batching=Batching(max_wait_ms=0.0, max_queue=1, max_batch_tokens=100_000))
    batcher = app.state.service.batcher
    with TestClient(app, base_url="http://localhost") as c:
        results: list = []
        first = threading.Thread(target=lambda: results.append(_post(c, "/v1/translate", {"text": ["a b"]})))
        with batcher.hold():  # the first request stays queued until the second has been refused
            first.start()
            assert batcher.wait_queued(1)
            r = _post(c, "/v1/translate", {"text": ["a b"], "beam": 1})  # the one queue slot is taken
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
        first.join()
        assert results[0].status_code == 200
        assert _post(c, "/v1/translate", {"text": ["a b"]}).status_code == 200


def test_batcher_groups_by_key_and_budget():
    seen = []
    gate = threading.Event()

    def run(items):
        gate.wait(5)
        seen.append(list(items))
        return [x * 10 for x in items]

    b = Batcher(max_batch_tokens=5, max_wait_ms=50, max_queue=10)
    blocker = b.submit(Job(group=None, items=[0], cost=1, run=run))  # holds the worker while the others queue up
    jobs = [Job(group="g", items=[1], cost=2, run=run), Job(group="h", items=[2], cost=1, run=run),
            Job(group="g", items=[3, 4], cost=2, run=run), Job(group="g", items=[5], cost=2, run=run)]
    futures = [b.submit(j) for j in jobs]
    gate.set()
    assert [f.result(5) for f in futures] == [[10], [20], [30, 40], [50]]
    assert blocker.result(5) == [0]
    # g's first two jobs fill the budget (2 + 2 <= 5 < 6); h waits its turn; the last g job runs next.
    assert seen == [[0], [1, 3, 4], [2], [5]]
    assert b.stats.calls == 4 and b.stats.jobs == 5 and b.stats.largest_call == 2
    b.close(5)


def test_batcher_queue_bound_cancel_and_close():
    gate, entered = threading.Event(), threading.Event()
    ran = []

    def run(items):
        entered.set()
        gate.wait(5)
        ran.extend(items)
        return list(items)

    b = Batcher(max_batch_tokens=10, max_wait_ms=0, max_queue=2)
    b.submit(Job(group=None, items=["busy"], cost=1, run=run))
    assert entered.wait(5)  # the worker runs it: the queue is empty again
    kept = b.submit(Job(group="g", items=["kept"], cost=1, run=run))
    gone = b.submit(Job(group="g2", items=["cancelled"], cost=1, run=run))
    with pytest.raises(QueueFull):
        b.submit(Job(group="g", items=["over"], cost=1, run=run))
    assert gone.cancel()
    gate.set()
    b.close(5)  # finishes what is queued
    assert kept.result(0) == ["kept"] and ran == ["busy", "kept"]


def test_missing_extra_is_one_line(monkeypatch, tiny_run, capsys):
    from aiayn.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", str(tiny_run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'aiayn[serve]'" in err and "uvicorn" in err


def test_port_in_use_is_a_one_line_error():
    from aiayn.errors import ConfigError
    from aiayn.serve import listen

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
        listen("127.0.0.1", port)
    sock.close()


def test_the_server_socket_answers_without_nagle_delays():
    """asyncio (which uvicorn serves on) sets TCP_NODELAY only on sockets that say they are TCP: a socket made with
    proto 0 left it off, and a keep-alive client's every request after the first then waited ~40 ms for the
    response's last segment (Nagle's algorithm against the client's delayed ACK; /health took 44 ms instead of
    0.2). The connection asyncio accepts on :func:`listen`'s socket has TCP_NODELAY set."""
    import asyncio
    import socket

    from aiayn.serve import listen

    async def accepted_nodelay() -> int:
        sock = listen("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 30)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0


@pytest.mark.parametrize("workers", [None, 2])  # None: the default, one worker
def test_the_model_computes_on_its_own_thread_with_the_chosen_cpu_threads(tiny_run, monkeypatch, workers):
    """``aiayn serve``: the warm-up and every model call run on the batcher's threads, with their share of the CPU
    threads the command chose; the thread that answers HTTP keeps to one, so that it never starts an OpenMP team of
    its own (with one, GNU OpenMP stopped spinning between the model thread's operations, and a 2-thread server
    decoded at half speed)."""
    import threading

    import torch
    import uvicorn

    from aiayn.serve import app as app_module
    from aiayn.serve import server

    seen: dict = {}
    warm_up = app_module.warm_up

    def watched_warm_up(model):
        seen.setdefault("warm_up", set()).add((threading.current_thread().name, torch.get_num_threads()))
        warm_up(model)

    def run(self, sockets=None):  # in place of serving: what each thread computes with
        svc = self.config.app.state.service
        seen["http"] = torch.get_num_threads()
        b = svc.batcher
        b.setup(lambda worker: seen.setdefault("model", set()).add(
            (worker, threading.current_thread().name, torch.get_num_threads())))
        both = threading.Barrier(2, timeout=30)

        def call(items):  # what a model call computes with
            both.wait()
            return [torch.get_num_threads()]

        if b.workers == 2:
            with b.hold():  # two requests at once: a call each, side by side, on a thread each
                pair = [b.submit(Job(group="g", items=[i], cost=1, run=call)) for i in range(2)]
                b.wait_queued(2)
            seen["side by side"] = sorted(f.result(60)[0] for f in pair)
        b.close(timeout=60)
        self.started = True

    monkeypatch.setattr(app_module, "warm_up", watched_warm_up)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what aiayn.cli set from --threads 2
    try:
        assert server.serve(str(tiny_run), server.ServeOptions(port=0, device="cpu", workers=workers)) == 0
    finally:
        torch.set_num_threads(before)
    if workers is None:  # the default: one worker
        assert seen == {"warm_up": {("aiayn-serve-model-0", 2)}, "http": 1, "model": {(0, "aiayn-serve-model-0", 2)}}
    else:  # --workers 2: the 2 threads shared out, one each; two requests run side by side
        assert seen == {"warm_up": {("aiayn-serve-model-0", 1), ("aiayn-serve-model-1", 1)}, "http": 1,
                        "model": {(0, "aiayn-serve-model-0", 1), (1, "aiayn-serve-model-1", 1)},
                        "side by side": [1, 1]}


def test_sigterm_finishes_the_request_in_flight_and_exits_0(tiny_run):
    # --max-wait-ms 1500: a lone request waits 1.5 s for company before its model call, so it is surely in
    # flight when SIGTERM comes.
    proc, url, log = serve_load.start_server(tiny_run, "--max-wait-ms", "1500")
    try:
        with closing(serve_load.connect(url)) as conn:
            assert serve_load.request(conn, "GET", "/health")[0] == 200
        answer: list = []

        def ask() -> None:
            with closing(serve_load.connect(url)) as conn:
                answer.append(serve_load.request(conn, "POST", "/v1/translate", {"text": ["a b c", "x y"]}))

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with closing(serve_load.connect(url)) as conn:
                if serve_load.request(conn, "GET", "/health")[1]["queued"] >= 1:
                    break
            time.sleep(0.02)
        status = serve_load.stop_server(proc, timeout=30)
        t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert status == 0, "\n".join(log)
    assert answer and answer[0][0] == 200 and len(answer[0][1]["translations"]) == 2
    assert any("Shutting down" in line for line in log)


def test_load_smoke(tiny_run, tmp_path, monkeypatch):
    monkeypatch.delenv("AIAYN_LIBRETRANSLATE", raising=False)  # the peer: skipped with its reason
    md, out = tmp_path / "B.md", tmp_path / "serve_load.json"
    result = serve_load.main(["--run", str(tiny_run), "--smoke", "--md", str(md), "--out-json", str(out)])
    assert result["exit_status"] == 0
    assert [p["clients"] for p in result["phases"]] == [1, 4]
    for p in result["phases"]:
        assert p["ok"] > 0 and p["errors_5xx"] == 0 and p["errors"] == {}
        assert p["latency_ms"]["p50"] <= p["latency_ms"]["p99"] <= p["latency_ms"]["max"]
        assert p["rss_mib"]["max"] > 0
        assert 0 < p["model_busy"] <= 1.05  # one worker: at most the phase's length (timed apart, a hair over)
    text = md.read_text(encoding="utf-8")
    assert "<!-- BEGIN serve_load -->" in text and "python -m benchmarks.serve_load" in text
    assert json.loads(out.read_text())["phases"][0]["requests"] == result["phases"][0]["requests"]
    assert "AIAYN_LIBRETRANSLATE" in result["peer"]["skipped"] and "LibreTranslate: not measured (needs" in text
    assert result["options"]["stop"] == "exact"  # the run's own search (tiny_run's config)


def test_load_smoke_with_the_peers_search(tiny_run, tmp_path):
    """``--argos-search``: the server runs Argos' search (the LibreTranslate peer's), and the record says so."""
    result = serve_load.main(["--run", str(tiny_run), "--smoke", "--no-peer", "--clients", "1", "--argos-search",
                              "--md", str(tmp_path / "B.md"), "--out-json", str(tmp_path / "s.json")])
    assert result["exit_status"] == 0 and "--stop first" in result["server_command"]
    assert {k: result["options"][k] for k in ("beam", "alpha", "stop")} == {"beam": 4, "alpha": 0.2, "stop": "first"}


@pytest.fixture(scope="module")
def lm_client(tmp_path_factory):
    """A language-model server on an untrained char LM (the API contract, not the text, is under test)."""
    import torch

    from aiayn.config import config_from_dict
    from aiayn.data.tokenizer import CharTokenizer, TokenizerPair
    from aiayn.decode.generate import Generator
    from aiayn.model import build_model
    from aiayn.run.directory import Run

    tok = CharTokenizer("abcdefghij \n")
    cfg = config_from_dict({"task": "lm", "data": {"tokenizer": "char", "block_size": 24},
                            "model": {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_decoder_layers": 2, "dropout": 0.0,
                                      "max_positions": 24, "vocab_size": tok.vocab_size}})
    torch.manual_seed(0)
    run = Run(tmp_path_factory.mktemp("lm"), cfg, build_model(cfg.model, "lm").eval(), TokenizerPair(tok, tok))
    gen = Generator(run)
    with TestClient(create_app(gen, limits=Limits(max_new_tokens=20)), base_url="http://localhost") as c:
        yield c, gen


def test_generate_on_a_language_model(lm_client):
    c, gen = lm_client
    r = _post(c, "/v1/generate", {"prompt": "abc", "temperature": 0, "max_new_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == gen.generate("abc", max_new_tokens=8, sample=False)
    drawn = [_post(c, "/v1/generate", {"prompt": "ab", "seed": 3, "max_new_tokens": 6}).json()["text"] for _ in "12"]
    assert drawn[0] == drawn[1] == gen.generate("ab", sample=True, temperature=1.0, seed=3, max_new_tokens=6)
    for body, code, word in (({"prompt": 3}, "bad_type", "prompt"), ({"prompt": "a", "top_p": 2.0}, "out_of_range",
                             "top_p"), ({"prompt": "a", "max_new_tokens": 21}, "out_of_range", "max_new_tokens"),
                             ({"prompt": "a", "beam": 2}, "unknown_field", "beam"),
                             ({"prompt": "abcdefghij" * 3}, "invalid_request", "prompt")):  # longer than the context
        r = _post(c, "/v1/generate", body)
        assert r.status_code == 422 and r.json()["error"]["code"] == code and word in r.json()["error"]["message"]
    r = _post(c, "/v1/translate", {"text": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task" and "language-model" in r.text
    d = _post(c, "/v1/attention", {"text": "abc"}).json()
    assert list(d["attention"]) == ["decoder_self"] and d["attention"]["decoder_self"]["queries"] == ["a", "b", "c"]
    m = c.get("/v1/model").json()
    assert m["task"] == "lm" and m["page"]["route"] == "/v1/generate" and m["page"]["architecture"] == "decoder-only"


def test_attention_refuses_a_sentence_longer_than_the_model(client):
    r = _post(client, "/v1/attention", {"text": "a b " * 100})
    assert r.status_code == 413 and r.json()["error"]["code"] == "line_too_long"
    assert _post(client, "/v1/attention", {"text": "a b"}).status_code == 200
