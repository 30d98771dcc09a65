"""Weights holding NaN (a training that diverged) are refused in one line by every command that loads them (issue
62): they translated to an empty line with exit status 0 before."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from aiayn.cli import main
from aiayn.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def nan_run(tiny_run, tmp_path):
    run = shutil.copytree(tiny_run, tmp_path / "run")
    tensors = load_file(str(run / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(run / "model.safetensors"), {"source": "diverged"})
    return run


@pytest.mark.parametrize("argv", [["translate", "{run}", "--device", "cpu"], ["serve", "{run}", "--port", "0"],
                                  ["evaluate", "{run}", "--split", "test", "--device", "cpu"]])
def test_nan_weights_are_one_line_and_exit_2(nan_run, argv, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a b c\n")))
    before = sorted(p.name for p in nan_run.rglob("*"))
    assert main([a.format(run=nan_run) for a in argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aiayn: error: ") and "NaN or infinite values" in err[0], err
    assert "model.safetensors" in err[0] and captured.out == ""
    assert sorted(p.name for p in nan_run.rglob("*")) == before  # nothing written


def test_an_infinity_is_refused_too_and_a_sound_run_loads(tiny_run, nan_run):
    import aiayn

    tensors = load_file(str(nan_run / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = torch.nan_to_num(tensors[name], nan=float("inf"))
    save_file(tensors, str(nan_run / "model.safetensors"))
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        aiayn.load(nan_run, device="cpu")
    assert aiayn.load(tiny_run, device="cpu").translate(["a b"])  # the check passes sound weights


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("replace", [False, True])
def test_average_of_a_checkpoint_holding_nan_writes_nothing(tiny_run, tmp_path, capsys, value, replace):
    """Issue 70: `aiayn average` wrote NaN weights, and with --replace put them over a sound model.safetensors."""
    from refusals import snapshot

    from aiayn.run.weights import checkpoint_paths, list_checkpoints

    run = shutil.copytree(tiny_run, tmp_path / "run")
    ckpt = checkpoint_paths(run, list_checkpoints(run)[-2])[0]
    tensors = load_file(str(ckpt))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[-1] = value
    save_file(tensors, str(ckpt))
    before = snapshot(run)
    capsys.readouterr()
    assert main(["average", str(run), "--last", "3", *(["--replace"] if replace else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NaN or infinite values" in err[0] and ckpt.name in err[0], err
    assert snapshot(run) == before  # no average.safetensors, model.safetensors as it was
    assert main(["average", str(run), "--last", "1", *(["--replace"] if replace else [])]) == 0  # the sound one


def test_replace_never_puts_another_models_average_over_the_weights(tiny_run, tmp_path, capsys):
    from refusals import snapshot

    run = shutil.copytree(tiny_run, tmp_path / "run")
    tensors = load_file(str(run / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(run / "model.safetensors"))
    before = snapshot(run)
    capsys.readouterr()
    assert main(["average", str(run), "--last", "2", "--replace"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replace never writes them over it" in err[0], err
    assert snapshot(run) == before


def test_average_of_checkpoints_holding_another_kind_of_values_writes_nothing(tiny_run, tmp_path, capsys):
    """A tensor stored as integers in one checkpoint and floats in the others has no mean (it was averaged into
    weights of garbage, exit 0); float32 with bfloat16 still has one."""
    from refusals import snapshot

    from aiayn.run.weights import average_weights, checkpoint_paths, list_checkpoints

    run = shutil.copytree(tiny_run, tmp_path / "run")
    ckpt = checkpoint_paths(run, list_checkpoints(run)[-1])[0]
    tensors = load_file(str(ckpt))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int64)
    save_file(tensors, str(ckpt))
    before = snapshot(run)
    capsys.readouterr()
    assert main(["average", str(run), "--last", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch.int64" in err[0] and "cannot be averaged" in err[0], err
    assert snapshot(run) == before
    half = load_file(str(checkpoint_paths(run, list_checkpoints(run)[-2])[0]))
    save_file({k: v.to(torch.bfloat16) for k, v in half.items()}, str(tmp_path / "bf16.safetensors"))
    mean = average_weights([checkpoint_paths(run, list_checkpoints(run)[-3])[0], tmp_path / "bf16.safetensors"])
    assert mean[name].dtype == torch.float32
