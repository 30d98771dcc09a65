"""A stream whose client leaves stops within one decoding step: completions (batched rows and alone, sliding),
chat completions, a request still queued (never run), and a translation stream (its search stops at the next
step); the server goes on serving. A real uvicorn server in this process, whose model counts its decoding calls.
(Issue 44.)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def translator(tiny_run):
    import aiayn

    return aiayn.load(tiny_run, device="cpu")


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A character language model trained a few updates (the cancellation, not the text, is tested)."""
    from aiayn.train.run import train_from_config

    d = tmp_path_factory.mktemp("lm")
    (d / "text.txt").write_text("the cat sat on the mat. the dog sat on the log.\n" * 100, encoding="utf-8")
    (d / "lm.yaml").write_text(f"""task: lm
model: {{d_model: 32, n_heads: 2, d_ff: 64, n_decoder_layers: 2, dropout: 0.0, max_positions: 64}}
data: {{train_src: {d / 'text.txt'}, tokenizer: char, block_size: 32, batch_size: 8}}
train: {{max_updates: 4, warmup: 2, eval_every: 4, save_every: 4, log_every: 2, threads: 1}}
""", encoding="utf-8")
    train_from_config(d / "lm.yaml", d / "run", progress=False)
    return d / "run"


def _until(condition, what: str, timeout: float = 60.0) -> None:
    """Wait for a state (not for a time): poll ``condition`` until it holds; fail naming ``what`` if it never does."""
    import time

    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def _live(loaded):
    """A real uvicorn server (in this process, on a free port) for a loaded run, whose model's ``decode`` counts its
    calls and, once armed, stops at call ``gate_at`` until the test opens ``gate``: the test then knows exactly how
    many decoding steps ran when the client left."""
    pytest.importorskip("uvicorn")
    import socket
    import threading

    import uvicorn

    from aiayn.search import native
    from aiayn.serve.app import create_app
    from aiayn.serve.batcher import Batching

    # the PyTorch search, whose steps each call the model's decode (the native loop asks the same per-step stop
    # callback without one: tests/test_native.py::test_stop_callback_ends_the_search)
    patch = pytest.MonkeyPatch()
    patch.setattr(native, "chosen", lambda *a: False)
    model, real = loaded.run.model, loaded.run.model.decode
    box = {"calls": 0, "gate_at": None, "at_gate": threading.Event(), "gate": threading.Event()}

    def decode(*args, **kwargs):
        box["calls"] += 1
        if box["calls"] == box["gate_at"]:
            box["at_gate"].set()
            box["gate"].wait(60)
        return real(*args, **kwargs)

    model.decode = decode
    app = create_app(loaded, batching=Batching(max_wait_ms=0.0))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _until(lambda: server.started, "the server started")
        box["port"], box["app"] = sock.getsockname()[1], app
        yield box
    finally:
        box["gate"].set()
        server.should_exit = True
        thread.join(60)
        sock.close()
        del model.decode  # the class's own again
        patch.undo()


@pytest.fixture
def live_lm(lm_run):
    import aiayn

    with _live(aiayn.load(lm_run, device="cpu")) as box:
        yield box


def _open_stream(port: int, max_tokens: int, prompt: str = "the", stream: bool = True, chat: bool = False):
    """A completion (or, with ``chat``, a chat completion whose one user message is ``prompt``) sent on a new
    connection, its answer not read yet."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize("max_tokens", [20, 60], ids=["batched rows", "alone (sliding window)"])
def test_a_client_that_leaves_a_stream_stops_its_decoding_within_one_step(live_lm, max_tokens):
    from aiayn.decode.generate import fits_in_batch

    svc = live_lm["app"].state.service
    assert fits_in_batch(svc.model.run, "the", max_tokens) == (max_tokens == 20)  # both paths are covered
    live_lm["gate_at"] = 3
    conn = _open_stream(live_lm["port"], max_tokens)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")  # the first token's event
    assert live_lm["at_gate"].wait(60)  # the third decoding step is running
    conn.close()  # the client leaves after one event
    _until(lambda: svc.batcher.stats.cancelled == 1, "the server saw the client leave")
    live_lm["gate"].set()
    _until(lambda: svc.batcher.queued == 0, "the model's thread is idle")
    assert live_lm["calls"] == 3  # the step in flight finished; not one more (it would have run to 20 or 60)


def test_a_chat_stream_whose_client_leaves_stops_its_decoding_within_one_step(live_lm):
    """Chat completions answer through the completions' one streaming path (EventStream): the same cancellation."""
    svc = live_lm["app"].state.service
    live_lm["gate_at"] = 3
    conn = _open_stream(live_lm["port"], 20, "the", chat=True)
    resp = conn.getresponse()
    assert resp.status == 200 and b'"role": "assistant"' in resp.readline()  # the opening chunk
    assert live_lm["at_gate"].wait(60)  # the third decoding step is running
    conn.close()  # the client leaves
    _until(lambda: svc.batcher.stats.cancelled == 1, "the server saw the client leave")
    live_lm["gate"].set()
    _until(lambda: svc.batcher.queued == 0, "the model's thread is idle")
    assert live_lm["calls"] == 3  # the step in flight finished; not one more


def test_a_stream_whose_client_leaves_while_queued_never_runs(live_lm):
    svc = live_lm["app"].state.service
    with svc.batcher.hold():
        conn = _open_stream(live_lm["port"], 20)
        assert svc.batcher.wait_queued(1)
        conn.close()
        _until(lambda: svc.batcher.stats.cancelled == 1, "the server saw the client leave")
    _until(lambda: svc.batcher.queued == 0, "the model's thread is idle")
    assert live_lm["calls"] == 0 and svc.batcher.stats.calls == 0  # the job was dropped from the queue
    r = _open_stream(live_lm["port"], 5).getresponse()  # and the server goes on
    assert r.status == 200 and r.read().endswith(b"data: [DONE]\n\n")


def test_a_translation_stream_whose_client_leaves_stops_its_search_within_one_step(translator):
    """A translation is decoded whole, then sent: a client that leaves meanwhile stops the search at its next
    step (the batcher's call_cancelled, asked once per step), so its model calls end there."""
    prompt = "a b c d e f g h"
    with _live(translator) as live:
        svc = live["app"].state.service
        full = _open_stream(live["port"], 16, prompt, stream=False).getresponse()
        assert full.status == 200 and full.read()
        steps = live["calls"]
        assert steps >= 4  # the whole search takes several steps: stopping at 2 is seen
        live["calls"], live["gate_at"] = 0, 2
        conn = _open_stream(live["port"], 16, prompt)
        assert live["at_gate"].wait(60)  # the second decoding step is running; no event is sent before the end
        conn.close()
        _until(lambda: svc.batcher.stats.cancelled == 1, "the server saw the client leave")
        live["gate"].set()
        _until(lambda: svc.batcher.queued == 0, "the model's thread is idle")
        assert live["calls"] == 2
        r = _open_stream(live["port"], 16, prompt).getresponse()  # and the server goes on
        assert r.status == 200 and r.read().endswith(b"data: [DONE]\n\n")
