"""Discovery: every option and positional of every command says what it is; `aiayn --help` opens with the
first steps; `aiayn presets` lists each recipe in one line."""

from __future__ import annotations

import argparse

from aiayn.cli import build_parser, main
from aiayn.config import CONFIG_DIR


def walk(parser: argparse.ArgumentParser, prog: str = "aiayn"):
    """(command, action) for every action of ``parser`` and its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{prog} {name}")
        else:
            yield prog, action


def test_every_option_and_positional_has_help():
    missing = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in walk(build_parser())
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert missing == []


def test_help_starts_with_the_first_steps(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    steps = out[out.index("first steps:"):out.index("positional arguments")]
    assert "aiayn import hf Helsinki-NLP/opus-mt-en-de" in steps and "aiayn train multi30k_en_de_quick" in steps


def test_presets_lists_every_recipe_in_one_line(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    rows = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines[:-1]}
    assert sorted(rows) == names
    for name, summary in rows.items():  # a sentence of its own, not the start of a longer comment
        assert summary.endswith(".") and len(summary) <= 110, (name, summary)
