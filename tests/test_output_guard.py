"""No output ever lands on the user's own files (issue 70): every path a command writes goes through one output
guard (aiayn.files.guard_output / guard_output_dir), which refuses in one line, exit 2, before any work, a
destination that is one of the command's inputs (through a symlink or a hard link too), a file of a run directory
or a token store the command does not create, or an existing file whose content is not of the kind it writes.

The output arguments are read from the CLI parser itself (``add_output`` tags them); each gets at least four bad
destinations, and every byte under the test's directory must be as it was after each refusal.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from refusals import REPO, one_line, snapshot  # tests/ is on sys.path under pytest

from aiayn.cli import build_parser, main
from aiayn.files import PNG_SIGNATURE, STORE_MARKER

pytestmark = pytest.mark.usefixtures("one_thread")

# The names an argument that writes would have: each must be tagged as an output (so none escapes this test).
OUTPUT_DESTS = {"out", "output", "out_dir", "run_dir", "work", "name"}


def output_arguments() -> list[tuple[str, str, str]]:
    """(command, flag, kind) of every argument the parser tags as an output (``add_output``)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command, p in sub.choices.items():
        for action in p._actions:
            kind = getattr(action, "output_kind", None)
            flag = action.option_strings[0] if action.option_strings else action.dest
            if kind is not None:
                found.append((command, flag, kind))
            elif action.dest in OUTPUT_DESTS:
                raise AssertionError(f"aiayn {command} {flag}: looks like an output but is not tagged (add_output)")
    return found


@dataclass
class World:
    """A run, a token store and the user's own files, all under one directory whose bytes are compared."""

    root: Path
    run: Path
    store: Path
    src: Path
    ref: Path
    recipe: Path
    notes: Path  # the user's text
    png: Path  # the user's picture
    hf: Path  # a Hugging Face export of the run (import's input)

    def text_named(self, name: str) -> Path:
        """The user's text file under a name that says something else (``x.safetensors``, ``t.png``)."""
        p = self.root / "user" / name
        p.write_text("my notes, not weights\n")
        return p

    def link(self, name: str, to: Path) -> Path:
        p = self.root / "user" / name
        if not p.is_symlink():
            os.symlink(to, p)
        return p


@pytest.fixture(scope="module")
def world(tiny_run, tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("guard")
    run = Path(shutil.copytree(tiny_run, root / "run"))
    store = root / "store"
    (store / "tokenizer").mkdir(parents=True)
    (store / STORE_MARKER).write_text("a token store\n")
    (store / "manifest.json").write_text('{"version": 1}\n')
    (root / "user").mkdir()
    src, ref = root / "user" / "src.txt", root / "user" / "ref.txt"
    src.write_text("a b c\nd e\n")
    ref.write_text("c b a\ne d\n")
    recipe = Path(shutil.copy(REPO / "configs" / "tiny_reverse.yaml", root / "user" / "recipe.yaml"))
    notes = root / "user" / "notes.txt"
    notes.write_text("the user's notes\n")
    png = root / "user" / "picture.txt"
    png.write_bytes(PNG_SIGNATURE + b"\0\0\0\rIHDR")
    hf = root / "hf"
    pytest.importorskip("transformers")
    assert main(["export", "hf", str(run), str(hf)]) == 0
    return World(root, run, store, src, ref, recipe, notes, png, hf)


def _file_cases(w: World, ext: str, inputs: list[Path]) -> list[Path]:
    """Bad destinations of a command that writes one file of extension ``ext``."""
    cases = [*inputs, w.run / "model.safetensors", w.run / "config.yaml", w.run / f"new{ext}",
             w.store / "manifest.json", w.store / f"new{ext}", w.root / "user",
             w.png if ext == ".txt" else w.text_named(f"x{ext}"),  # an existing file of another kind
             w.link(f"to_model{ext}", w.run / "model.safetensors")]
    if inputs:
        cases.append(w.link(f"to_input{ext}", inputs[0]))
        hard = w.root / "user" / f"hard_{inputs[0].name}{ext}"
        if not hard.exists():
            os.link(inputs[0], hard)
        cases.append(hard)
    return cases


def _dir_cases(w: World, inputs: list[Path]) -> list[Path]:
    """Bad destinations of a command that makes a directory."""
    return [*inputs, w.run / "checkpoints", w.run / "new", w.store / "new", w.store / "tokenizer", w.notes,
            w.link("to_checkpoints", w.run / "checkpoints")]


def _replace(argv: list[str], dest: Path) -> list[str]:
    return [str(dest) if a == "OUT" else a for a in argv]


# command, flag -> (argv with OUT where the destination goes, the bad destinations)
Cases = Callable[[World], list[list[str]]]


def _with(argv: list[str], dests: list[Path]) -> list[list[str]]:
    return [_replace(argv, d) for d in dests]


def _translate(w: World) -> list[list[str]]:
    argv = ["translate", str(w.run), "--input", str(w.src), "--output", "OUT", "--device", "cpu"]
    return _with(argv, _file_cases(w, ".txt", [w.src]))


def _summarize(w: World) -> list[list[str]]:
    argv = ["summarize", str(w.run), "--input", str(w.src), "--output", "OUT", "--device", "cpu"]
    return _with(argv, _file_cases(w, ".txt", [w.src]))


def _average(w: World) -> list[list[str]]:
    ckpt = sorted((w.run / "checkpoints").glob("step_*[0-9].safetensors"))[-1]
    return _with(["average", str(w.run), "--last", "2", "--out", "OUT"], _file_cases(w, ".safetensors", [ckpt]))


def _viz(w: World) -> list[list[str]]:
    cases = []
    for what, extra in (("positional", []), ("mask", []), ("schedule", [str(w.recipe)]),
                        ("model", [str(w.recipe)]), ("curves", [str(w.run / "metrics.jsonl")]),
                        ("attention", [str(w.run), "--src", "a b"])):
        inputs = [Path(extra[0])] if extra and what != "attention" else []
        dests = _file_cases(w, ".png", inputs)
        if what == "attention":  # the names derived from the stem
            w.text_named(f"att_{len(cases)}_cross.png")
            dests = [w.root / "user" / f"att_{len(cases)}.png", w.run / "att.png", w.store / "att.png"]
        cases += _with(["viz", what, *extra, "--out", "OUT"], dests)
    return cases


def _evaluate(w: World) -> list[list[str]]:
    (w.run / "eval").mkdir(exist_ok=True)
    (w.run / "eval" / "bad_json.json").write_text("not a record\n")  # the user's text under a record's name
    (w.run / "eval" / "bad_hyp.hyp").write_bytes(PNG_SIGNATURE)
    (w.run / "eval" / "a_dir.json").mkdir(exist_ok=True)
    shutil.copy(w.src, w.run / "eval" / "own.hyp")
    base = ["evaluate", str(w.run), "--src", str(w.src), "--ref", str(w.ref), "--device", "cpu", "--name"]
    return [[*base, "bad_json"], [*base, "bad_hyp"], [*base, "a_dir"], [*base, "../config"], [*base, ""],
            ["evaluate", str(w.run), "--src", str(w.run / "eval" / "own.hyp"), "--ref", str(w.ref), "--device", "cpu",
             "--name", "own"]]


def _prepare(w: World) -> list[list[str]]:
    return _with(["prepare", str(w.recipe), "--out", "OUT"], [*_dir_cases(w, [w.recipe]), w.run, w.root / "user"])


def _train(w: World) -> list[list[str]]:
    return _with(["train", str(w.recipe), "--run-dir", "OUT"], _dir_cases(w, [w.recipe]))


def _demo(w: World) -> list[list[str]]:
    return _with(["demo", "--config", str(w.recipe), "--run-dir", "OUT"], _dir_cases(w, [w.recipe]))


def _table3(w: World) -> list[list[str]]:
    return _with(["table3", str(w.recipe), "--rows", "base", "--out", "OUT"], _dir_cases(w, [w.recipe]))


def _sweep_out(w: World) -> list[list[str]]:
    return _with(["sweep", str(w.recipe), "--out", "OUT"], [*_dir_cases(w, [w.recipe]), w.run])


def _sweep_work(w: World) -> list[list[str]]:
    fresh = w.root / "never_made"
    return _with(["sweep", str(w.recipe), "--out", str(fresh), "--work", "OUT"], _dir_cases(w, [w.recipe]))


def _export(w: World) -> list[list[str]]:
    cases = []
    for engine in ("ctranslate2", "hf"):
        cases += _with(["export", engine, str(w.run), "OUT", "--force"],
                       [w.run, w.run / "checkpoints", w.run / "new", w.store / "new", w.store, w.notes, w.root])
    argos = [w.run / "x.argosmodel", w.store / "x.argosmodel", w.text_named("y.argosmodel"),
             w.link("to_config.argosmodel", w.run / "config.yaml"), w.root / "user"]
    return cases + _with(["export", "argos", str(w.run), "OUT", "--force"], argos)


def _import(w: World) -> list[list[str]]:
    return _with(["import", "hf", str(w.hf), "OUT", "--force"],
                 [w.hf, w.hf / "sub", w.run / "checkpoints", w.run / "new", w.store / "new", w.notes, w.root])


CASES: dict[tuple[str, str], Cases] = {
    ("train", "--run-dir"): _train, ("translate", "--output"): _translate, ("evaluate", "--name"): _evaluate,
    ("prepare", "--out"): _prepare, ("average", "--out"): _average, ("table3", "--out"): _table3,
    ("sweep", "--out"): _sweep_out, ("sweep", "--work"): _sweep_work, ("summarize", "--output"): _summarize,
    ("export", "out_dir"): _export, ("import", "run_dir"): _import, ("viz", "--out"): _viz,
    ("demo", "--run-dir"): _demo,
}


def test_every_output_argument_of_the_parser_has_its_bad_destinations():
    found = {(command, flag) for command, flag, _ in output_arguments()}
    assert found == set(CASES), found ^ set(CASES)


@pytest.mark.parametrize(("command", "flag", "kind"), output_arguments(), ids=lambda x: str(x))
def test_a_bad_destination_is_refused_in_one_line_and_nothing_changes(command, flag, kind, world, capsys):
    cases = CASES[(command, flag)](world)
    assert len(cases) >= 4
    for argv in cases:
        before = snapshot(world.root)
        line = one_line(capsys, argv)
        assert "internal error" not in line and "not installed" not in line, (argv, line)
        assert snapshot(world.root) == before, argv


# --- the cases the issue reproduced ----------------------------------------------------------------------------------


def test_translate_never_replaces_its_input(world, tmp_path, capsys):
    f = tmp_path / "f.txt"
    f.write_text("a b\n")
    assert "is the input" in one_line(capsys, ["translate", str(world.run), "--input", str(f), "--output", str(f)])
    assert f.read_text() == "a b\n"
    out = tmp_path / "out.txt"
    out.write_text("old translation\n")  # a text file is what translate writes: replaced
    assert main(["translate", str(world.run), "--input", str(f), "--output", str(out), "--device", "cpu"]) == 0
    assert out.read_text() != "old translation\n" and len(out.read_text().splitlines()) == 1


def test_average_and_viz_look_at_the_content_not_the_name(world, tmp_path, capsys):
    x = tmp_path / "x.safetensors"
    x.write_text("notes\n")
    line = one_line(capsys, ["average", str(world.run), "--last", "2", "--out", str(x)])
    assert "is not a safetensors weights file" in line and x.read_text() == "notes\n"
    t = tmp_path / "t.png"
    t.write_text("notes\n")
    assert "is not a PNG image" in one_line(capsys, ["viz", "mask", "--out", str(t)])
    (tmp_path / "att_cross.png").write_text("notes\n")
    before = snapshot(tmp_path)
    line = one_line(capsys, ["viz", "attention", str(world.run), "--src", "a b", "--out", str(tmp_path / "att.png")])
    assert "att_cross.png" in line and snapshot(tmp_path) == before
    good = tmp_path / "good.safetensors"  # weights are replaced by weights, a PNG by a PNG
    assert main(["average", str(world.run), "--last", "2", "--out", str(good)]) == 0
    assert main(["average", str(world.run), "--last", "2", "--out", str(good)]) == 0
    assert main(["viz", "mask", "--out", str(tmp_path / "m.png")]) == 0
    assert main(["viz", "mask", "--out", str(tmp_path / "m.png")]) == 0


def test_evaluate_int8_with_a_name_writes_its_own_record(world, capsys):
    argv = ["evaluate", str(world.run), "--src", str(world.src), "--ref", str(world.ref), "--device", "cpu",
            "--name", "foo"]
    assert main(argv) == 0
    fp32 = (world.run / "eval" / "foo.json").read_bytes()
    assert main([*argv, "--precision", "int8"]) == 0
    assert (world.run / "eval" / "foo.json").read_bytes() == fp32
    assert (world.run / "eval" / "foo.int8.json").is_file() and (world.run / "eval" / "foo.int8.hyp").is_file()
    assert main([*argv, "--weights", "last"]) == 0
    assert (world.run / "eval" / "foo.json").read_bytes() == fp32
    assert (world.run / "eval" / "foo.last.json").is_file()


def test_a_symlink_loop_or_a_name_past_the_limit_is_no_internal_error(world, tmp_path, capsys):
    from aiayn.files import guard_output, guard_output_dir

    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert guard_output(tmp_path / "a", "text", [world.src]) == tmp_path / "a"  # a loop holds no data: written
    assert guard_output_dir(tmp_path / "a", [world.src]) == tmp_path / "a"
    line = one_line(capsys, ["translate", str(world.run), "--input", str(world.src), "--output",
                             str(tmp_path / ("x" * 300 + ".txt"))])
    assert "File name too long" in line


def test_stdout_a_directory_name_a_file_above_and_a_control_character_are_one_line(world, tmp_path, capsys):
    """``average --out -`` wrote a file named ``-``; ``--out newdir/`` a file named ``newdir``; a parent that is a
    file said only "File exists"; ``evaluate --name $'x\\ny'`` split the log's line and named a record with it."""
    (tmp_path / "f").write_text("the user's file\n")
    before = snapshot(world.root)
    for argv, says in ((["average", str(world.run), "--last", "2", "--out", "-"], "not written to stdout"),
                       (["average", str(world.run), "--last", "2", "--out", f"{tmp_path}/new/"], "names a directory"),
                       (["viz", "mask", "--out", "-"], "not written to stdout"),
                       (["translate", str(world.run), "--input", str(world.src), "--output", f"{tmp_path}/f/out.txt"],
                        "is a file, not a directory"),
                       (["export", "hf", str(world.run), f"{tmp_path}/f/hf"], "is a file, not a directory"),
                       (["evaluate", str(world.run), "--src", str(world.src), "--ref", str(world.ref), "--device",
                         "cpu", "--name", "x\ny"], "no control characters")):
        line = one_line(capsys, argv)
        assert says in line, (argv, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"] and not os.path.exists("-")
    assert snapshot(world.root) == before
