"""Issue 70's smaller findings, each as it was reproduced: a chat message too long is named `messages`, a path with a
trailing slash answers a JSON 404 (not an empty 307), an empty sweep grid is refused, a user's folder named as
data.prepared is not called "an incomplete store", and the int8 width the docs print is the one the code checks."""

from __future__ import annotations

import pytest
from refusals import REPO, TINY, one_line, snapshot  # tests/ is on sys.path under pytest

import aiayn
from aiayn.linear import INT8_MAX_WIDTH

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm_client(lm_run):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from aiayn.serve.app import create_app
    from aiayn.serve.schemas import Limits

    gen = aiayn.load(lm_run, device="cpu")
    with TestClient(create_app(gen, limits=Limits(max_chars=100)), base_url="http://localhost") as c:
        yield c


def test_a_chat_message_too_long_is_named_messages(lm_client):
    r = lm_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 300}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and err["message"].startswith("messages:"), r.json()
    r = lm_client.post("/v1/completions", json={"prompt": "a" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert lm_client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200  # serving


@pytest.mark.parametrize("path", ["/v1/completions/", "/v1/chat/completions/", "/translate/", "/v1/models/"])
def test_a_trailing_slash_is_a_json_404_not_an_empty_redirect(lm_client, path):
    r = lm_client.post(path, json={"prompt": "a"}, follow_redirects=False)
    assert r.status_code in (404, 405) and r.content, (r.status_code, r.content)
    assert "trailing slash" in r.text, r.text


def test_an_empty_sweep_grid_is_refused(tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("variants: {}\n")
    out = tmp_path / "out"
    line = one_line(capsys, ["sweep", TINY, "--variants", str(grid), "--out", str(out)])
    assert "names no variants" in line and not out.exists()


def test_a_users_folder_named_as_data_prepared_is_not_an_incomplete_store(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("my thesis\n")
    before = snapshot(tmp_path)
    line = one_line(capsys, ["train", TINY, "--set", f"data.prepared={mine}", "--run-dir", str(tmp_path / "run")])
    assert "not a prepared corpus" in line and "thesis.txt" in line and "incomplete" not in line
    assert snapshot(tmp_path) == before


def test_the_int8_width_in_the_docs_is_the_one_checked():
    text = " ".join((REPO / "docs" / "usage.md").read_text().split())
    assert f"wider than {INT8_MAX_WIDTH:,} inputs" in text
    assert 127 * 127 * INT8_MAX_WIDTH < 2**31 <= 127 * 127 * (INT8_MAX_WIDTH + 1)



@pytest.mark.parametrize(("local_rank", "said"), [(None, True), ("0", True), ("1", False), ("2", False)])
def test_a_refusal_every_rank_reaches_is_said_once_per_machine(local_rank, said, capsys, monkeypatch):
    from aiayn.errors import CheckpointError

    def refuse(args):
        raise CheckpointError("3 processes cannot share out 2 micro-batches", every_rank=True)

    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr("aiayn.cli.cmd_presets", refuse)
    capsys.readouterr()
    from aiayn.cli import main

    assert main(["presets"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == (["aiayn: error: 3 processes cannot share out 2 micro-batches"] if said else [])
