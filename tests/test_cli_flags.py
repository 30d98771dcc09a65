"""The decoding flags live beside the command line (aiayn/cli_flags.py), not in the config's decode section
(issue 72 point 4d): every DecodeOptions field is a flag there or named as not one, and the parser builds them."""

from __future__ import annotations

import argparse
import dataclasses

from aiayn.cli import build_parser
from aiayn.cli_flags import DECODE_FLAGS, NOT_FLAGS
from aiayn.config import DecodeOptions


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_decoding_option_is_a_flag_or_named_as_none():
    fields = [f.name for f in dataclasses.fields(DecodeOptions)]
    assert set(DECODE_FLAGS).isdisjoint(NOT_FLAGS)
    assert sorted([*DECODE_FLAGS, *NOT_FLAGS]) == sorted(fields)  # a new field must be placed: a flag or not one
    assert all(not f.metadata for f in dataclasses.fields(DecodeOptions))  # the config section carries no CLI data


def test_the_commands_take_the_flags_of_the_table():
    def flags(cmd: str) -> set[str]:
        return {o for a in _subparser(cmd)._actions for o in a.option_strings}

    searching = {"--" + n.replace("_", "-") for n in DECODE_FLAGS}
    plain = {"--" + n.replace("_", "-") for n, f in DECODE_FLAGS.items() if not f.search}
    for cmd in ("translate", "evaluate", "summarize", "serve"):
        assert searching <= flags(cmd), cmd
    assert plain <= flags("generate") and not (searching - plain) & flags("generate")  # generate does not search
    assert not {"--ban-pad", "--max-new-tokens"} & flags("translate")
    [stop] = [a for a in _subparser("translate")._actions if "--stop" in a.option_strings]
    assert stop.choices == DECODE_FLAGS["stop"].choices and stop.default is None  # None: the run's decode section
