"""``aiayn launch`` (issue 70, cases 12 and 13): torchrun's agent in aiayn's hands, so that a job that ends without
success ends in one line of aiayn's, the last on stderr: what stopped it and the exact command that goes on, with
torchrun's own tracebacks and C++ stack traces in a log file that the line names, and an exit status that means
something. Before: a lost node with no replacement waited 600 s and ended in a 35-line RendezvousTimeoutError
traceback; a lost rendezvous host in two 27-frame TCPStore traces; a frozen rank in torchrun's ChildFailedError
block, exit 1. On the loopback: two agents, one process each, gloo, short timeouts set here. Each launcher's
temporary folder is in a $TMPDIR of the test's own (a launcher that a test kills with -9 cannot remove its own), and
what a launcher that ends by itself leaves there is checked."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, loopback_port
from test_distributed import _descendants, _lose_node

from aiayn.errors import ConfigError
from aiayn.launch import Launch, ending, first_clause, parse_launch

RECIPE = ["tiny_reverse", "--no-progress", "--set", "train.device=cpu", "--set", "model.d_model=32", "--set",
          "model.d_ff=64", "--set", "model.n_heads=2", "--set", "train.threads=1", "--set",
          "train.max_updates=100000", "--set", "train.save_every=2", "--set", "train.max_minutes=10"]


def _env(tmp: Path, **more: str) -> dict[str, str]:
    """The environment of a launcher: this checkout's aiayn, and $TMPDIR the folder ``tmp`` (made here)."""
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "TMPDIR": str(tmp), **more}


def _leftovers(tmp: Path) -> list[str]:
    """What a launcher left in its $TMPDIR ``tmp``: its own temporary folders and torchrun's log folders (torch's
    inductor keeps its cache there too, by design)."""
    return sorted(p.name for pattern in ("aiayn-launch-*", "torchelastic_*") for p in tmp.glob(pattern))


def _agent(tmp_path: Path, port: int, host: bool, log: str, *sets: str, restarts: int = 1,
           join: str = ",join_timeout=3") -> subprocess.Popen:
    """One node of the documented elastic setup (docs/distributed.md), started by ``aiayn launch``; its $TMPDIR is
    tmp_path/tmp-LOG."""
    env = _env(tmp_path / f"tmp-{log}", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(tmp_path / log, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "aiayn", "launch", "--nnodes", "2:2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "aiayn-launch",
             "--rdzv-conf", f"is_host={int(host)},keep_alive_interval=1,keep_alive_max_attempt=2{join}",
             "--max-restarts", str(restarts), "train", *RECIPE, "--run-dir", str(tmp_path / "run"),
             *[x for kv in sets for x in ("--set", kv)]],
            stdout=subprocess.DEVNULL, stderr=err, text=True, env=env, cwd=REPO)


def _survivor_line(tmp_path: Path, lost: int, *sets: str, restarts: int = 1, freeze: bool = False,
                   join: str = ",join_timeout=3") -> str:
    """Both nodes started; once update 2's checkpoint is written, node ``lost`` is lost (its agent and everything
    under it killed) or, with ``freeze``, its processes stopped (SIGSTOP; its agent runs on). The other node's
    launcher must end with exit 2; its last line on stderr, torchrun's own output never on it (no traceback, no C++
    frame, no ChildFailedError block); its log moved into the run, nothing left in its $TMPDIR."""
    port = loopback_port()
    agents = [_agent(tmp_path, port, node == 0, f"node{node}.log", *sets, restarts=restarts, join=join)
              for node in (0, 1)]
    survivor = tmp_path / f"node{1 - lost}.log"
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "checkpoints" / "step_000002.json").exists():
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), survivor.read_text()[-3000:]
            time.sleep(0.05)
        if freeze:
            for pid in _descendants(agents[lost].pid)[1:]:  # the worker and its loader worker
                os.kill(pid, signal.SIGSTOP)
        else:
            _lose_node(agents[lost])
        assert agents[1 - lost].wait(120) == 2, survivor.read_text()[-3000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                _lose_node(agent)
    err = survivor.read_text()
    assert "Traceback" not in err and "frame #" not in err and "ChildFailedError" not in err, err[-3000:]
    lines = err.rstrip("\n").splitlines()
    assert lines and lines[-1].startswith("aiayn: error: "), err[-3000:]
    assert not _leftovers(tmp_path / f"tmp-{survivor.name}")
    return lines[-1]


def _check_resume_and_log(line: str, tmp_path: Path, what: str) -> str:
    """The line names the exact resume command and a log holding torchrun's traceback of ``what`` (returned)."""
    assert f"train --resume {tmp_path / 'run'} " in line and "go on from its newest checkpoint (update " in line, line
    log = Path(re.search(r"torchrun's own report: (\S+)$", line).group(1))
    assert log.parent == tmp_path / "run" / "logs" and what in log.read_text(), line
    return log.read_text()


def test_a_lost_node_with_no_replacement_ends_within_setup_timeout_in_one_last_line(tmp_path):
    """Case 12: node 1 lost after update 2's checkpoint, none in its place: node 0's worker stops (a peer lost),
    torchrun restarts it and waits for a second node, no longer than train.setup_timeout_s (15 s here: the launcher
    gives the rendezvous that join_timeout, torch's being 600 s; 15 s, as rank 1 waits as long for rank 0 to prepare
    the data at the start, 2 to 5 s here), with the user's other --rdzv-conf entries; then
    one line, the last, naming the lost node (its host, its launcher's pid, its ranks), the setting and the resume
    command; exit 2."""
    line = _survivor_line(tmp_path, 1, "train.setup_timeout_s=15", join="")
    assert re.match(rf"aiayn: error: the job's other node, {re.escape(os.uname().nodename)} \(launcher pid \d+: "
                    r"rank 1\), was lost and no node took its place within train\.setup_timeout_s \(15 s, which "
                    r"bounds the rendezvous' join_timeout\): the job stopped; ", line), line
    assert " --set train.setup_timeout_s=15 " in line, line  # the resume command keeps it
    log = _check_resume_and_log(line, tmp_path, "RendezvousTimeoutError")
    assert log.startswith("aiayn launch: torchrun's --rdzv-conf 'is_host=1,keep_alive_interval=1,"
                          "keep_alive_max_attempt=2,join_timeout=15': join_timeout=15 s (from train.setup_timeout_s="
                          "15, shorter than torch's default, 600 s)\n"), log[:300]


def test_nodes_that_never_meet_end_within_the_shorter_bound_and_leave_no_empty_folder(tmp_path):
    """One node of two, alone, twice at once: with --rdzv-conf join_timeout=2 (shorter than train.setup_timeout_s)
    its launcher ends after 2 s: the line names that setting and the log it left in its temporary folder (in $TMPDIR,
    nothing else there: no job.json, no torchrun log folder). With train.setup_timeout_s=2 and no join_timeout, and
    its stderr a socket (which the training processes cannot open again, so torchrun's output stays on it): it ends
    after 2 s, says which bound, and leaves no temporary folder at all, its line naming none."""
    import socket

    def node(name: str, conf: str, *sets: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "aiayn", "launch", "--nnodes", "2:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{loopback_port()}", "--rdzv-conf", conf, "train", *RECIPE, "--run-dir",
             str(tmp_path / name), *[x for kv in sets for x in ("--set", kv)]],
            stdout=subprocess.DEVNULL, text=True, env=_env(tmp_path / f"tmp-{name}"), cwd=REPO, **kw)

    ours, theirs = socket.socketpair()
    try:
        given = node("given", "is_host=1,join_timeout=2", "train.setup_timeout_s=30", stderr=subprocess.PIPE)
        setup = node("setup", "is_host=1", "train.setup_timeout_s=2", stderr=theirs.fileno())
        theirs.close()
        err = given.communicate(timeout=240)[1]
        assert given.returncode == 2, err[-3000:]
        ours.settimeout(240)
        said = b"".join(iter(lambda: ours.recv(65536), b"")).decode()
        assert setup.wait(240) == 2, said[-3000:]
    finally:
        ours.close()
        for p in (given, setup):
            if p.poll() is None:
                p.kill()
    line = err.rstrip("\n").splitlines()[-1]
    assert re.match(r"aiayn: error: the job's nodes \(--nnodes 2:2\) did not all come to its rendezvous at "
                    r"127\.0\.0\.1:\d+ within the rendezvous' join_timeout \(2 s; --rdzv-conf join_timeout=S sets "
                    r"it\): the job stopped; nothing was trained: start it again with: aiayn launch ", line), line
    log = Path(re.search(r"torchrun's own report: (\S+)$", line).group(1))
    assert _leftovers(tmp_path / "tmp-given") == [log.parent.name] and \
        [p.name for p in log.parent.iterdir()] == ["torchrun.log"], line
    assert log.read_text().startswith("aiayn launch: torchrun's --rdzv-conf 'is_host=1,join_timeout=2': "
                                      "join_timeout=2 s (from --rdzv-conf)\n") and "RendezvousTimeoutError" in \
        log.read_text()
    line = said.rstrip("\n").splitlines()[-1]
    assert re.match(r"aiayn: error: the job's nodes \(--nnodes 2:2\) did not all come to its rendezvous at "
                    r"127\.0\.0\.1:\d+ within train\.setup_timeout_s \(2 s, which bounds the rendezvous' "
                    r"join_timeout\): the job stopped; .*; torchrun's own report: above, on stderr$", line), line
    assert "RendezvousTimeoutError" in said and not _leftovers(tmp_path / "tmp-setup")


def test_a_lost_rendezvous_host_ends_in_one_last_line_without_tcpstore_traces(tmp_path):
    """Case 13: node 0, which hosts the rendezvous, lost: node 1's agent cannot reach the store (two C++ stack
    traces of TCPStore and a RendezvousConnectionError before); now they are in the log, and the last line says the
    rendezvous is gone and how to go on; exit 2."""
    line = _survivor_line(tmp_path, 0)
    assert line.startswith("aiayn: error: the job's rendezvous at 127.0.0.1:") and " is gone (the node that hosted " \
        "it stopped or was lost" in line and "one of them hosting a new rendezvous" in line, line
    _check_resume_and_log(line, tmp_path, "RendezvousConnectionError")


def test_a_frozen_rank_ends_in_its_own_line_last_with_its_exit_status(tmp_path):
    """Case 13: node 1's processes frozen (SIGSTOP), no restarts: node 0's process says so within
    train.dist_timeout_s, and the launcher's line, last, repeats what happened and says how to go on (torchrun's
    ChildFailedError block, last before, and exit 1); the exit status is that process's own, 2."""
    line = _survivor_line(tmp_path, 1, "train.dist_timeout_s=5", restarts=0, freeze=True)
    assert re.match(r"aiayn: error: the training process of rank 0 \(pid \d+\) ended with exit 2: a collective of "
                    r"this torchrun job waited train\.dist_timeout_s for another process, which did not answer", line)
    assert "; the job stopped; go on" in line and "--max-restarts" not in line.split("; the job stopped")[0], line
    _check_resume_and_log(line, tmp_path, "ChildFailedError")


def _job(tmp_path: Path, *options: str) -> Launch:
    job = parse_launch([*options, "train", "tiny_reverse", "--run-dir", str(tmp_path / "run")])
    job.run_dir, job.resume, job.again = tmp_path / "run", "RESUME", "AGAIN"
    return job


def _ended_by(tmp_path: Path, job: Launch, *ranks: tuple[int, tuple[str, bool] | None]) -> tuple[int, str | None]:
    """:func:`ending` for torchrun's ChildFailedError of processes that ended with (exit code, the line they
    recorded and whether it refuses, or None)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from aiayn.launched import record_error

    failures = {}
    for rank, (code, said) in enumerate(ranks):
        error_file = tmp_path / f"error{rank}.json"
        error_file.unlink(missing_ok=True)
        if said is not None:
            os.environ["TORCHELASTIC_ERROR_FILE"] = str(error_file)
            try:
                record_error(said[0], 2, said[1])
            finally:
                del os.environ["TORCHELASTIC_ERROR_FILE"]
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file=str(error_file))
    return ending(ChildFailedError("aiayn", failures), job, tmp_path / "torchrun.log", [])


def test_each_way_a_job_ends_is_one_line_with_a_status(tmp_path):
    """What the launcher says for each end, without processes: success says nothing; a signal is 128+N; a timed-out
    rendezvous with nobody recorded names the nodes it waited for; torchrun's options are refused in one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    job = _job(tmp_path, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29511")
    log = tmp_path / "torchrun.log"
    assert ending(None, job, log, []) == (0, None)
    code, line = ending(SignalException("x", signal.SIGTERM), job, log, [])
    assert code == 128 + signal.SIGTERM and line.startswith("aiayn: interrupted (SIGTERM): the job stopped; "
                                                            "nothing was trained: start it again with: AGAIN"), line
    code, line = ending(RendezvousTimeoutError(), job, log, [])
    assert code == 2 and line.startswith("aiayn: error: the job's nodes (--nnodes 2) did not all come to its "
                                         "rendezvous at 127.0.0.1:29511 within the rendezvous' join_timeout (600 "
                                         "s"), line
    code, line = _ended_by(tmp_path, job, (-15, ("another process stopped (x); this one stops too. hint", False)),
                           (-15, None))  # rank 0 said its line, then torchrun ended it (SIGTERM) with the others
    assert code == 2 and line.startswith("aiayn: error: the training process of rank 0 (pid 100) ended with exit 2: "
                                         "another process stopped (x); the job stopped; nothing was trained"), line
    code, line = _ended_by(tmp_path, job, (-9, None), (-15, ("3 processes cannot share out 2", True)))
    assert (code, line) == (2, "aiayn: error: 3 processes cannot share out 2"), line  # a refusal, as it is
    code, line = _ended_by(tmp_path, job, (-9, None))
    assert code == 137 and "rank 0 (pid 100) was killed by signal SIGKILL; the job stopped" in line, line
    code, line = ending(ValueError("odd"), job, log, [])
    assert code == 1 and line.startswith("aiayn: internal error (in torchrun's agent or aiayn launch): ValueError")
    assert first_clause("a (b; c); d; e") == "a (b; c)" and first_clause("a") == "a"
    with pytest.raises(ConfigError, match="aiayn launch starts aiayn itself"):
        parse_launch(["--nnodes", "1", "-m", "aiayn", "train", "x"])
    with pytest.raises(ConfigError, match="aiayn launch runs aiayn train under torchrun, not 'evaluate'"):
        parse_launch(["--nnodes", "1", "evaluate", "x"])
    environ = dict(os.environ)
    for options, says in ((["--nnodes", "2:1"], "min_nodes must be > 0 and <= max_nodes"),
                          (["--standalone", "--nproc-per-node", "abc"], "Unsupported nproc_per_node value: abc"),
                          (["--max-restarts", "-1"], "max_restarts must be >= 0"),
                          (["--rdzv-endpoint", "node0:x"], "port number of the rendezvous endpoint")):
        with pytest.raises(ConfigError, match=f"^torchrun's options: .*{says}"):  # before any process starts
            parse_launch([*options, "train", "x"])
    assert dict(os.environ) == environ  # torchrun's check of them (on a copy) sets OMP_NUM_THREADS: undone


def test_the_rendezvous_waits_no_longer_than_train_setup_timeout_s(tmp_path):
    """The join_timeout torchrun is given: the shorter of the user's (--rdzv-conf, else 600 s) and the training
    config's train.setup_timeout_s (read as aiayn train reads it: the recipe and its --set, or a run's own config.yaml
    on --resume RUN; unreadable: left to the training to refuse), the user's other entries kept; torchrun's static
    rendezvous has none; a join_timeout torch would refuse once the nodes meet is refused first."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from aiayn.config.loading import load_config, save_config
    from aiayn.launch import setup_timeout_of

    c10d = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400")
    for options, setup, seconds, conf, bounded in (
            ((*c10d, "--rdzv-conf", "is_host=1,join_timeout=3"), 86400.0, 3, "is_host=1,join_timeout=3", False),
            ((*c10d, "--rdzv-conf", "is_host=1"), 5.0, 5, "is_host=1,join_timeout=5", True),
            ((*c10d, "--rdzv-conf", "join_timeout=900,is_host=0"), 7.5, 7, "join_timeout=7,is_host=0", True),
            ((*c10d,), 0.2, 1, "join_timeout=1", True),
            ((*c10d,), None, 600, "", False),  # the config unread
            (("--standalone",), 5.0, 5, "join_timeout=5", True),
            (("--master-addr", "127.0.0.1", "--master-port", "29511"), 5.0, 600, "", False)):
        job = _job(tmp_path, "--nnodes", "2", *options)
        job.setup_timeout_s = setup
        args = job.torchrun_args(tmp_path / "folder")
        assert (job.join_timeout(), args.rdzv_conf) == ((seconds, bounded), conf), options
        assert args.log_dir == str(tmp_path / "folder" / "torchelastic") and job.args.log_dir is None
        line = ending(RendezvousTimeoutError(), job, None, [])[1]
        assert (f"within train.setup_timeout_s ({seconds} s, which bounds the rendezvous' join_timeout): " if bounded
                else f"within the rendezvous' join_timeout ({seconds} s; --rdzv-conf join_timeout=S sets it): ") in \
            line and line.endswith("; torchrun's own report: above, on stderr"), line
    for options in (("--log-dir", str(tmp_path / "logs")), ("--tee", "3"), ("--redirects", "3")):
        assert _job(tmp_path, *options).torchrun_args(tmp_path).log_dir == (options[1] if "--log-dir" in options
                                                                            else None)  # the user's, or torchrun's
    for bad in ("0", "2.5", "-1", "abc"):
        with pytest.raises(ConfigError, match=f"^torchrun's options: --rdzv-conf join_timeout={bad}: expected a "
                                              "whole number of seconds above 0"):
            parse_launch([*c10d, "--rdzv-conf", f"is_host=1,join_timeout={bad}", "train", "x"])
    assert setup_timeout_of("tiny_reverse", None, ["train.setup_timeout_s=9"]) == 9.0
    assert setup_timeout_of("tiny_reverse", None, []) == 86400.0
    assert setup_timeout_of("no-such-recipe", None, []) is None  # the training says why, as without the launcher
    assert setup_timeout_of("tiny_reverse", None, ["train.no_such_key=1"]) is None
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config("tiny_reverse", ["train.setup_timeout_s=11"]), run / "config.yaml")
    assert setup_timeout_of(None, str(run), []) == 11.0
    assert setup_timeout_of(None, str(run), ["train.setup_timeout_s=4"]) == 4.0
    assert setup_timeout_of(None, str(tmp_path / "nothing"), []) is None


def test_bad_launch_options_are_one_line_and_exit_2_before_any_process(tmp_path):
    env = _env(tmp_path / "tmp")
    for argv, says in ((["--nnodse", "2", "train", "tiny_reverse"], "unrecognized arguments: --nnodse"),
                       (["--nnodes", "2", "train", "tiny_reverse", "--sett", "x=1"], "unrecognized arguments: --sett"),
                       (["--nnodes", "2", "train"], "aiayn train needs a CONFIG"),
                       (["--nproc-per-node", "0", "train", "tiny_reverse"], "--nproc-per-node must be at least 1")):
        r = subprocess.run([sys.executable, "-m", "aiayn", "launch", *argv, "--run-dir", str(tmp_path / "run")],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("aiayn: error: ") and says in lines[0], \
            r.stderr
    assert not (tmp_path / "run").exists() and not _leftovers(tmp_path / "tmp")


def test_a_process_line_is_what_torchruns_report_of_it_says(tmp_path, monkeypatch, capsys):
    """Under torchrun itself too: a process's one line goes into its error file (TORCHELASTIC_ERROR_FILE), which
    torchrun's report of a failed process (ProcessFailure, the ChildFailedError block) shows as its message."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from aiayn.cli import main

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert main(["train", "tiny_reverse", "--run-dir", str(tmp_path / "run"), "--set", "train.warmup=-1"]) == 2
    line = capsys.readouterr().err.strip()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert line.startswith("aiayn: error: ") and failure.message == line.removeprefix("aiayn: error: ")


def test_a_job_that_succeeds_prints_its_training_and_a_refusal_is_said_once(tmp_path):
    """Success: exit 0, the training processes' own lines on stderr (they write to the user's stderr, not the
    launcher's log), torchrun's warnings (OMP_NUM_THREADS, ...) in RUN/logs, and no line of the launcher's. Then the
    run (2 micro-batches an update) resumed by 3 processes: each refuses it; the refusal is said once, as the last
    line, without a resume command (issue 70: once per rank before), exit 2."""
    env = _env(tmp_path / "tmp")
    env.pop("OMP_NUM_THREADS", None)  # torchrun warns that it sets it: a line of its own, into the log
    run = tmp_path / "run"

    def launch(processes: int, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "aiayn", "launch", "--standalone", "--nproc-per-node",
                               str(processes), "train", *command], capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=240)

    r = launch(2, *RECIPE, "--set", "train.max_updates=2", "--run-dir", str(run))
    assert r.returncode == 0 and "INFO aiayn.train: model: Transformer" in r.stderr, r.stderr[-3000:]
    assert "OMP_NUM_THREADS" not in r.stderr and "\naiayn: " not in f"\n{r.stderr}", r.stderr[-3000:]
    logs = list((run / "logs").glob("launch-*.log"))
    assert len(logs) == 1 and "OMP_NUM_THREADS" in logs[0].read_text()
    assert not _leftovers(tmp_path / "tmp")  # its temporary folder and torchrun's log folder: gone
    r = launch(3, "--resume", str(run), "--set", "train.max_updates=4")
    said = [x for x in r.stderr.splitlines() if x.startswith("aiayn: ")]
    assert r.returncode == 2 and len(said) == 1 and r.stderr.rstrip("\n").endswith(said[0]), r.stderr[-3000:]
    assert said[0].startswith("aiayn: error: ") and "3 process" in said[0] and "--resume" not in said[0] and \
        "Traceback" not in r.stderr, said
    assert len(list((run / "logs").glob("launch-*.log"))) == 1  # a refused command leaves nothing on disk
    assert not _leftovers(tmp_path / "tmp")
