"""Reliability, round three (issue 44): sampling values that crashed, streams that outlived their clients, Table 3
runners that trusted their files, the edges of serve's security, Argos' sentence model and staging, the form of
the command line's errors and the messages that pointed at the wrong thing. Each case is refused in one line
(exit 2, a 4xx in the protocol's shape) with the file system checked before and after, or served as it should be.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import pytest

from aiayn.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny_reverse.yaml")


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def one_line(capsys, argv: list[str]) -> str:
    """Run the CLI; assert it refused in one line with exit 2; return that line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("aiayn: error: "), (code, err)
    return err[0]


# --- the command line's form and --threads ---------------------------------------------------------------------


@pytest.mark.parametrize("argv, word", [
    (["translate", "RUN", "--threads", "abc"], "argument --threads: invalid int value: 'abc'"),
    (["prepare", TINY, "--out", "X", "--workers", "abc"], "argument --workers: invalid int value: 'abc'"),
    (["table3", TINY, "--out", "X", "--seeds", "abc"], "argument --seeds: invalid int value: 'abc'"),
    (["translate"], "the following arguments are required: run"),
])
def test_malformed_arguments_are_one_line(argv, word, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line(capsys, argv)
    assert word in line and f"aiayn {argv[0]} --help" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["translate", "RUN"], ["generate", "RUN"], ["evaluate", "RUN"], ["serve", "RUN"],
    ["prepare", TINY, "--out", "OUT"], ["table3", TINY, "--out", "OUT"], ["train", TINY, "--run-dir", "OUT"],
])
def test_threads_are_bounded_the_same_way_in_every_command(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad in ("10000", "0"):
        assert "--threads " + bad + ": expected 1 to 4,096 CPU threads" in one_line(capsys, [*argv, "--threads", bad])
    assert list(tmp_path.iterdir()) == []  # refused before any work: nothing written


def test_omp_num_threads_is_bounded_and_named(monkeypatch):
    from aiayn.engine import cpu_threads
    from aiayn.errors import ConfigError

    monkeypatch.setenv("OMP_NUM_THREADS", "10000")
    with pytest.raises(ConfigError, match=r"\$OMP_NUM_THREADS 10000: expected 1 to 4,096"):
        cpu_threads()


# --- sampling numbers: one validator, and a top_p below float32's smallest value ----------------------------------


@pytest.mark.parametrize("p", [1e-46, 1e-300, 5e-324])
def test_top_p_below_float32_keeps_the_most_probable_token(p):
    import torch

    from aiayn.search.processing import filter_top_p

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    kept = filter_top_p(logits, p)
    assert (kept.isfinite().sum(dim=-1) == 1).all() and (kept.argmax(-1) == logits.argmax(-1)).all()
    assert torch.multinomial(kept.softmax(-1), 1).squeeze(1).tolist() == logits.argmax(-1).tolist()


def test_translate_samples_with_a_tiny_top_p(tiny_run, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a b c\nhello world\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(tiny_run), "--input", str(src), "--sample", "--top-p", "1e-300", "--seed", "1",
                 "--device", "cpu"]) == 0
    sampled = capsys.readouterr().out
    assert main(["translate", str(tiny_run), "--input", str(src), "--beam", "1", "--device", "cpu"]) == 0
    assert sampled == capsys.readouterr().out  # only the top token is left: greedy search's output


@pytest.fixture(scope="module")
def translator(tiny_run):
    import aiayn

    return aiayn.load(tiny_run, device="cpu")


@pytest.fixture(scope="module")
def client(translator):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from aiayn.serve.app import Access, create_app

    app = create_app(translator, max_wait_ms=1.0, max_queue=2, access=Access(cors="https://tools.example"),
                     api_key="s3cret-key")
    with TestClient(app, base_url="http://localhost") as c:
        yield c


AUTH = {"Authorization": "Bearer s3cret-key"}


def test_every_route_samples_with_a_tiny_top_p(client):
    r = client.post("/v1/translate", json={"text": ["a b c"], "sample": True, "top_p": 1e-300, "seed": 1},
                    headers=AUTH)
    greedy = client.post("/v1/translate", json={"text": ["a b c"], "beam": 1}, headers=AUTH)
    assert r.status_code == 200 and r.json()["translations"][0]["text"] == greedy.json()["translations"][0]["text"]
    r = client.post("/v1/completions", json={"prompt": "a b c", "temperature": 1, "top_p": 1e-300}, headers=AUTH)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value", [("top_p", 0), ("temperature", 1e-300)])
def test_a_refused_sampling_value_is_a_400_before_any_stream(client, stream, field, value):
    body = {"prompt": "a b c", "temperature": 1, field: value, "stream": stream}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "out_of_range" and err["message"].startswith(field), err


@pytest.mark.parametrize("field, value", [("top_p", 0), ("temperature", 1e-300)])
def test_a_chat_stream_checks_its_sampling_values_and_prompt_before_its_200(client, field, value):
    """Chat completions go through the completions' checks: a refused sampling value or a message too long for
    the model is a 4xx in OpenAI's shape, not a data: error event after the 200."""
    body = {"messages": [{"role": "user", "content": "a b c"}], "temperature": 1, field: value, "stream": True}
    r = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["code"] == "out_of_range"
    body = {"messages": [{"role": "user", "content": " ".join(["alpha"] * 301)}], "stream": True}
    r = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 413 and r.headers["content-type"] == "application/json", r.text


def test_a_prompt_too_long_for_the_model_is_refused_before_any_stream(client):
    body = {"prompt": ["a b", " ".join(["alpha"] * 301)], "temperature": 0, "stream": True}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 413 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["message"].startswith("prompt[1]: ")


def test_a_stream_the_queue_cannot_take_is_refused_before_its_200(client):
    from concurrent.futures import ThreadPoolExecutor

    batcher = client.app.state.service.batcher
    with ThreadPoolExecutor(2) as pool:
        with batcher.hold():  # --max-queue 2: two requests wait, the stream would be the third
            waiting = [pool.submit(client.post, "/v1/translate", json={"text": [f"a b {i}"]}, headers=AUTH)
                       for i in range(2)]
            assert batcher.wait_queued(2)
            r = client.post("/v1/completions", json={"prompt": "a b", "temperature": 0, "stream": True},
                            headers=AUTH)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
        assert all(f.result().status_code == 200 for f in waiting)


def test_the_choices_of_one_request_are_one_job(client):
    """--max-queue 2 and a seeded 4-choice completion on an idle server: one job, answered; the same seed
    gives the same choices again (each draw alone, as before)."""
    stats = client.app.state.service.batcher.stats
    jobs = stats.jobs
    body = {"prompt": "a b c", "temperature": 1.0, "n": 4, "seed": 7}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4 and stats.jobs == jobs + 1, r.text
    again = client.post("/v1/completions", json=body, headers=AUTH).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in r.json()["choices"]]


# --- serve's security edges ---------------------------------------------------------------------------------------


def test_a_host_that_only_starts_with_a_loopback_address_is_refused(client):
    for bad in ("[::1].evil.example", "[::1]evil", "[::1]:80.evil.example", "[::1"):
        r = client.get("/health", headers={"Host": bad})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", bad
    for ok in ("[::1]", "[::1]:8000"):
        assert client.get("/health", headers={"Host": ok}).status_code == 200, ok


def test_the_cors_origin_may_send_the_api_key(client):
    pre = client.options("/v1/translate", headers={"Origin": "https://tools.example",
                                                    "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "authorization, content-type"})
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert pre.status_code == 204 and {"authorization", "content-type"} <= allowed
    r = client.post("/v1/translate", json={"text": ["a b"]}, headers={"Origin": "https://tools.example", **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://tools.example"


@pytest.mark.parametrize("api_key, status, word", [
    (12345678, 400, "api_key: expected a string, got int"),
    (["s3cret-key"], 400, "api_key: expected a string, got list"),
    ({"k": 1}, 400, "api_key: expected a string, got dict"),
    ("wrong-key", 403, "Invalid API key"),
])
def test_libretranslate_api_key_of_another_type_is_a_400(client, api_key, status, word):
    q = {"q": "a b", "source": "en", "target": "de"}
    for path, body in (("/translate", q), ("/detect", {"q": "a b"})):  # /languages reads no key (LibreTranslate)
        r = client.post(path, json={**body, "api_key": api_key})
        assert r.status_code == status and word in r.json()["error"], (path, r.text)
    assert client.post("/translate", json={**q, "api_key": "s3cret-key"}).status_code == 200


def test_an_api_key_in_the_url_is_refused_and_never_logged(client):
    import logging

    from aiayn.serve import RedactKeys

    q = {"q": "a b", "source": "en", "target": "de", "api_key": "s3cret-key"}
    r = client.post("/translate?api_key=s3cret-key", json=q)
    assert r.status_code == 400 and "not in the URL" in r.json()["error"]
    r = client.post("/translate?api_key=s3cret-key", data={k: v for k, v in q.items() if k != "api_key"})
    assert r.status_code == 400
    # uvicorn's access line of such a request: the key is hidden
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "POST", "/translate?x=1&API_KEY=s3cret-key&y=2", "1.1", 400), None)
    assert RedactKeys().filter(record) and "s3cret" not in record.getMessage() and "&y=2" in record.getMessage()


def test_a_libretranslate_text_too_long_for_the_model_is_named_q(client):
    r = client.post("/translate", json={"q": ["a b", " ".join(["alpha"] * 301)], "source": "en", "target": "de",
                                        "api_key": "s3cret-key"})
    assert r.status_code == 413 and r.json()["error"].startswith("q[1]: "), r.text


def test_a_weak_key_from_the_environment_is_named(tiny_run, capsys, monkeypatch):
    pytest.importorskip("starlette")
    monkeypatch.setenv("AIAYN_API_KEY", "abc")
    assert "$AIAYN_API_KEY: expected at least 8" in one_line(capsys, ["serve", str(tiny_run)])


# --- a stream whose client leaves stops within one decoding step -------------------------------------------------


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

    from aiayn.serve.app import create_app

    model, real = loaded.run.model, loaded.run.model.decode
    box = {"calls": 0, "gate_at": None, "at_gate": threading.Event(), "gate": threading.Event()}

    def decode(*args, **kwargs):
        box["calls"] += 1
        if box["calls"] == box["gate_at"]:
            box["at_gate"].set()
            box["gate"].wait(60)
        return real(*args, **kwargs)

    model.decode = decode
    app = create_app(loaded, max_wait_ms=0.0)
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


def test_generate_samples_with_a_tiny_top_p(lm_run, capsys):
    capsys.readouterr()
    args = ["generate", str(lm_run), "--prompt", "the", "--max-new-tokens", "8", "--device", "cpu"]
    assert main([*args, "--top-p", "1e-300", "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    assert main([*args, "--temperature", "0"]) == 0
    assert sampled == capsys.readouterr().out  # only the most probable token is left: the greedy text


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


# --- Table 3: one reader for every results file, and one table is one set of settings -----------------------------


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    """A tiny translation recipe on corpus files (nothing here trains: results are written by the test)."""
    for name in ("train.src", "train.tgt", "valid.src", "valid.tgt"):
        (tmp_path / name).write_text("a b c\n", encoding="utf-8")
    path = tmp_path / "base.yaml"
    path.write_text(f"""task: translation
model: {{d_model: 32, n_heads: 2, d_ff: 64, n_encoder_layers: 1, n_decoder_layers: 1, max_positions: 64}}
data: {{train_src: {tmp_path}/train.src, train_tgt: {tmp_path}/train.tgt, valid_src: {tmp_path}/valid.src,
       valid_tgt: {tmp_path}/valid.tgt, tokenizer: bpe, vocab_size: 300, src_lang: en, tgt_lang: en}}
train: {{max_updates: 12, threads: 1}}
decode: {{beam: 2}}
""", encoding="utf-8")
    return path


def _result(recipe: Path, row: str, seed: int = 1, **changes) -> dict:
    """A complete result of ``row`` as the runner writes it, with this recipe's settings."""
    from aiayn.config import load_config
    from aiayn.table3 import BY_NAME, _row_label, base_settings, row_config

    base = load_config(recipe)
    r = BY_NAME[row]
    rec = {"row": row, "group": r.group, "change": r.change, "seed": seed,
           "here": _row_label(r, row_config(recipe, r, seed), base), "updates": 12, "parameters": 50_000,
           "valid_nll": 2.0, "ppl": 7.389, "bleu": 10.0, "chrf": 30.0, "bleu_signature": "nrefs:1|case:mixed",
           "beam": 2, "train_s": 1.0, "eval_s": 1.0, "wall_s": 2.0, "threads": 1,
           "base_settings": base_settings(base)}
    rec.update(changes)
    return rec


def _write(out: Path, name: str, content) -> Path:
    import json

    path = out / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return path


@pytest.mark.parametrize("content, word", [
    (bytes(range(256)) * 4, "not UTF-8 text"),
    (b'{"row": "base", "seed": 1, "ppl"', "not JSON"),
    (b"[1, 2, 3]", "a JSON list, not an object"),
    ({"row": "base", "seed": 1}, "its field 'group' is missing"),
    ("bleu", "its field 'bleu' is not a number"),
    ("row", "holds row 'D3' seed 1, not the row and seed its name says"),
], ids=["random bytes", "partial JSON", "a list", "missing fields", "bleu a string", "another row's file"])
def test_a_broken_result_is_one_line_naming_it_before_any_work(content, word, recipe, tmp_path, capsys):
    out = tmp_path / "table"
    if content == "bleu":
        content = _result(recipe, "base", bleu="high")
    elif content == "row":
        content = _result(recipe, "D3")
    path = _write(out, "base-seed1.json", content)
    before = snapshot(out)
    line = one_line(capsys, ["table3", str(recipe), "--out", str(out), "--rows", "D3"])
    assert f"{path}: " in line and word in line and "delete it" in line
    assert snapshot(out) == before  # nothing trained, prepared or written


def test_a_result_of_other_settings_is_refused_naming_the_setting(recipe, tmp_path, capsys):
    out = tmp_path / "table"
    _write(out, "base-seed1.json", _result(recipe, "base"))
    path = _write(out, "D3-seed1.json", _result(recipe, "D3"))
    # the same settings: both rows are done, the table is written from them without training anything
    from aiayn.table3 import run_table

    table = run_table(recipe, out, rows="D3", seeds=[1], extra=["train.threads=1"])  # threads: not a setting
    assert [r["row"] for r in table["rows"]] == ["base", "D3"] and not (out / "runs").exists()
    # a rerun with another --set: refused at once, naming the file and the setting, nothing written
    before = snapshot(out)
    line = one_line(capsys, ["table3", str(recipe), "--out", str(out), "--rows", "D3", "--set", "train.lr_scale=2"])
    assert "-seed1.json: made with train.lr_scale=1.0, this table has train.lr_scale=2.0" in line
    line = one_line(capsys, ["table3", str(recipe), "--out", str(out), "--rows", "D3", "--set", "decode.beam=5"])
    assert "made with decode.beam=2, this table has decode.beam=5" in line
    assert snapshot(out) == before
    # a runner of other settings on the same --out wrote one (two runners, two --set): the table names it
    other = _result(recipe, "D3")
    other["base_settings"]["model.dropout"] = 0.3
    path.write_text(__import__("json").dumps(other), encoding="utf-8")
    line = one_line(capsys, ["table3", str(recipe), "--out", str(out), "--rows", "D3"])
    assert f"{path}: made with model.dropout=0.3, this table has model.dropout=0.1" in line


# --- Argos export: a real ONNX sentence model, and staging beside the output ---------------------------------------


def test_a_sentence_model_that_is_not_onnx_is_refused(tiny_run, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    from aiayn.interop.sentence_splitter import onnx_problem, sentence_splitter_onnx

    real = sentence_splitter_onnx("en")
    assert onnx_problem(real) is None
    fake = tmp_path / "inputs" / "fake.onnx"
    fake.parent.mkdir()
    for content in (b"not onnx\n", real[: len(real) // 2], b"PK\x03\x04" + bytes(64), b"\x08\x07"):
        fake.write_bytes(content)
        before = snapshot(tmp_path)
        line = one_line(capsys, ["export", "argos", str(tiny_run), str(tmp_path / "out" / "x.argosmodel"),
                                 "--sentence-model", str(fake)])
        assert f"--sentence-model {fake}: not an ONNX model" in line, content
        assert snapshot(tmp_path) == before  # nothing written, no folder made


def test_argos_stages_beside_the_output_and_removes_what_killed_exports_left(tiny_run, tmp_path, monkeypatch):
    pytest.importorskip("ctranslate2")
    import tempfile

    from aiayn.files import RunLock
    from aiayn.interop.argos import export_argos

    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    out = tmp_path / "new" / "folder" / "en_de.argosmodel"
    assert export_argos(tiny_run, out) == out
    assert sorted(p.name for p in out.parent.iterdir()) == ["en_de.argosmodel"] and list(tmpdir.iterdir()) == []
    # what kill -9 left: a staging directory (its lock file, nobody holding it), a loose zip of an earlier
    # version, and an earlier version's .aiayn-argos-* directory of this package; one staging directory is held
    # by a live export (here: this process) and stays
    dead = out.parent / ".en_de.argosmodel.k1ll3d.tmp"
    (dead / "translate-en_de-1_0").mkdir(parents=True)
    (dead / ".aiayn-run.lock").write_text("99999999\n")
    (out.parent / ".en_de.argosmodel.zip123.tmp").write_bytes(b"PK half a zip")
    (out.parent / ".aiayn-argos-x9y8" / "translate-en_de-1_0" / "model").mkdir(parents=True)
    live = out.parent / ".en_de.argosmodel.l1v3.tmp"
    live.mkdir()
    lock = RunLock(live)
    lock.acquire()
    try:
        assert export_argos(tiny_run, out, force=True) == out
    finally:
        lock.release()
    assert sorted(p.name for p in out.parent.iterdir()) == [".en_de.argosmodel.l1v3.tmp", "en_de.argosmodel"]


# --- messages that pointed at the wrong thing ----------------------------------------------------------------------


def test_a_full_disk_while_preparing_names_the_stores_file(tmp_path, capsys):
    import errno

    import numpy as np

    from aiayn.data.store import _Writer
    from aiayn.errors import user_error_message

    class Full:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")  # what write() raises: no file name

        def close(self):
            pass

    writer = _Writer(tmp_path, "train", np.dtype(np.uint16))
    for f in writer.files.values():
        f.close()
    writer.files = {"src": Full(), "tgt": Full()}
    encoded = {"src": np.zeros(3, np.int64), "tgt": np.zeros(3, np.int64), "src_lens": np.array([3]),
               "tgt_lens": np.array([3]), "empty": 0, "too_long": 0, "kept": 1}
    with pytest.raises(OSError) as e:
        writer.add(encoded)
    assert user_error_message(e.value) == f"{tmp_path / 'train.src.bin'}: No space left on device"
    # no file at all: the line says where the user can act
    line = user_error_message(OSError(errno.ENOSPC, "No space left on device"))
    assert line.startswith("No space left on device (free space, or write elsewhere") and "--run-dir" in line


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


@pytest.mark.parametrize("argv", [["prepare", TINY, "--out", "OUT"], ["train", TINY, "--run-dir", "OUT"]])
def test_files_beside_a_named_dataset_are_refused_not_ignored(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("a b c\n")
    line = one_line(capsys, [*argv, "--set", "data.train_src=mine.txt"])
    assert "data.dataset=reverse and data.train_src are both set" in line and "data.dataset=null" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]  # refused before any work
