"""A node joining or leaving a ``--nnodes MIN:MAX`` torchrun job (issue 70, case 11): torchrun's agent starts its
workers again for a new rendezvous round without counting a restart (TORCHELASTIC_RESTART_COUNT unchanged), and
rank 0 refused its own run directory ("already holds a training run: pass --resume"). The run's marker now records
the job's rendezvous id and agent; a start by the same agent goes on from the newest checkpoint, a new torchrun
command (another agent) is refused as before. In one process: the agent is this process's parent."""

from __future__ import annotations

import json
import logging

import pytest

from aiayn.config import load_config
from aiayn.errors import CheckpointError
from aiayn.files import MARKER
from aiayn.train.ownership import same_torchrun_job
from aiayn.train.run import train
from aiayn.weights import list_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(updates: int):
    return load_config("tiny_reverse", ["model.d_model=32", "model.d_ff=64", "model.n_heads=2",
                                        "data.max_tokens=256", f"train.max_updates={updates}", "train.save_every=2",
                                        "train.eval_every=1000", "train.log_every=1", "train.threads=1"])


def test_a_new_rendezvous_round_of_the_same_job_resumes_and_another_job_is_refused(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    train(_tiny(2), run, progress=False)
    marker = json.loads((run / MARKER).read_text())
    assert marker["torchrun"]["run_id"] == "job1" and same_torchrun_job(run)
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        train(_tiny(4), run, progress=False)  # the agent's workers again, the restart count still 0
    assert "a new rendezvous round" in caplog.text and list_checkpoints(run)[-1] == 4
    monkeypatch.setattr("os.getppid", lambda: 1)  # another torchrun command: another agent
    assert not same_torchrun_job(run)
    with pytest.raises(CheckpointError, match="already holds a training run"):
        train(_tiny(6), run, progress=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job2")
    monkeypatch.undo()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no torchrun at all
    assert not same_torchrun_job(run)
    with pytest.raises(CheckpointError, match="already holds a training run"):
        train(_tiny(6), run, progress=False)
