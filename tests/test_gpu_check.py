"""``python -m benchmarks.gpu_check`` runs on a CPU (``--smoke``), so the check a GPU session depends on never rots:
every item runs through the code it runs on a GPU, passes, and reports; a call cut short keeps what it measured;
``--continue`` runs only what is missing; ``--report`` rewrites the section from the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check


def _run(tmp_path, *args: str) -> dict:
    return gpu_check.main(["--device", "cpu", "--smoke", "--work", str(tmp_path / "work"),
                           "--json", str(tmp_path / "check.json"), "--md", str(tmp_path / "B.md"), *args])


@pytest.mark.slow
def test_smoke_runs_every_item_and_each_passes(tmp_path):
    # every item must pass, however busy the machine: the overall budget (480 s by default, the GPU session's) is
    # not what this test checks (test_an_item_past_its_time_... does); each item keeps its own time limit
    result = _run(tmp_path, "--budget-s", "5400")
    items = result["items"]
    assert list(items) == list(gpu_check.SMOKE_ITEMS)
    has_multi30k = (os.environ.get("AIAYN_DATA_DIR") or "") and os.path.isdir(
        os.path.join(os.environ["AIAYN_DATA_DIR"], "multi30k"))
    for name, r in items.items():
        if name in ("multi30k", "translate", "serve") and not has_multi30k:
            assert r["status"] in ("not run", "fail")  # they need Multi30k (the check says so)
            continue
        assert r["status"] == "pass", (name, r.get("error"), r.get("log_tail"))
    train = items["train_fp32"]
    assert train["tokens_per_s"] > 0 and train["timed_updates"] == 2 and train["updates"] == 3
    run = items["torchrun"]  # killed after its first checkpoint, resumed from it, finished
    assert run["processes"] == 2 and run["resumed_from"] == run["checkpoints_before_kill"][-1] < run["last_update"]
    if has_multi30k:
        assert items["multi30k"]["bleu_gap"] <= 0.05
        assert items["translate"]["cpu_fp32"]["sentences_per_s"] > 0
        assert items["serve"]["identical_to_translate"] == items["serve"]["sentences"]
    text = (tmp_path / "B.md").read_text(encoding="utf-8")
    assert "<!-- BEGIN gpu_check -->" in text
    for name in items:
        assert f"| {name} | {items[name]['status']} |" in text
    assert json.loads((tmp_path / "check.json").read_text())["items"].keys() == items.keys()


def test_continue_runs_only_what_is_missing_and_report_rewrites_the_section(tmp_path):
    first = _run(tmp_path, "--items", "env")
    assert first["items"]["env"]["status"] == "pass"
    second = _run(tmp_path, "--continue", "--items", "env", "cuda_tests")
    assert second["items"]["env"] == first["items"]["env"]  # kept as it was, not run again
    assert second["items"]["cuda_tests"]["status"] == "pass"  # on a CPU: every CUDA test skips cleanly
    assert second["items"]["cuda_tests"]["passed"] == 0 and second["items"]["cuda_tests"]["skipped"] > 0
    (tmp_path / "B.md").write_text("# Benchmarks\n", encoding="utf-8")
    gpu_check.main(["--report", "--json", str(tmp_path / "check.json"), "--md", str(tmp_path / "B.md")])
    text = (tmp_path / "B.md").read_text(encoding="utf-8")
    assert "| env | pass |" in text and "| cuda_tests | pass |" in text


def test_an_item_past_its_time_fails_and_the_budget_leaves_the_rest_not_run(tmp_path):
    timed_out = gpu_check.run_item("cuda_tests", tmp_path, "cpu", True, limit=0.5)
    assert timed_out["status"] == "fail" and timed_out["error"].startswith("timed out after")
    result = _run(tmp_path, "--items", "env", "train_fp32", "--budget-s", "1")
    assert {r["status"] for r in result["items"].values()} == {"not run"}
    assert "| train_fp32 | not run |" in (tmp_path / "B.md").read_text(encoding="utf-8")


def test_the_cpu_suite_sees_no_gpu():
    """conftest hides CUDA from every run that does not select the cuda marker, so that `make test` on a GPU
    machine decodes on the CPU as on CI (and the processes tests start inherit it)."""
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert not torch.cuda.is_available()
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "0"


def test_pytest_items_name_each_failure_with_and_without_xdist(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_ok():\n    pass\n\n\ndef test_bad():\n    assert 1 == 2\n")
    for extra in ([], ["-n", "2"]):
        res = gpu_check._pytest([str(tmp_path / "test_two.py"), *extra], tmp_path / "log.txt")
        assert (res["passed"], res["failed"], res["status"]) == (1, 1, "fail"), res
        assert [t.rsplit("::", 1)[1] for t in res["failed_tests"]] == ["test_bad"], res


def test_the_isa_item_runs_make_test_isa_s_list():
    assert gpu_check.isa_tests()[0] == "tests/test_translate.py" and "tests/test_hf_interop.py" in gpu_check.isa_tests()


_LAUNCHER_TAIL = """Traceback (most recent call last):
  File "torch/distributed/run.py", line 1028, in main
    run(args)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
aiayn FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 9290)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 9289)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_torchrun_job_is_named_by_its_workers_error_not_the_launchers_traceback():
    """A torchrun job's log ends with the launcher's traceback, which names no cause (CI once reported only that);
    the item's error quotes the workers' own lines and the root cause's rank and exit code (torch 2.13's format)."""
    user = ("aiayn: error: train.label_smoothing=7.0: expected a number in [0, 1)\n" * 2
            + "W1127 api.py:1028] Sending process 9290 closing signal SIGTERM\n"
            + _LAUNCHER_TAIL.format(rank=0, code=2))
    assert gpu_check.job_error(user) == ("aiayn: error: train.label_smoothing=7.0: expected a number in [0, 1); "
                                         "torchrun: rank 0 exited with status 2")
    crash = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 1, in <module>\n"
             "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:4242\n"
             + _LAUNCHER_TAIL.format(rank=1, code=1))
    assert gpu_check.job_error(crash) == ("RuntimeError: Connection closed by peer [127.0.0.1]:4242; "
                                          "torchrun: rank 1 exited with status 1")
    assert gpu_check.job_error(_LAUNCHER_TAIL.format(rank=1, code=-9)) == "torchrun: rank 1 exited with signal 9"
    assert gpu_check.job_error("") == "the log names no cause"


def test_a_cpu_run_never_writes_over_the_gpus_results(tmp_path, capsys):
    """Issue 62: ``--device cpu`` without ``--smoke`` ran the GPU's sizes, timed out and rewrote BENCHMARKS.md's
    measured H200 table. It is refused in one line; a smoke run's results default to its --work directory."""
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--device", "cpu", "--work", str(tmp_path / "work")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "add --smoke" in err[-1], err
    assert not (tmp_path / "work").exists()
    args = gpu_check.parse_args(["--device", "cpu", "--smoke", "--work", str(tmp_path / "w")])
    assert args.json == str(tmp_path / "w" / "gpu_check.json") and args.md == str(tmp_path / "w" / "BENCHMARKS.md")
    gpu = gpu_check.parse_args([])
    assert gpu.md == str(gpu_check.REPO / "BENCHMARKS.md")  # a GPU run still reports where the repository keeps it



def test_the_flops_of_a_training_past_its_first_epoch_count_the_next_epochs_batches():
    # the H200 run of 2026-12-04: levers_match's 200 updates ran into epoch 1 of a 158-batch corpus, and the
    # FLOPs were looked up in epoch 0's plan alone (IndexError)
    from benchmarks.gpu_training import trained_plan

    class Data:
        def epoch_plan(self, epoch: int) -> list[tuple[int, int]]:
            return [(epoch, i) for i in range(3)]

    assert trained_plan(Data(), 0) == []
    assert trained_plan(Data(), 3) == [(0, 0), (0, 1), (0, 2)]
    assert trained_plan(Data(), 7)[:9] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
