"""Reliability, round two (issue 32): the 29 cases a hostile but realistic user found, each refused in one line
(exit 2, a 4xx from the server) with the file system checked before and after, or served as it should be.

Data destroyed: an export or import whose output is its own input, a --force over a run in use.
Server: the Host allow-list, JSON-only POSTs, CORS off by default, bodies and values that crashed it, the
attention route's limit, the command line's values. Internal errors: malformed Hugging Face directories, huge or
absurd config values, hostile YAML. Accepted when it should not be: a vocabulary that does not fit the model;
a 0600 weights file in an export.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.files import LOCK

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny_reverse.yaml")


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def one_line(capsys, argv: list[str]) -> str:
    """Run the CLI; assert it refused in one line with exit 2; return that line."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("aiayn: error: "), (code, err)
    return err[0]


@pytest.fixture
def run(tmp_path, tiny_run) -> Path:
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


# --- data destroyed -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["hf", "ctranslate2"])
def test_an_export_into_its_own_run_is_refused_even_with_force(command, run, tmp_path, capsys):
    pytest.importorskip("transformers" if command == "hf" else "ctranslate2")
    before = snapshot(run)
    assert "is the input" in one_line(capsys, ["export", command, str(run), str(run), "--force"])
    assert "is inside the input" in one_line(capsys, ["export", command, str(run), str(run / "out"), "--force"])
    assert "contains the input" in one_line(capsys, ["export", command, str(run), str(tmp_path), "--force"])
    assert snapshot(run) == before


def test_an_import_into_its_own_source_is_refused(run, tmp_path, capsys):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    assert main(["export", "hf", str(run), str(hf)]) == 0
    before = snapshot(hf)
    assert "is the input" in one_line(capsys, ["import", "hf", str(hf), str(hf), "--force"])
    assert snapshot(hf) == before


def test_force_never_replaces_a_run_a_training_holds(run, tmp_path, capsys):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    assert main(["export", "hf", str(run), str(hf)]) == 0
    target = Path(shutil.copytree(run, tmp_path / "busy"))
    with open(target / LOCK, "r+") as f:  # what a live training holds
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write("4242\n")
        f.flush()
        before = snapshot(target)
        line = one_line(capsys, ["import", "hf", str(hf), str(target), "--force"])
        assert "a run in use (pid 4242 holds its lock)" in line
        assert "a run in use" in one_line(capsys, ["export", "hf", str(run), str(target), "--force"])
    assert snapshot(target) == before
    assert main(["import", "hf", str(hf), str(target), "--force"]) == 0  # once nobody holds it


# --- the server -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tiny_run):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    import aiayn
    from aiayn.serve.app import Access, create_app

    tr = aiayn.load(tiny_run, device="cpu")
    app = create_app(tr, max_wait_ms=1.0, access=Access(cors="https://tools.example"))
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


# --- Hugging Face imports: the whole contract, one line ---------------------------------------------------------


@pytest.fixture
def hf_dir(run, tmp_path) -> Path:
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", "hf", str(run), str(out)]) == 0
    return out


def _edit(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("case, message", [
    ("encoder_layers_two", "encoder_layers='two': expected an integer"),
    ("generation_not_json", "generation_config.json: not a readable JSON file"),
    ("num_beams_four", "num_beams='four': expected an integer"),
    ("index_is_a_list", "expected an object with a 'weight_map'"),
    ("raw_pickle", "refused: not a PyTorch zip archive"),
    ("vocab_too_small", "vocab.json names 100 of the model's"),
    ("huge_positions", "must be at most"),
])
def test_imports_check_the_whole_contract(case, message, hf_dir, tmp_path, capsys):
    if case == "encoder_layers_two":
        _edit(hf_dir / "config.json", lambda d: d.update(encoder_layers="two"))
    elif case == "generation_not_json":
        (hf_dir / "generation_config.json").write_text("{ not json")
    elif case == "num_beams_four":
        _edit(hf_dir / "generation_config.json", lambda d: d.update(num_beams="four"))
    elif case == "index_is_a_list":
        (hf_dir / "model.safetensors").unlink()
        (hf_dir / "model.safetensors.index.json").write_text("[]")
    elif case == "raw_pickle":
        import pickle

        (hf_dir / "model.safetensors").unlink()
        (hf_dir / "pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}))
    elif case == "vocab_too_small":
        _edit(hf_dir / "vocab.json", lambda d: [d.pop(k) for k in list(d)[100:]])
    elif case == "huge_positions":
        _edit(hf_dir / "config.json", lambda d: d.update(max_position_embeddings=10**9))
    out = tmp_path / "imported"
    r = subprocess.run([sys.executable, "-m", "aiayn", "import", "hf", str(hf_dir), str(out)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    lines = r.stderr.strip().splitlines()
    # exactly one line: no torch or transformers warning before it
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("aiayn: error:"), r.stderr
    assert message in lines[0] and not out.exists()


def test_an_export_gives_its_weights_the_permissions_of_its_other_files(run, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", "hf", str(run), str(out)]) == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes


# --- configs and the command line: ceilings, integers that fit, hostile YAML ------------------------------------


@pytest.mark.parametrize("override, message", [
    ("train.max_updates=" + "9" * 400, "train.max_updates=999999999999... (400 digits): must be at most"),
    ("train.seed=18446744073709551616", "train.seed=18446744073709551616: must be at most"),
    ("model.max_positions=1000000000", "model.max_positions=1000000000: must be at most 1,048,576"),
    ("data.vocab_size=100000000000", "data.vocab_size=100000000000: must be at most"),
    ("model.d_model=40000", "need about"),
    ("train.max_updates=" + "9" * 5000, "holds an integer too long to be a setting"),
])
def test_absurd_values_are_one_line_at_once(override, message, tmp_path, capsys):
    run = tmp_path / "r"
    line = one_line(capsys, ["train", TINY, "--run-dir", str(run), "--set", override])
    assert message in line and not run.exists()


@pytest.mark.parametrize("text, message", [
    ("model: " + "[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ("model: " + "{a: " * 20_000 + "1" + "}" * 20_000, "nested too deeply"),
    ("train:\n  max_updates: " + "9" * 5000, "integer too long"),
    ("base: [1, 2]\n", "base: expected the name or path"),
    ("base: 5\n", "base: expected the name or path"),
], ids=["50k nested lists", "20k nested mappings", "5000-digit integer", "base list", "base number"])
def test_hostile_yaml_is_one_line(text, message, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert message in one_line(capsys, ["train", str(cfg), "--run-dir", str(tmp_path / "r")])
    assert not (tmp_path / "r").exists()
