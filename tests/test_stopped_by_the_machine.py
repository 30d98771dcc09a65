"""What a signal or the machine causes is never "internal error" (issue 62): a DataLoader worker killed mid-training
is one line naming the worker and the resume command, exit 2, and the run resumes; torch's words for memory, file
descriptors or /dev/shm exhausted, and a lost connection, are one line each; a reader that closes our output
(``| head``) ends the command quietly; an interrupted training says how to resume."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
from tiny_recipe import TINY_RUN_OVERRIDES

from aiayn.cli import main
from aiayn.errors import user_error_message

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny_reverse.yaml")


def train_args(run: Path, *extra: str) -> list[str]:
    sets = [x for o in [*TINY_RUN_OVERRIDES, "data.loader_workers=1", *extra] for x in ("--set", o)]
    return ["train", TINY, "--run-dir", str(run), "--no-progress", *sets]


def test_a_killed_loader_worker_is_one_line_with_the_resume_command_and_the_run_resumes(tmp_path, capsys,
                                                                                        monkeypatch):
    """The worker kills itself (SIGKILL, as the out-of-memory killer would) when asked for its 30th update, after
    the checkpoint of update 20: the training ends with one line naming the worker (killed by SIGKILL, or exited
    unexpectedly: torch says either, by timing) and `aiayn train --resume RUN`, exit 2; the run keeps its
    checkpoints and resumes to the end."""
    import torch.utils.data

    from aiayn.data import loader

    real = loader.UpdateBatches.__getitem__
    seen = []

    def dies_at_30(self, update):
        if torch.utils.data.get_worker_info() is not None:  # in the worker process (forked: it has this patch)
            seen.append(1)
            if len(seen) == 30:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(self, update)

    monkeypatch.setattr(loader.UpdateBatches, "__getitem__", dies_at_30)
    run = tmp_path / "run"
    assert main(train_args(run)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    # torch names the signal when its SIGCHLD handler sees the death first, and says "exited unexpectedly" when
    # the main process finds the worker gone while waiting for a batch: which one comes first is the machine's race
    assert err.startswith("aiayn: error: data loader worker (pid "), err
    assert "killed by signal: Killed" in err or "exited unexpectedly" in err, err
    assert f"resume with aiayn train --resume {run}" in err and "internal error" not in err
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "step_000020.json").is_file()
    monkeypatch.setattr(loader.UpdateBatches, "__getitem__", real)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert (run / "model.safetensors").is_file() and (run / "checkpoints" / "step_000060.json").is_file()


@pytest.mark.parametrize("error, words", [
    (RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. "), ("pid 4242", "--resume")),
    (RuntimeError("DataLoader worker (pid(s) 7, 8) exited unexpectedly"), ("pids 7, 8", "exited unexpectedly")),
    (RuntimeError("DataLoader worker (pid 9) is killed by signal: Bus error. It is possible that dataloader's "
                  "workers are out of shared memory."), ("pid 9", "--shm-size")),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 100000000000000 bytes."), ("out of memory", "data.max_tokens")),
    (RuntimeError("Too many open files. Communication with the workers is no longer possible."), ("ulimit -n",)),
    (RuntimeError("received 0 items of ancdata"), ("too many open files", "ulimit -n")),
    (RuntimeError("unable to write to file </torch_1_2_3>: No space left on device (28)"), ("/dev/shm",)),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), ("connection", "Connection reset")),
    (urllib.error.URLError("timed out"), ("connection", "timed out")),
    (TimeoutError("timed out"), ("timed out",)),
])
def test_what_the_machine_says_is_one_line_not_a_bug(error, words):
    line = user_error_message(error)
    assert line is not None and "\n" not in line and all(w in line for w in words), line


def test_a_plain_runtime_error_is_still_a_bug():
    assert user_error_message(RuntimeError("index 5 is out of bounds")) is None


def test_a_reader_that_closes_the_output_ends_translate_quietly(tiny_run, tmp_path):
    """``aiayn translate ... | head -1``: the rest of the output has no reader; the command stops without a
    traceback or an "internal error" (141: 128 + SIGPIPE, as a shell reports such a writer)."""
    src = tmp_path / "in.txt"
    src.write_text("a b c\n" * 3000, encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "aiayn", "translate", str(tiny_run), "--input", str(src),
                             "--device", "cpu", "--threads", "1", "--beam", "1", "--chunk", "100"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline()  # the first line, then the reader goes away
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "internal error" not in err and "Traceback" not in err, err


def test_an_interrupted_training_says_how_to_resume(tmp_path, capsys, monkeypatch):
    from aiayn.train import trainer

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.Trainer, "train", interrupted)
    run = tmp_path / "run"
    assert main(train_args(run)) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"aiayn: interrupted; {run} has no checkpoint yet: resume with aiayn train --resume {run}", err
