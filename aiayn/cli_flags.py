"""The command line's decoding flags: which :class:`~aiayn.config.DecodeOptions` fields ``aiayn translate``,
``evaluate``, ``summarize``, ``generate`` and ``serve`` take as ``--name-with-dashes``, with their help.

The config's ``decode`` section knows nothing of the command line; :func:`aiayn.cli.add_decode_options` builds the
flags from this table, in the order of the dataclass' fields. Every field is either here or in :data:`NOT_FLAGS`
(tests/test_cli_flags.py), so a new decoding option is a field, its step in the search, and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from aiayn.config import LENGTH_PENALTIES, STOP_RULES


@dataclass(frozen=True)
class Flag:
    """A decoding option's command-line flag: its help, whether only searching commands take it (translate,
    evaluate, summarize; not generate), its choices and metavar."""

    help: str
    search: bool = False
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


DECODE_FLAGS: Mapping[str, Flag] = MappingProxyType({
    "beam": Flag("beam size; 1 = greedy (default: the run's, paper: 4)", search=True),
    "alpha": Flag("length penalty alpha (paper: 0.6)", search=True),
    "length_penalty": Flag(
        "gnmt: score/((5+|Y|)/6)^alpha (paper); power: score/|Y|^alpha (fairseq, HF, CTranslate2)", search=True,
        choices=LENGTH_PENALTIES),
    "max_len_a": Flag("at most a * source length + b decoding steps (paper: 1)", search=True),
    "max_len_b": Flag("(paper: 50)", search=True),
    "min_len": Flag("no EOS before this many tokens", search=True),
    "nbest": Flag("hypotheses per input (at most the beam; sampling: draws)", search=True),
    "stop": Flag(
        "beam stopping rule (exact: never early; hf: HF's default; first: once N have ended, as CTranslate2)",
        search=True, choices=STOP_RULES),
    "no_repeat_ngram": Flag("never repeat an n-gram of the output (0: off)", metavar="N"),
    "sample": Flag("draw tokens (--temperature, --top-k, --top-p, --seed) instead of searching", search=True),
    "temperature": Flag("sampling temperature (0: greedy)"),
    "top_k": Flag("sample among the k most probable tokens"),
    "top_p": Flag("sample from the smallest set with probability mass >= p"),
    "seed": Flag("seed of the draws (repeatable sampling)"),
    "cuda_graphs": Flag("CUDA: replay each beam search step as one CUDA graph"),
    "max_tokens": Flag("token budget of one decoding batch (default: by device)", search=True),
})

# The DecodeOptions fields the command line does not take as decoding flags: ban_pad is set by the runs that need
# it (imported Marian runs); max_new_tokens is each command's own option (generate, summarize).
NOT_FLAGS = ("ban_pad", "max_new_tokens")
