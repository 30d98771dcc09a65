"""Several processes, proven on one: each rank its own dropout, a resume needs no RNG state and refuses another
world size, and the process group's timeout is the config's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import loopback_port  # tests/ is on sys.path under pytest

from aiayn.config import ConfigError, load_config, read_run_config
from aiayn.errors import CheckpointError
from aiayn.train import parallel as parallel_module
from aiayn.train.run import resume_run, train
from aiayn.train.trainer import resume_config
from aiayn.train.update import Update, seed_update, update_seed

REPO = Path(__file__).resolve().parent.parent


def test_every_rank_and_update_draws_its_own_dropout_and_a_repeat_draws_the_same():
    seeds = {(step, rank): update_seed(1, step, rank) for step in (1, 2, 1000) for rank in range(4)}
    assert len(set(seeds.values())) == len(seeds)  # all different
    assert update_seed(1, 2, 1) == seeds[(2, 1)] and update_seed(2, 2, 1) != seeds[(2, 1)]
    masks = {}
    for rank in (0, 1):
        seed_update(1, 7, rank)
        masks[rank] = F.dropout(torch.ones(1000), 0.1, training=True)
    assert not torch.equal(masks[0], masks[1])  # 2 ranks regularize as 2, not as 1
    seed_update(1, 7, 1)
    assert torch.equal(F.dropout(torch.ones(1000), 0.1, training=True), masks[1])  # what a resume draws again


def _tiny(tmp_path, updates: int, *extra: str):
    return load_config("tiny_reverse", ["model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.dropout=0.3",
                                        "data.max_tokens=256", f"train.max_updates={updates}", "train.save_every=3",
                                        "train.eval_every=1000", "train.log_every=1", "train.threads=1", *extra])


def test_resume_with_dropout_equals_the_uninterrupted_run_without_saved_rng(tmp_path):
    """Dropout 0.3: the updates after the resume draw the masks the uninterrupted run drew."""
    from aiayn.weights import read_weights

    train(_tiny(tmp_path, 6), tmp_path / "whole", progress=False)
    train(_tiny(tmp_path, 3), tmp_path / "cut", progress=False)
    resume_run(tmp_path / "cut", ["train.max_updates=6"], progress=False)
    a, b = (read_weights(tmp_path / r / "model.safetensors") for r in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_at_another_world_size_keeps_the_micro_batches_of_an_update_or_is_refused(tmp_path, caplog):
    """A run of 2 processes x 1 step resumes on 1 process with 2 accumulation steps (the same batches, and the
    same dropout slots); 3 processes cannot share out 2 micro-batches: refused with one line, nothing changed."""
    run = tmp_path / "run"
    train(_tiny(tmp_path, 3), run, progress=False)
    state = next((run / "checkpoints").glob("step_*.json"))
    meta = json.loads(state.read_text())
    meta["world_size"] = 2  # as a 2-process torchrun would have written it
    state.write_text(json.dumps(meta))
    cfg = read_run_config(run)
    assert resume_config(cfg, run, 1).train.accum_steps == 2
    assert resume_config(cfg, run, 2) is cfg
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="each update of this run takes 2 micro-batches .*divides 2"):
        resume_config(cfg, run, 3)
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with caplog.at_level("INFO", logger="aiayn.train"):
        resume_run(run, ["train.max_updates=4"], progress=False)
    assert "train.accum_steps=2 keeps the run's 2 micro-batches per update" in caplog.text
    assert read_run_config(run).train.accum_steps == 2  # and its next resume on 1 process keeps it
    meta = json.loads(sorted((run / "checkpoints").glob("step_*.json"))[-1].read_text())
    assert (meta["world_size"], meta["accum_steps"]) == (1, 2)


def test_a_resume_after_the_minutes_are_spent_says_so_before_any_work(tmp_path):
    run = tmp_path / "run"
    train(_tiny(tmp_path, 3, "train.max_minutes=0.0001"), run, progress=False)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"train.max_minutes=0.0001 \(counted from the run's first start\).*"
                                          r"--set train.max_minutes="):
        resume_run(run, ["train.max_updates=6"], progress=False)
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_the_process_group_gets_the_configured_timeout(monkeypatch):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(parallel_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel_module.dist, "init_process_group",
                        lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(parallel_module.dist, "new_group", lambda **kw: seen.update(setup=kw) or "setup group")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setattr(parallel_module.dist, "rendezvous", lambda url, timeout: iter([("store", 0, 2)]))
    monkeypatch.setattr(parallel_module.dist, "PrefixStore", lambda prefix, store: f"{prefix}{store}")
    monkeypatch.setattr(parallel_module.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(parallel_module.dist, "get_world_size", lambda: 2)
    d = parallel_module.init_distributed("cpu", timeout_s=12.5, setup_timeout_s=99.0)
    assert (d.rank, d.world, d.setup_group) == (0, 2, "setup group")
    assert seen == {"backend": "gloo", "timeout": timedelta(seconds=12.5), "rank": 0, "world_size": 2,
                    "store": "aiayn/attempt-3/store",  # a restarted job's keys apart from the dead one's
                    "setup": {"backend": "gloo", "timeout": timedelta(seconds=99.0)}}
    assert load_config("tiny_reverse").train.dist_timeout_s == 1800.0
    assert load_config("tiny_reverse").train.setup_timeout_s == 86400.0
    with pytest.raises(ConfigError, match="dist_timeout_s"):
        load_config("tiny_reverse", ["train.dist_timeout_s=0"])


def _two_agents(tmp_path, run_dirs: tuple[str, str], nproc: int = 1, *extra: str) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes 2 --nproc-per-node nproc`` as two agents on the loopback (two "machines"), each training
    tiny_reverse for 4 updates into its own ``--run-dir``."""
    port = loopback_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "aiayn", "train",
         "tiny_reverse", "--run-dir", run_dirs[node], "--no-progress", *TINY_RUN, "--set", "train.max_updates=4",
         "--set", "train.dist_timeout_s=60", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for node in (0, 1)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


TINY_RUN = ["--set", "train.device=cpu", "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set",
            "model.n_heads=2", "--set", "train.threads=1"]


@pytest.mark.slow
def test_two_machines_of_two_processes_train_as_one_process_with_four_steps_and_need_one_directory(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2 (two agents on the loopback), dropout 0.1:
    - one shared run directory: the same batches and dropout masks as 1 process x 4 accumulation steps, so the same
      weights to float rounding; the processes' agreement check ran at every logged update (log_every 1) and passed;
    - a run directory per machine: every process stops with one line naming the problem, no internal error."""
    from aiayn.weights import read_weights

    shared = str(tmp_path / "shared")
    four = _two_agents(tmp_path, (shared, shared), 2, "--set", "train.log_every=1")
    assert [r.returncode for r in four] == [0, 0], four[0].stderr[-1500:] + four[1].stderr[-1500:]
    assert not list((tmp_path / "shared").glob(".probe-*"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "aiayn", "train", "tiny_reverse", "--run-dir", str(tmp_path / "one"),
                          "--no-progress", *TINY_RUN, "--set", "train.max_updates=4", "--set", "train.accum_steps=4"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    a, b = (read_weights(Path(d) / "model.safetensors") for d in (shared, tmp_path / "one"))
    worst = _largest_difference(a, b)
    print(f"2 nodes x 2 processes against 1 process x 4 steps: largest relative weight difference {worst:.2e}")
    assert worst < 1e-5, worst  # float rounding (about 1e-6 measured)

    apart = _two_agents(tmp_path, (str(tmp_path / "node0"), str(tmp_path / "node1")), 2)
    for r in apart:
        assert r.returncode != 0
        lines = [x for x in r.stderr.splitlines() if "aiayn: error:" in x]
        assert lines and "file system they share" in lines[0], r.stderr[-2000:]
        assert "internal error" not in r.stderr


def _rank_pid(run: Path, rank: int) -> int | None:
    """The pid of the training process of ``rank`` writing ``run`` (Linux /proc): not one of its DataLoader workers,
    forked children with its command line and environment."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if str(run).encode() in cmd and b"aiayn" in cmd and f"LOCAL_RANK={rank}".encode() in env:
            found[int(entry.name)] = parent
    trainers = [pid for pid, parent in found.items() if parent not in found]
    return trainers[0] if len(trainers) == 1 else None


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two runs' weights, relative to each tensor's largest value, leaving out the key
    biases (the middle third of each ``in_proj.bias``): softmax ignores them, so their gradient is zero up to
    rounding, and Adam turns that rounding into steps of +-lr whose sign depends on the order of the sums."""
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        if k.endswith("in_proj.bias"):
            d = x.numel() // 3
            x, y = torch.cat([x[:d], x[2 * d :]]), torch.cat([y[:d], y[2 * d :]])
        worst = max(worst, float((x - y).abs().max() / x.abs().max().clamp_min(1e-6)))
    return worst


def _kill_rank_after(job: subprocess.Popen, run: Path, rank: int, checkpoint: int) -> None:
    """Wait for ``run``'s checkpoint of step ``checkpoint``, then kill -9 the training process of ``rank``."""
    import signal
    import time

    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / f"step_{checkpoint:06d}.json").exists():
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.1)
    pid = _rank_pid(run, rank)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_worker_resumes_by_torchrun_by_hand_or_on_one_process_as_the_uninterrupted_run(tmp_path):
    """Two processes, dropout 0.1, 30 updates; rank 1 killed with -9 after update 10's checkpoint, then:
    - torchrun --max-restarts 1 restarts the job, which resumes by itself: the final weights equal the
      uninterrupted run's bit for bit;
    - without restarts the job fails; `torchrun ... aiayn train --resume RUN` by hand: bit for bit again;
    - the same cut run resumed by one process (2 accumulation steps, refitted by itself): the same batches and
      dropout masks, so the weights equal to float rounding (the two gradients summed in another order)."""
    import shutil

    from aiayn.weights import read_weights

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    here = ["--set", "train.device=cpu", "--set", "train.threads=1"]

    def job(run: Path, restarts: int, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "--max-restarts", str(restarts), "-m", "aiayn", "train", *args, "--run-dir", str(run), "--no-progress",
             *here],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)

    recipe = ["tiny_reverse", "--set", "train.max_updates=30", "--set", "train.save_every=5", "--set",
              "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.n_heads=2"]
    whole = job(tmp_path / "whole", 0, *recipe)
    assert whole.wait(300) == 0, whole.stderr.read()[-2000:]
    final = read_weights(tmp_path / "whole" / "model.safetensors")

    cut = job(tmp_path / "restarted", 1, *recipe)
    _kill_rank_after(cut, tmp_path / "restarted", 1, 10)
    err = cut.communicate(timeout=300)[1]
    assert cut.returncode == 0, err[-3000:]
    assert "torchrun restart 1: resuming" in err and "resumed from step" in err
    assert "internal error" not in err  # the surviving rank's exit names the lost peer, not a bug
    got = read_weights(tmp_path / "restarted" / "model.safetensors")
    assert all(torch.equal(final[k], got[k]) for k in final)

    by_hand = tmp_path / "by_hand"
    cut = job(by_hand, 0, *recipe)
    _kill_rank_after(cut, by_hand, 1, 10)
    err = cut.communicate(timeout=300)[1]
    assert cut.returncode != 0 and "internal error" not in err, err[-3000:]
    shutil.copytree(by_hand, tmp_path / "one_process")
    resumed = job(by_hand, 0, "--resume", str(by_hand))
    err = resumed.communicate(timeout=300)[1]
    assert resumed.returncode == 0 and "resumed from step" in err, err[-3000:]
    got = read_weights(by_hand / "model.safetensors")
    assert all(torch.equal(final[k], got[k]) for k in final)

    one = subprocess.run([sys.executable, "-m", "aiayn", "train", "--resume", str(tmp_path / "one_process"),
                          "--no-progress", *here],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "train.accum_steps=2 keeps the run's 2 micro-batches per update" in one.stderr
    got = read_weights(tmp_path / "one_process" / "model.safetensors")
    worst = _largest_difference(final, got)
    print(f"2 processes x 1 step resumed as 1 x 2: largest relative weight difference {worst:.2e}")
    assert worst < 1e-5, worst  # float rounding (about 1e-6 measured); one other batch or mask moves far more


def test_the_training_loop_reads_the_device_only_at_logged_updates(tmp_path, monkeypatch):
    """No host-device synchronization inside an update, and in the loop only where a line is logged (here every
    4th update): the host can queue update k + 1 while the device runs update k. Counted on the CPU by wrapping
    the tensor methods that read a value back (on a GPU each is a synchronization)."""
    import threading
    import traceback

    calls: list[tuple[int, bool]] = []
    state = {"updates": 0, "inside": False}
    main = threading.main_thread()

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            # Not counted: torch.optim's CPU Adam, which reads its CPU step counter (on a GPU the fused Adam reads
            # nothing back), and the DataLoader's seed for its workers, a CPU tensor drawn once per epoch.
            if threading.current_thread() is main and not any(
                    "torch/optim" in f.filename or "torch/utils/data" in f.filename
                    for f in traceback.extract_stack(limit=4)):
                calls.append((state["updates"], state["inside"]))
            return original(self, *args, **kwargs)
        return read

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    run_update = Update.run

    def counted_update(*args, **kwargs):
        state["inside"] = True
        try:
            return run_update(*args, **kwargs)
        finally:
            state["inside"], state["updates"] = False, state["updates"] + 1

    monkeypatch.setattr(Update, "run", counted_update)
    cfg = _tiny(tmp_path, 12, "train.log_every=4", "train.save_every=1000", "train.clip_norm=1.0",
                "train.max_minutes=60")
    train(cfg, tmp_path / "run", progress=False)
    assert state["updates"] == 12
    assert not [c for c in calls if c[1]]  # none inside an update
    assert {u for u, _ in calls} <= {4, 8, 12}  # in the loop: the logged updates (and the end: eval, save)


def _setup_ranks(rank: int, port: int, sleep_s: float, out: str) -> None:
    """One of two gloo processes: collectives time out after 1 s; rank 0 'prepares data' for ``sleep_s`` before the
    setup barrier, then both pass an ordinary barrier (the group still works)."""
    import time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    d = parallel_module.init_distributed("cpu", timeout_s=1.0, setup_timeout_s=60.0)
    try:
        if d.main:
            time.sleep(sleep_s)
        d.setup_barrier()
        d.barrier()
        Path(out, f"ok{rank}").write_text("ok")
    finally:
        parallel_module.dist.destroy_process_group()


def test_a_data_preparation_longer_than_the_collective_timeout_does_not_kill_the_start(tmp_path):
    """The other processes wait for rank 0's data preparation on the setup group (train.setup_timeout_s), not on
    the training collectives' timeout (train.dist_timeout_s): a 3 s preparation passes a 1 s collective timeout."""
    import torch.multiprocessing as mp

    port = loopback_port()
    mp.spawn(_setup_ranks, args=(port, 3.0, str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def _agreement_ranks(rank: int, port: int, out: str) -> None:
    """One of two gloo processes: the same norms pass, norms 1% apart stop with one line, inf on both passes."""
    from aiayn.errors import DesyncError
    from aiayn.train.parallel import check_agreement

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    d = parallel_module.init_distributed("cpu", timeout_s=30.0, setup_timeout_s=30.0)
    try:
        check_agreement(torch.tensor([2.5, 40.0]), d, 7)
        check_agreement(torch.tensor([float("inf"), 40.0]), d, 8)  # an fp16 overflow on every process
        try:
            check_agreement(torch.tensor([2.5, 40.0 * (1 + 0.01 * rank)]), d, 9)
            message = "no error"
        except DesyncError as e:
            message = str(e)
        Path(out, f"rank{rank}").write_text(message)
    finally:
        parallel_module.dist.destroy_process_group()


def test_processes_whose_norms_differ_stop_with_one_line(tmp_path):
    import torch.multiprocessing as mp

    port = loopback_port()
    mp.spawn(_agreement_ranks, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):  # every process stops, with the same line
        message = (tmp_path / f"rank{rank}").read_text()
        assert message.startswith("update 9: the processes no longer train one model") and "\n" not in message
        assert "process 0: 2.5/40" in message and "process 1: 2.5/40.4" in message


def test_a_resume_inside_a_logging_window_logs_what_the_uninterrupted_run_logs(tmp_path):
    """The window of updates 1-4 is cut by a kill after update 3's checkpoint: the resumed run's line at update 4
    covers updates 1-4 as the uninterrupted run's does (the window's sums and tokens are saved in the checkpoint)."""
    def logged(run):
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return {r["step"]: (r["train_loss"], r["train_nll"], r["tokens_per_update"]) for r in lines
                if "train_loss" in r}

    train(_tiny(tmp_path, 6, "train.log_every=4"), tmp_path / "whole", progress=False)
    train(_tiny(tmp_path, 6, "train.log_every=4"), tmp_path / "cut", progress=False)
    for path in (tmp_path / "cut" / "checkpoints").glob("step_000006.*"):  # as if killed after update 3's save
        path.unlink()
    resume_run(tmp_path / "cut", progress=False)
    whole, cut = logged(tmp_path / "whole"), logged(tmp_path / "cut")
    assert sorted(whole) == [4, 6] and whole[4] == cut[4] and whole[6] == cut[6]


def test_a_resume_of_a_recipe_may_not_change_its_optimizer(tmp_path):
    """`train CONFIG --run-dir RUN --resume --set train.lr_scale=2` is refused as `--resume RUN --set ...` is: one
    line naming the key, nothing changed."""
    run = tmp_path / "run"
    train(_tiny(tmp_path, 3), run, progress=False)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"^train.lr_scale=2.0 but .*config.yaml has 1.0: a resumed run keeps"):
        train(_tiny(tmp_path, 6, "train.lr_scale=2"), run, resume=True, progress=False)
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
