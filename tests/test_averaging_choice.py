"""Averaging that never makes a cut run worse on what the user measures (issue 62): the averaging guard chooses on
validation BLEU (NLL breaks a tie), ``aiayn evaluate RUN --weights last|average|best|step N|FILE`` scores any
weights of a run without touching it, and ``aiayn average`` writes beside model.safetensors unless ``--replace``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.config import DecodeOptions
from aiayn.run.inference_weights import describe_choice, prefer_average, search_words
from aiayn.run.weights import average_weights, checkpoint_paths, read_weights, save_weights

pytestmark = pytest.mark.usefixtures("one_thread")
SOURCES = ["a b c", "d c b a", "b b a", "c a", "a a b c d"]


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def run(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run (checkpoints 20, 40, 60; model.safetensors its last weights) and a small test set."""
    copy = shutil.copytree(tiny_run, tmp_path / "run")
    (tmp_path / "src.txt").write_text("".join(s + "\n" for s in SOURCES), encoding="utf-8")
    (tmp_path / "ref.txt").write_text("".join(" ".join(reversed(s.split())) + "\n" for s in SOURCES),
                                      encoding="utf-8")
    return copy


def evaluate(run: Path, capsys, *extra: str) -> dict:
    src, ref = run.parent / "src.txt", run.parent / "ref.txt"
    assert main(["evaluate", str(run), "--src", str(src), "--ref", str(ref), "--beam", "1", "--device", "cpu",
                 *extra]) == 0
    path = capsys.readouterr().out.strip().splitlines()[-1].split()[1]
    return json.loads(Path(path).read_text(encoding="utf-8"))


def test_the_guard_chooses_on_bleu_where_nll_would_choose_otherwise():
    """The quick start's case: the average of [300, 400, 446] had the worse validation NLL (3.1545 against 3.0979)
    and the better BLEU (21.63 against 20.77 on test): BLEU decides; NLL decides a BLEU tie, and other tasks."""
    avg, last = {"valid_bleu": 21.63, "valid_nll": 3.1545}, {"valid_bleu": 20.77, "valid_nll": 3.0979}
    assert prefer_average(avg, last) and not prefer_average(last, avg)
    assert not prefer_average({**avg, "valid_bleu": 20.775}, last)  # a tie within 0.01: the lower NLL wins
    assert prefer_average({"valid_nll": 3.0}, {"valid_nll": 3.1})  # a language model: NLL
    said = describe_choice(avg, last, 446, search_words(DecodeOptions(beam=4, alpha=0.6)))
    assert "BLEU (the recipe's beam 4, gnmt alpha 0.6) 21.63 against 20.77 for the last step 446" in said
    assert "NLL 3.1545" in said and "greedy" in search_words(DecodeOptions(beam=1))


def test_evaluate_scores_other_weights_without_touching_the_run(run, capsys):
    """--weights last / average / best / step N / FILE: each scores those weights (equal to a run whose
    model.safetensors holds them), in a record of its own; model.safetensors and the run's record stay as they
    were (a hash of every file before and after)."""
    own = evaluate(run, capsys)
    before = snapshot(run)
    scored = {w: evaluate(run, capsys, "--weights", *w.split()) for w in ("last", "average", "best", "step 20")}
    after = snapshot(run)
    new = {k for k in after if k not in before}
    assert {k: v for k, v in after.items() if k in before} == before  # nothing the run had is changed
    assert new == {f"eval/src.{label}.{ext}" for label in ("last", "average", "best", "step_20") for ext in
                   ("json", "hyp")}
    assert scored["average"]["run"]["weights"] == "the average of steps [20, 40, 60]"
    assert scored["step 20"]["run"]["weights"] == "the checkpoint of step 20"
    assert own["name"] == "src" and own["run"]["weights"] == "model.safetensors"
    # the same scores as a run whose model.safetensors holds those weights
    avg = average_weights([checkpoint_paths(run, s)[0] for s in (20, 40, 60)])
    save_weights(avg, run / "model.safetensors")
    assert evaluate(run, capsys, "--name", "as_model")["scores"] == scored["average"]["scores"]
    save_weights(read_weights(checkpoint_paths(run, 20)[0]), run.parent / "twenty.safetensors")
    by_file = evaluate(run, capsys, "--weights", str(run.parent / "twenty.safetensors"))
    assert by_file["name"] == "src.twenty" and by_file["scores"] == scored["step 20"]["scores"]


@pytest.mark.parametrize("argv, words", [
    (["--weights", "step", "30"], "no checkpoint of step 30"),
    (["--weights", "step"], "expected step N"),
    (["--weights", "newest"], "expected one of model, last, best, average"),
])
def test_evaluate_refuses_weights_the_run_does_not_have(run, capsys, argv, words):
    before = snapshot(run)
    src, ref = run.parent / "src.txt", run.parent / "ref.txt"
    assert main(["evaluate", str(run), "--src", str(src), "--ref", str(ref), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert snapshot(run) == before


def test_average_writes_beside_model_safetensors_unless_asked_to_replace_it(run, tmp_path, capsys):
    model = (run / "model.safetensors").read_bytes()
    want = average_weights([checkpoint_paths(run, s)[0] for s in (40, 60)])
    assert main(["average", str(run), "--last", "2"]) == 0
    assert (run / "model.safetensors").read_bytes() == model
    got = read_weights(run / "average.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert main(["average", str(run), "--last", "2", "--out", str(tmp_path / "avg.safetensors")]) == 0
    assert (tmp_path / "avg.safetensors").is_file() and (run / "model.safetensors").read_bytes() == model
    capsys.readouterr()
    for argv, words in ((["--out", str(run / "model.safetensors")], "--replace writes them"),
                        (["--out", str(tmp_path / "x.safetensors"), "--replace"], "give one"),
                        (["--out", str(run / "checkpoints" / "x.safetensors")], "is inside the input")):
        before = snapshot(run)
        assert main(["average", str(run), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
        assert snapshot(run) == before
    assert main(["average", str(run), "--last", "2", "--replace"]) == 0
    replaced = read_weights(run / "model.safetensors")
    assert all(torch.equal(replaced[k], want[k]) for k in want)
