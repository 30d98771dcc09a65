"""Training's files on disk: every bad input and every broken disk state of training, run directories, checkpoints
and configs is one line on stderr and exit 2 with no file changed (md5 of every file before and after), and no run
is ever clobbered: run directories are owned (a marker, a lock), a failed start leaves nothing behind, files keep
the umask's permissions, the next save removes what a kill left, and a full disk names the file it could not write
(a checkpoint, a prepared store's). The commands run in-process (``aiayn.cli.main``) with the output captured; only
the lock between two trainings runs real processes. Read-only places are real (chmod) for a normal user and
simulated (the writes raise EROFS) for root, whom permissions do not stop. (Issues 26 and 44.)
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import TINY_RUN_OVERRIDES  # tests/ is on sys.path under pytest
from refusals import REPO, TINY, run_cli, snapshot
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from aiayn import build_model, model_config
from aiayn.config import load_config
from aiayn.files import LOCK, MARKER, atomic_write_bytes, default_file_mode
from aiayn.run.weights import checkpoint_paths, list_checkpoints
from aiayn.train.checkpoint import load_checkpoint, save_checkpoint
from aiayn.train.schedule import build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def train_args(run: Path, *extra: str, resume: bool = False, overrides: list[str] = TINY_RUN_OVERRIDES) -> list[str]:
    """``aiayn train`` of the tiny_run recipe into ``run`` (``extra``: more --set overrides)."""
    return ["train", TINY, "--run-dir", str(run), "--no-progress", *(["--resume"] if resume else []),
            *sets(list(overrides) + list(extra))]


@contextlib.contextmanager
def read_only(directory: Path):
    """``directory`` (existing) cannot be written into: chmod 0555 for a normal user; for root, whom
    permissions do not stop, creating a file or directory in it raises EROFS (as on a read-only mount)."""
    if not IS_ROOT:
        mode = directory.stat().st_mode
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(mode)
        return
    real_mkstemp, real_mkdir = tempfile.mkstemp, pathlib.Path.mkdir

    def inside(p) -> bool:
        return Path(os.path.abspath(p)).parent == directory or Path(os.path.abspath(p)) == directory

    def mkstemp(*args, **kwargs):
        where = kwargs.get("dir")
        if where is not None and Path(os.path.abspath(where)) == directory:
            raise OSError(errno.EROFS, "Read-only file system", os.path.join(where, "tmp"))
        return real_mkstemp(*args, **kwargs)

    def mkdir(self, *args, **kwargs):
        if inside(self) and not self.exists():
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    with mock.patch("tempfile.mkstemp", mkstemp), mock.patch.object(pathlib.Path, "mkdir", mkdir):
        yield


@pytest.fixture
def run(tmp_path, tiny_run) -> Path:
    """A copy of the tiny trained run (checkpoints 20, 40, 60; marker; lock file) to damage."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


def _ckpt(run: Path, step: int = 60) -> tuple[Path, Path, Path]:
    return checkpoint_paths(run, step)


def _edit_json(path: Path, edit) -> None:
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _extra_optimizer_tensor(run: Path) -> None:
    _, opath, _ = _ckpt(run)
    tensors = load_file(str(opath))
    tensors["extra"] = torch.zeros(3)
    save_file(tensors, str(opath))


def _wrong_optimizer_shape(run: Path) -> None:
    _, opath, _ = _ckpt(run)
    tensors = load_file(str(opath))
    tensors["0.exp_avg"] = torch.zeros(3)
    save_file(tensors, str(opath))


def _user_folder(tmp_path: Path) -> Path:
    u = tmp_path / "mine"
    u.mkdir()
    (u / "config.yaml").write_text("# my own notes\nmodel: {d_model: 64}\n")
    return u


def _killed_before_first_checkpoint(run: Path) -> Path:
    shutil.rmtree(run / "checkpoints")
    (run / "model.safetensors").unlink()
    return run


def _weights_without_checkpoints(run: Path) -> Path:
    shutil.rmtree(run / "checkpoints")
    return run


def _bad_corpus_config(tmp_path: Path) -> Path:
    a = tmp_path / "a.txt"
    a.write_text("one\ntwo\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  train_src: {a}\n  train_tgt: {tmp_path / 'missing.de'}\n  valid_src: {a}\n"
                   f"  valid_tgt: {a}\n")
    return cfg


RESUMED = ("train.max_updates=80",)


CASES = {
    # --- the newest checkpoint is damaged: --resume refuses before any work, naming the file --------
    "ckpt_random_bytes": lambda t, r: (
        _ckpt(r)[2].write_bytes(bytes(range(255, -1, -1))),
        train_args(r, *RESUMED, resume=True), "step_000060.json: not a valid checkpoint state (not JSON"),
    "ckpt_json_list": lambda t, r: (
        _ckpt(r)[2].write_text("[]"), train_args(r, *RESUMED, resume=True), "expected a JSON object, got list"),
    "ckpt_json_empty_object": lambda t, r: (
        _ckpt(r)[2].write_text("{}"), train_args(r, *RESUMED, resume=True), "no 'step' key"),
    "ckpt_rng_wrong_size": lambda t, r: (
        _edit_json(_ckpt(r)[2], lambda m: m["rng"].update(torch=base64.b64encode(b"short").decode())),
        train_args(r, *RESUMED, resume=True), "rng.torch has 5 bytes"),
    "ckpt_rng_not_base64": lambda t, r: (
        _edit_json(_ckpt(r)[2], lambda m: m["rng"].update(torch="not base64 !")),
        train_args(r, *RESUMED, resume=True), "rng.torch is not valid base64"),
    "ckpt_train_state_key_missing": lambda t, r: (
        _edit_json(_ckpt(r)[2], lambda m: m["train_state"].pop("position")),
        train_args(r, *RESUMED, resume=True),
        "step_000060.json: not a valid checkpoint state (train_state: no key 'position')"),
    "ckpt_train_state_negative": lambda t, r: (
        _edit_json(_ckpt(r)[2], lambda m: m["train_state"].update(epoch=-1)),
        train_args(r, *RESUMED, resume=True), "train_state.epoch is -1"),
    "ckpt_extra_optimizer_tensor": lambda t, r: (
        _extra_optimizer_tensor(r), train_args(r, *RESUMED, resume=True),
        "step_000060.optim.safetensors: unexpected optimizer tensor 'extra'"),
    "ckpt_optimizer_tensor_wrong_shape": lambda t, r: (
        _wrong_optimizer_shape(r), train_args(r, *RESUMED, resume=True), "0.exp_avg has shape (3,)"),
    "ckpt_weights_truncated": lambda t, r: (
        _ckpt(r)[0].write_bytes(_ckpt(r)[0].read_bytes()[:100]), train_args(r, *RESUMED, resume=True),
        "step_000060.safetensors: not a readable safetensors file"),
    # --- configs: each numeric key has its range, checked before a directory exists ------------------
    "binary_config": lambda t, r: (
        (t / "bin.yaml").write_bytes(bytes(range(256))), ["train", str(t / "bin.yaml"), "--run-dir", str(t / "new")],
        "bin.yaml: not a YAML file"),
    "config_is_a_directory": lambda t, r: (
        None, ["train", str(t), "--run-dir", str(t / "new")], "is a directory, expected a YAML file"),
    "warmup_0": lambda t, r: (None, train_args(t / "new", "train.warmup=0"), "train.warmup=0: must be >= 1"),
    "save_every_0": lambda t, r: (None, train_args(t / "new", "train.save_every=0"), "train.save_every=0"),
    "log_every_0": lambda t, r: (None, train_args(t / "new", "train.log_every=0"), "train.log_every=0"),
    "eval_every_0": lambda t, r: (None, train_args(t / "new", "train.eval_every=0"), "train.eval_every=0"),
    "max_updates_negative": lambda t, r: (None, train_args(t / "new", "train.max_updates=-5"),
                                          "train.max_updates=-5: must be >= 1"),
    "keep_last_negative": lambda t, r: (None, train_args(t / "new", "train.keep_last=-1"), "train.keep_last=-1"),
    "lr_nan": lambda t, r: (None, train_args(t / "new", "train.lr=.nan"), "train.lr=nan: expected a finite number"),
    "lr_scale_negative": lambda t, r: (None, train_args(t / "new", "train.lr_scale=-1"), "train.lr_scale=-1.0"),
    "dropout_inf": lambda t, r: (None, train_args(t / "new", "model.dropout=.inf"), "model.dropout=inf"),
    "batch_tokens_0": lambda t, r: (None, train_args(t / "new", "data.max_tokens=0"), "data.max_tokens=0"),
    "device_bogus": lambda t, r: (None, train_args(t / "new", "train.device=bogus"), "device 'bogus': unknown"),
    "precision_fp16_on_cpu": lambda t, r: (None, train_args(t / "new", "train.device=cpu", "train.precision=fp16"),
                                           "precision fp16 needs a CUDA device"),
    # --- run directories: owned, never clobbered ---------------------------------------------------------
    "user_folder_with_config_yaml": lambda t, r: (
        _user_folder(t), train_args(t / "mine"), "not empty and not a run directory of aiayn"),
    "user_folder_resume": lambda t, r: (
        _user_folder(t), train_args(t / "mine", resume=True), "nothing to resume"),
    "run_dir_is_a_file": lambda t, r: (
        (t / "f").write_text("x"), train_args(t / "f"), "not a directory"),
    "finished_run_without_resume": lambda t, r: (None, train_args(r), "already holds a training run"),
    "killed_before_first_checkpoint": lambda t, r: (
        _killed_before_first_checkpoint(r), train_args(r), "already holds a training run"),
    "killed_before_first_checkpoint_vocab_changed": lambda t, r: (
        _killed_before_first_checkpoint(r), train_args(r, "data.vocab_size=400", resume=True),
        "data.vocab_size: 300 -> 400); its tokenizer was made for the old values"),
    "weights_without_checkpoints_resume": lambda t, r: (
        _weights_without_checkpoints(r), train_args(r, resume=True),
        "holds model.safetensors but no checkpoints/: nothing to resume from"),
    "resume_with_another_vocabulary": lambda t, r: (
        None, train_args(r, "data.vocab_size=400", *RESUMED, resume=True),
        "the run's tokenizer was made with data.vocab_size=300 but the config says data.vocab_size=400"),
    "resume_with_another_model_shape": lambda t, r: (
        None, train_args(r, "model.d_model=48", *RESUMED, resume=True), "model.d_model=48 but "),
    "damaged_marker": lambda t, r: (
        (r / MARKER).write_text("{"), train_args(r, resume=True), ".aiayn-run.json: not a readable run marker"),
    # --- a failed start leaves no directory (new) and no file (existing empty directory) behind -------------
    "bad_corpus_new_dir": lambda t, r: (
        _bad_corpus_config(t), ["train", str(t / "c.yaml"), "--run-dir", str(t / "new" / "deeper")],
        "missing.de: no such file"),
    "bad_corpus_empty_dir": lambda t, r: (
        (_bad_corpus_config(t), (t / "empty").mkdir()), ["train", str(t / "c.yaml"), "--run-dir", str(t / "empty")],
        "missing.de: no such file"),
    # --- aiayn average ------------------------------------------------------------------------------------
    "average_last_0": lambda t, r: (None, ["average", str(r), "--last", "0"], "--last must be at least 1"),
    "average_no_checkpoints": lambda t, r: (
        _weights_without_checkpoints(r), ["average", str(r)], "no checkpoints to average"),
    # --- loading a run: its config.yaml -------------------------------------------------------------------
    "run_config_not_utf8": lambda t, r: (
        (r / "config.yaml").write_bytes(b"task: translation\nmodel: {d_model: \xff}\n"),
        ["translate", str(r), "--input", str(r / "config.yaml"), "--device", "cpu"],
        "config.yaml: not a YAML file (line 2: byte 0xff is not valid UTF-8)"),
    "run_config_unknown_key": lambda t, r: (
        (r / "config.yaml").write_text("model: {d_modle: 3}\n"), ["translate", str(r), "--device", "cpu"],
        "config.yaml: unknown config key model.d_modle"),
    "run_config_not_yaml": lambda t, r: (
        (r / "config.yaml").write_text("model: [1\n"), ["translate", str(r), "--device", "cpu"],
        "config.yaml: not valid YAML"),
    "translate_device_bogus": lambda t, r: (None, ["translate", str(r), "--device", "bogus"], "device 'bogus'"),
}


if not torch.cuda.is_available():
    CASES["train_device_cuda_without_cuda"] = lambda t, r: (
        None, train_args(t / "new", "train.device=cuda"), "device 'cuda'")
    CASES["translate_device_cuda_without_cuda"] = lambda t, r: (
        None, ["translate", str(r), "--device", "cuda"], "device 'cuda'")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_exit_2_and_changes_no_file(case, tmp_path, run, capsys):
    _, argv, expect = CASES[case](tmp_path, run)
    before = snapshot(tmp_path)
    code, err = run_cli(capsys, argv)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("aiayn: error: "), err
    assert expect in err[0], err[0]
    assert snapshot(tmp_path) == before


def test_a_damaged_newest_checkpoint_says_how_to_resume_from_the_one_before(run, capsys):
    _ckpt(run)[2].write_text("[]")
    code, err = run_cli(capsys, train_args(run, *RESUMED, resume=True))
    assert code == 2 and len(err) == 1
    assert f"delete {run / 'checkpoints' / 'step_000060'}.* to resume from step 40" in err[0]


@pytest.mark.parametrize("case", ["resume", "average", "new_run_under_read_only_parent"])
def test_read_only_places_are_refused_before_any_work(case, tmp_path, run, capsys):
    if case == "new_run_under_read_only_parent":
        parent = tmp_path / "ro"
        parent.mkdir()
        argv, where = train_args(parent / "new"), parent / "new"
    else:
        parent = run
        argv = train_args(run, *RESUMED, resume=True) if case == "resume" else ["average", str(run), "--last", "2"]
        where = run
    before = snapshot(tmp_path)
    with read_only(parent):
        code, err = run_cli(capsys, argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("aiayn: error: "), err
    assert str(where) in err[0] and ("Read-only file system" in err[0] or "Permission denied" in err[0]), err[0]
    assert snapshot(tmp_path) == before


def test_a_run_in_use_is_refused(run, capsys):
    """While a process holds RUN's lock, neither a training nor an average may write into RUN."""
    with open(run / LOCK, "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(run)
        for argv in (train_args(run, *RESUMED, resume=True), train_args(run), ["average", str(run)]):
            code, err = run_cli(capsys, argv)
            assert code == 2 and len(err) == 1 and "in use by another aiayn process" in err[0], err
        assert snapshot(run) == before


def _processes_of(run: Path) -> list[int]:
    """The pids of the live processes whose command line names ``run`` (Linux /proc; zombies left out)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if str(run).encode() in (entry / "cmdline").read_bytes() and " Z " not in (entry / "stat").read_text():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_two_trainings_into_one_directory_the_second_is_refused_and_a_kill_frees_it(tmp_path, capsys):
    """Two real processes: the first holds the lock while it trains; the second gets one line and exit 2;
    once the first is killed (-9) the lock is free again."""
    d = tmp_path / "d"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    long = ["train.max_updates=100000", "train.save_every=100000", "train.eval_every=100000"]
    cmd = [sys.executable, "-m", "aiayn", *train_args(d, *long)]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 600  # a hang guard, generous for a busy machine
        while not ((d / LOCK).exists() and (d / LOCK).read_text().strip() == str(first.pid)):
            assert first.poll() is None and time.monotonic() < deadline, "the first training did not start"
            time.sleep(0.1)
        second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert lines == [f"aiayn: error: {d}: in use by another aiayn process (pid {first.pid}); wait for it to "
                         "end or choose another --run-dir"], second.stderr
    finally:
        first.kill()
        first.wait()
    # Its DataLoader workers die with it (they would hold its stderr, sockets and locks): polled, not timed.
    left = _processes_of(d)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _processes_of(d)
    assert left == [], left
    # Killed before its first checkpoint: the lock is free, and a restart needs the same recipe.
    code, err = run_cli(capsys, train_args(d, "train.max_updates=5", resume=True))
    assert code == 2 and len(err) == 1 and "stopped before its first checkpoint with another config" in err[0], err
    assert "train.max_updates: 100000 -> 5" in err[0]


def test_a_run_stopped_before_its_first_checkpoint_restarts_only_with_resume(tmp_path, capsys):
    """A run interrupted before its first checkpoint (marker, config, tokenizer, no checkpoint): refused without
    --resume, restarted from scratch with it (same recipe). Under umask 022 every file of the finished run,
    weights and checkpoints included, is rw-r--r-- (a run can be shared)."""
    run = tmp_path / "p"
    recipe = TINY_RUN_OVERRIDES + ["train.max_updates=2", "train.save_every=2", "train.eval_every=2"]
    old = os.umask(0o022)
    try:
        with mock.patch("aiayn.train.run.Trainer.train", side_effect=KeyboardInterrupt):
            code, err = run_cli(capsys, train_args(run, overrides=recipe))
        assert code == 130 and (run / MARKER).exists() and not list_checkpoints(run)
        code, err = run_cli(capsys, train_args(run, overrides=recipe))
        assert code == 2 and len(err) == 1 and "already holds a training run" in err[0], err
        code, err = run_cli(capsys, train_args(run, overrides=recipe, resume=True))
        assert code == 0, err
    finally:
        os.umask(old)
    assert list_checkpoints(run) == [2] and (run / "model.safetensors").exists()
    files = [p for p in run.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "config.yaml", "metrics.jsonl", MARKER, LOCK,
                                       "step_000002.safetensors", "step_000002.optim.safetensors", "step_000002.json"}
    assert {p.relative_to(run).as_posix(): oct(p.stat().st_mode & 0o777) for p in files} == \
        {p.relative_to(run).as_posix(): "0o644" for p in files}
    assert all(p.stat().st_mode & 0o777 == 0o755 for p in run.rglob("*") if p.is_dir())


def test_no_space_left_during_training_is_one_line_and_keeps_the_last_checkpoint(run, capsys):
    """safetensors reports a full disk as SafetensorError("... (os error 28) ..."): one line naming the file,
    exit 2; the checkpoint before it is intact and loads; no temporary file is left. (The run resumed here was
    killed while appending to metrics.jsonl: the torn line is dropped, not a crash.)"""
    real_save = save_file
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 61, "train_lo')
    kept = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in _ckpt(run, 60)}

    def full_disk(tensors, path, metadata=None):
        if "step_000062" in os.path.basename(path):
            raise SafetensorError(f'Error while serializing: I/O error: No space left on device (os error 28) at '
                                  f'path "{os.path.dirname(path)}/.tmpAb12Cd"')
        return real_save(tensors, path, metadata=metadata)

    with mock.patch("aiayn.run.weights.save_file", full_disk):
        code, err = run_cli(capsys, train_args(run, "train.max_updates=62", "train.save_every=2", resume=True))
    assert code == 2, err
    assert err == [f"aiayn: error: {run / 'checkpoints' / 'step_000062.safetensors'}: No space left on device"]
    assert list_checkpoints(run) == [20, 40, 60]
    assert kept == {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in _ckpt(run, 60)}
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 61 not in steps and steps[-1] == 62
    model = build_model(load_config(run / "config.yaml").model)
    load_checkpoint(run, 60, model, build_optimizer(model, load_config(run / "config.yaml").train))
    with open(run / LOCK) as f:  # the lock was released: a new owner can take it
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_next_save_removes_what_an_interrupted_save_left(tmp_path):
    """A kill during a save leaves temporaries (ours: .NAME.*.tmp; safetensors': .tmpXXXXXX) and weight or
    optimizer files without their JSON; the next save removes those of older steps, and nothing else."""
    torch.manual_seed(0)
    model = build_model(model_config("tiny", vocab_size=30))
    opt = build_optimizer(model, load_config(TINY).train)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {"train_state": {}})
    ck = tmp_path / "checkpoints"
    leftovers = [ck / "step_000003.safetensors", ck / "step_000003.optim.safetensors",
                 ck / ".step_000003.json.x1y2.tmp", ck / ".tmpQw3rTy", tmp_path / ".model.safetensors.abc.tmp"]
    for p in leftovers:
        p.write_bytes(b"partial")
    future = ck / "step_000009.safetensors"  # newer than the next save: not provably stale, kept
    future.write_bytes(b"partial")
    keep = {p.name: p.read_bytes() for p in ck.iterdir() if p.name.startswith(("step_000001", "step_000002"))}
    save_checkpoint(tmp_path, 4, model, opt, {"train_state": {}})
    assert not [p for p in leftovers if p.exists()]
    assert future.exists() and list_checkpoints(tmp_path) == [1, 2, 4]
    assert keep == {p.name: p.read_bytes() for p in ck.iterdir() if p.name.startswith(("step_000001", "step_000002"))}


def test_an_atomic_write_that_fails_names_the_target_and_leaves_it_as_it_was(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")

    def no_space(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")  # what write() raises: no file name

    from aiayn.files import atomic_write

    with pytest.raises(OSError) as e:
        atomic_write(target, no_space)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    atomic_write_bytes(target, b"new")
    assert target.stat().st_mode & 0o777 == default_file_mode()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes and /dev: POSIX")
def test_a_device_or_a_pipe_is_written_into_never_renamed_over(tmp_path, capsys):
    """``aiayn viz model RUN --out /dev/full`` (as root) renamed its temporary over /dev/full: the device became a
    PNG file, and "wrote /dev/full" was the answer; ``average --out`` a device did the same through safetensors'
    own rename, and ``export --force`` into a device deleted it. A device, a named pipe, or any name under /dev or
    /proc is now written into as it is (never into a directory); a full device is one line naming it."""
    import stat
    import threading

    from safetensors.torch import load as safetensors_load

    from aiayn.errors import ConfigError
    from aiayn.files import atomic_write_safetensors, atomic_write_text, check_output_dir, written_in_place

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    atomic_write_text(fifo, "through the pipe\n")
    reader.join(timeout=60)
    assert got == [b"through the pipe\n"] and stat.S_ISFIFO(fifo.stat().st_mode)  # still a pipe
    # safetensors renames its own temporary over the name it is given: a pipe gets the bytes, not a rename
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    atomic_write_safetensors(fifo, {"w": torch.ones(3)})
    reader.join(timeout=60)
    assert torch.equal(safetensors_load(got[1])["w"], torch.ones(3)) and stat.S_ISFIFO(fifo.stat().st_mode)
    with pytest.raises(ConfigError, match="a device or a pipe, not a directory"):  # --force never deletes it
        check_output_dir(fifo, [], force=True)
    assert written_in_place("/dev/null") and written_in_place("/dev/stdout") and written_in_place(fifo)
    assert not written_in_place(tmp_path) and not written_in_place(tmp_path / "new.txt")
    assert not written_in_place("/dev/shm/aiayn-no-such-file")  # a regular file in /dev/shm: atomic as anywhere
    (tmp_path / "out-link").symlink_to("/proc/self/fd/1")  # what /dev/stdout is
    assert written_in_place(tmp_path / "out-link")
    (tmp_path / "plain.txt").write_text("x")
    assert not written_in_place(tmp_path / "plain.txt")
    if os.path.exists("/dev/full"):  # Linux: every write fails with ENOSPC (reached only if the pipe held above)
        assert run_cli(capsys, ["viz", "positional", "--out", "/dev/full"]) == (
            2, ["aiayn: error: /dev/full: No space left on device"])
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_torchrun_ranks_all_stop_when_rank_0_refuses_the_run_directory(run):
    """Only rank 0 checks and locks RUN; it tells the other ranks, so a refusal ends every rank at once
    (no rank waits forever at a barrier) and RUN is untouched."""
    before = snapshot(run)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # A rank waiting forever at a barrier would hit the timeout (an error, not a pass).
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "aiayn", *train_args(run)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode != 0
    # Rank 0 says why; rank 1 (unless torchrun stops it first) says it follows rank 0. Neither is a bug.
    refusals = [ln for ln in r.stderr.splitlines() if ln.startswith("aiayn: error:")]
    assert any("already holds a training run" in ln for ln in refusals), r.stderr[-3000:]
    assert all("already holds" in ln or "rank 0 refused the run directory" in ln for ln in refusals), refusals
    assert "aiayn: internal error" not in r.stderr
    assert re.search(r"exitcode\s*:\s*2\b", r.stderr), r.stderr[-3000:]
    assert snapshot(run) == before


# --- a prepared store's files --------------------------------------------------------------------------------------


def test_a_full_disk_while_preparing_names_the_stores_file(tmp_path, capsys):
    import errno

    import numpy as np

    from aiayn.data.store import IdWriter
    from aiayn.errors import user_error_message

    class Full:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")  # what write() raises: no file name

        def close(self):
            pass

    writer = IdWriter(tmp_path / "train.src.bin", np.dtype(np.uint16), tmp_path / "train.src.idx")
    writer.file.close()
    writer.file = Full()
    with pytest.raises(OSError) as e:
        writer.add(np.zeros(3, np.int64), np.array([3]))
    assert user_error_message(e.value) == f"{tmp_path / 'train.src.bin'}: No space left on device"
    # no file at all: the line says where the user can act
    line = user_error_message(OSError(errno.ENOSPC, "No space left on device"))
    assert line.startswith("No space left on device (free space, or write elsewhere") and "--run-dir" in line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="Linux's /dev/full: every write fails with ENOSPC")
@pytest.mark.parametrize("kind", ["pairs", "stream"])
def test_a_full_disk_names_the_id_file_of_either_kind_of_store_and_leaves_nothing(tmp_path, capsys, monkeypatch, kind):
    """Both kinds write their id files through one writer (aiayn.data.store.IdWriter): a full disk is one line naming
    the file for a language model's stream too (a bare "No space left on device" before), and the failed prepare
    leaves no directory behind."""
    from aiayn.data import store

    opened = store.IdWriter.__init__

    def onto_a_full_disk(self, *args):
        opened(self, *args)
        self.file.close()
        self.file = open("/dev/full", "wb")  # noqa: SIM115 (closed by the writer)

    monkeypatch.setattr(store.IdWriter, "__init__", onto_a_full_disk)
    out = tmp_path / "store"
    if kind == "pairs":
        argv = ["prepare", TINY, "--set", "data.vocab_size=300", "--out", str(out)]
    else:
        text = tmp_path / "corpus.txt"
        text.write_text("".join(f"line {i} of a small play\n" for i in range(3000)))
        argv = ["prepare", "lm_tinyshakespeare_char_quick", "--set", "data.dataset=null", "--set",
                f"data.train_src={text}", "--out", str(out)]
    code, err = run_cli(capsys, argv)
    err = [ln for ln in err if ln.startswith("aiayn:") or "Traceback" in ln]
    name = "train.src.bin" if kind == "pairs" else "train.bin"
    assert code == 2 and len(err) == 1, (code, err)
    assert re.fullmatch(rf"aiayn: error: {re.escape(str(out))}/\.build\.\w+\.tmp/{re.escape(name)}: No space left on "
                        "device", err[0]), err
    assert not out.exists()
