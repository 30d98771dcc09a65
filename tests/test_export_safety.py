"""Exports and imports never destroy data: an export or import whose output is its own input, or a run a training
holds, is refused even with --force; a Hugging Face import checks the whole contract in one line; an export's
weights get the permissions of its other files; Argos' sentence model must be ONNX, and an Argos export stages
beside its output and removes what killed exports left. (Issues 32 and 44.)
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from refusals import REPO, one_line, snapshot  # tests/ is on sys.path under pytest

from aiayn.cli import main
from aiayn.files import LOCK

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def run(tmp_path, tiny_run) -> Path:
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


# --- data destroyed ------------------------------------------------------------------------------------------------


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


# --- Hugging Face imports: the whole contract, one line ------------------------------------------------------------


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
