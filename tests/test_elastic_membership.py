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
from aiayn.run.ownership import same_torchrun_job
from aiayn.run.weights import list_checkpoints
from aiayn.train.run import train

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


# torchrun's launcher, run once the file named by its first argument exists (imported before the wait).
WAIT_THEN_RUN = ("import os, runpy, sys, time\n"
                 "import torch.distributed.run  # noqa: F401 - the imports paid before the wait\n"
                 "gate = sys.argv.pop(1)\n"
                 "while not os.path.exists(gate):\n"
                 "    time.sleep(0.02)\n"
                 "sys.argv[0] = 'torch.distributed.run'\n"
                 "runpy.run_module('torch.distributed.run', run_name='__main__')\n")
JOIN_RECIPE = ["tiny_reverse", "--no-progress", "--set", "train.device=cpu", "--set", "model.d_model=32", "--set",
               "model.d_ff=64", "--set", "model.n_heads=2", "--set", "train.threads=1", "--set", "train.max_updates=60",
               "--set", "train.save_every=5", "--set", "train.accum_steps=2", "--set", "train.dist_timeout_s=60"]


@pytest.mark.slow
def test_a_node_that_joins_a_1_to_2_job_is_a_resume_not_a_refusal(tmp_path):
    """Case 11 on the loopback: node 0 trains alone under --nnodes 1:2 --max-restarts 0 (2 micro-batches an update);
    node 1 joins after update 10's checkpoint; node 0's agent starts its worker again for the new round (no restart
    counted). It went on ("already holds a training run: pass --resume" killed the job before); both nodes end
    with exit 0, the run resumed by two processes."""
    import os
    import subprocess
    import sys

    from conftest import REPO, loopback_port

    run, port = tmp_path / "run", loopback_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    gate = run / "checkpoints" / "step_000010.json"

    def agent(host: bool, log: str) -> subprocess.Popen:
        # node 1's agent is started at once but waits for update 10's checkpoint with torch already imported, so that
        # it joins within milliseconds of it: started only then, on a busy machine its imports took longer than node
        # 0's remaining updates, and it found the job over.
        launch = ["-c", WAIT_THEN_RUN, str(gate)] if not host else ["-m", "torch.distributed.run"]
        with open(tmp_path / log, "w") as err:
            return subprocess.Popen(
                [sys.executable, *launch, "--nnodes", "1:2", "--nproc-per-node", "1", "--monitor-interval", "0.1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "aiayn-join",
                 "--rdzv-conf", f"is_host={int(host)},last_call_timeout=1", "--max-restarts", "0",
                 "-m", "aiayn", "train", *JOIN_RECIPE, "--run-dir", str(run)],
                stdout=subprocess.DEVNULL, stderr=err, text=True, env=env, cwd=REPO)

    import time

    agents = [agent(True, "node0.log"), agent(False, "node1.log")]
    try:
        deadline = time.monotonic() + 300
        while not gate.exists():
            alive = agents[0].poll() is None
            assert time.monotonic() < deadline and alive, (tmp_path / "node0.log").read_text()[-3000:]
            time.sleep(0.05)
        assert agents[0].wait(300) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        assert agents[1].wait(120) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    logs = (tmp_path / "node0.log").read_text() + (tmp_path / "node1.log").read_text()
    assert "a new rendezvous round" in logs and "already holds" not in logs and "internal error" not in logs
    meta = json.loads(sorted((run / "checkpoints").glob("step_*.json"))[-1].read_text())
    assert meta["world_size"] == 2 and list_checkpoints(run)[-1] == 60
