"""Text in, text out: tokenize, batch by length, search on ids, detokenize, restore the input order.

:func:`load` gives a :class:`Translator` for a run directory (``aiayn.load(RUN)`` calls it)::

    tr = aiayn.load("runs/multi30k")
    tr.translate(["A dog runs.", "Two men talk."])            # -> ["Ein Hund läuft.", ...]
    tr.translate_hypotheses(["A dog runs."], nbest=4)[0][0]   # -> Translation(text, score, logprob, ...)

Conventions (also those of ``aiayn translate``):

* The source fed to the model is ``tokens + [EOS]``; the decoder starts from BOS (as in training).
* An empty (or whitespace-only) input gives an empty output and is not decoded.
* A source longer than the model's positions (``model.max_positions``, EOS included) is cut to its
  first ``max_positions - 1`` tokens, with a warning naming its 1-based line (its index + 1).
* Sentences are sorted by length and cut into batches whose ``source tokens x beam`` (padding and the
  EOS included) stays within ``max_tokens``; results come back in the input order. Beam 1 is greedy
  search, beam > 1 :func:`~aiayn.decode.search.beam_search` with the exact stopping rule.
* Decoding options left as None come from the run's config (``decode`` section).
* ``score`` is the length-penalized score the search ranks by, ``logprob`` the summed token
  log-probabilities (the EOS included when the hypothesis ended with one). Greedy search does not
  track them; when they are asked for, one teacher-forced pass over the found tokens computes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from aiayn.config import Config, ConfigError
from aiayn.data.batching import pad_batch, token_batches
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, TokenizerPair
from aiayn.decode.search import Hypothesis, beam_search, greedy_search, max_lengths, penalized_score

log = logging.getLogger("aiayn.translate")


@dataclass
class DecodeSettings:
    """How to search: beam (1 = greedy), length penalty, length limit ``int(a * src_len + b)``, batch budget."""

    beam: int = 4
    alpha: float = 0.6
    length_penalty: str = "gnmt"
    max_len_a: float = 1.0
    max_len_b: float = 50
    max_tokens: int = 4096
    no_repeat_ngram: int = 0

    @classmethod
    def from_config(cls, cfg: Config, beam: int | None = None, alpha: float | None = None,
                    length_penalty: str | None = None, max_tokens: int | None = None,
                    no_repeat_ngram: int | None = None) -> DecodeSettings:
        """The config's ``decode`` section with the given (non-None) options replacing its values."""
        d = cfg.decode
        s = cls(
            beam=d.beam if beam is None else beam,
            alpha=d.alpha if alpha is None else alpha,
            length_penalty=d.length_penalty if length_penalty is None else length_penalty,
            max_len_a=d.max_len_a,
            max_len_b=d.max_len_b,
            max_tokens=d.max_tokens if max_tokens is None else max_tokens,
            no_repeat_ngram=d.no_repeat_ngram if no_repeat_ngram is None else no_repeat_ngram,
        )
        s.check()
        return s

    def check(self, nbest: int = 1) -> None:
        if self.beam < 1:
            raise ConfigError(f"beam must be >= 1, got {self.beam}")
        if self.length_penalty not in ("gnmt", "power", "none"):
            raise ConfigError(f"length penalty {self.length_penalty!r}: expected gnmt, power or none")
        if self.no_repeat_ngram < 0:
            raise ConfigError(f"no-repeat-ngram must be >= 0 (0: off), got {self.no_repeat_ngram}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 1 <= nbest <= self.beam:
            raise ConfigError(f"nbest must be between 1 and the beam size ({self.beam}), got {nbest}")


@dataclass
class Translation:
    """One hypothesis as text: ``tokens`` are its pieces, ``ids`` their ids (no BOS/EOS)."""

    text: str
    score: float
    logprob: float
    tokens: list[str]
    ids: list[int]


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _score_tokens(model: nn.Module, src: torch.Tensor, found: list[list[int]], limits: list[int],
                  alpha: float, length_penalty: str) -> list[Hypothesis]:
    """Teacher-forced log-probabilities of greedy outputs: src (B, S) with EOS, ``found`` without EOS.

    A sentence shorter than its step limit ended with EOS (counted in the logprob and in |Y|); one of
    exactly ``limit`` tokens was cut there (see :mod:`aiayn.decode.search`).
    """
    seqs = [t + [EOS_ID] if len(t) < lim else list(t) for t, lim in zip(found, limits)]
    tgt_in = pad_batch([[BOS_ID] + s[:-1] for s in seqs], PAD_ID).to(src.device)  # (B, T)
    tgt_out = pad_batch(seqs, PAD_ID).to(src.device)  # (B, T)
    lprobs = torch.log_softmax(model(src, tgt_in).float(), dim=-1)  # (B, T, V)
    tok_lp = lprobs.gather(2, tgt_out.unsqueeze(-1)).squeeze(-1)  # (B, T)
    mask = torch.zeros_like(tok_lp, dtype=torch.bool)
    for b, s in enumerate(seqs):
        mask[b, : len(s)] = True
    sums = tok_lp.masked_fill(~mask, 0.0).sum(dim=1).tolist()
    return [Hypothesis(list(t), penalized_score(lp, len(s), alpha, length_penalty), lp)
            for t, s, lp in zip(found, seqs, sums)]


def decode_sources(model: nn.Module, sources: Sequence[Sequence[int]], settings: DecodeSettings,
                   nbest: int = 1, scores: bool = True) -> list[list[Hypothesis]]:
    """Search every source (ids without EOS) and return its hypotheses, best first, in input order.

    Sources are sorted by length and batched so that ``len(batch) * (longest + 1) * beam <=
    settings.max_tokens`` (a single longer source forms its own batch). Beam 1 is greedy search; its
    ``score``/``logprob`` are computed by a teacher-forced pass when ``scores`` (NaN otherwise).
    The model must be in eval mode.
    """
    settings.check(nbest)
    device = _device(model)
    out: list[list[Hypothesis]] = [[] for _ in sources]
    if not sources:
        return out
    budget = max(1, settings.max_tokens // settings.beam)
    for idx in token_batches([len(s) for s in sources], None, budget, shuffle=False):
        src = pad_batch([list(sources[i]) + [EOS_ID] for i in idx], PAD_ID).to(device)  # (B, S)
        mask = src != PAD_ID
        if settings.beam == 1:
            found = greedy_search(model, src, mask, max_len_a=settings.max_len_a, max_len_b=settings.max_len_b,
                                  bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
                                  no_repeat_ngram=settings.no_repeat_ngram)
            if scores:
                limits = max_lengths(model, mask, settings.max_len_a, settings.max_len_b)
                hyps = [[h] for h in _score_tokens(model, src, found, limits, settings.alpha,
                                                   settings.length_penalty)]
            else:
                hyps = [[Hypothesis(t, float("nan"), float("nan"))] for t in found]
        else:
            hyps = beam_search(model, src, mask, beam=settings.beam, alpha=settings.alpha,
                               length_penalty=settings.length_penalty, max_len_a=settings.max_len_a,
                               max_len_b=settings.max_len_b, nbest=nbest, bos_id=BOS_ID, eos_id=EOS_ID,
                               pad_id=PAD_ID, no_repeat_ngram=settings.no_repeat_ngram)
        for i, h in zip(idx, hyps):
            out[i] = h
    return out


class Translator:
    """A translation (or summarization) model with its tokenizers and decoding defaults."""

    def __init__(self, model: nn.Module, tokenizers: TokenizerPair, cfg: Config, path: Path | None = None) -> None:
        self.model = model.eval()
        self.tokenizers = tokenizers
        self.cfg = cfg
        self.path = path

    @property
    def max_source_tokens(self) -> int:
        """Source tokens that fit the model's positions once EOS is appended."""
        return max(1, self.cfg.model.max_positions - 1)

    def settings(self, beam: int | None = None, alpha: float | None = None, length_penalty: str | None = None,
                 max_tokens: int | None = None, no_repeat_ngram: int | None = None) -> DecodeSettings:
        """The run's decoding defaults with the given options replacing them."""
        return DecodeSettings.from_config(self.cfg, beam, alpha, length_penalty, max_tokens, no_repeat_ngram)

    def encode_sources(self, texts: Sequence[str], warn: bool = True) -> tuple[list[list[int] | None], list[int]]:
        """Token ids of each text (None for an empty or whitespace-only one) and the indices of the
        texts cut to :attr:`max_source_tokens`; ``warn`` logs one warning per cut text."""
        ids: list[list[int] | None] = []
        cut: list[int] = []
        limit = self.max_source_tokens
        for i, text in enumerate(texts):
            if not text.strip():
                ids.append(None)
                continue
            toks = self.tokenizers.src.encode(text)
            if len(toks) > limit:
                cut.append(i)
                if warn:
                    log.warning("line %d: %d source tokens do not fit the model's %d positions (with EOS); "
                                "translating the first %d", i + 1, len(toks), self.cfg.model.max_positions, limit)
                toks = toks[:limit]
            ids.append(toks)
        return ids, cut

    def _search(self, texts: Sequence[str], settings: DecodeSettings, nbest: int,
                scores: bool) -> list[list[Translation]]:
        ids, _ = self.encode_sources(texts)
        todo = [i for i, s in enumerate(ids) if s is not None]
        found = decode_sources(self.model, [ids[i] for i in todo], settings, nbest, scores)
        out: list[list[Translation]] = [[] for _ in texts]
        tgt = self.tokenizers.tgt
        for i, hyps in zip(todo, found):
            out[i] = [Translation(tgt.decode(h.tokens), h.score, h.logprob, [tgt.id_to_piece(t) for t in h.tokens],
                                  list(h.tokens)) for h in hyps]
        return out

    def translate_hypotheses(self, texts: Sequence[str], beam: int | None = None, alpha: float | None = None,
                             length_penalty: str | None = None, nbest: int = 1,
                             max_tokens: int | None = None, no_repeat_ngram: int | None = None
                             ) -> list[list[Translation]]:
        """Up to ``nbest`` :class:`Translation` per text, best first, with scores; [] for an empty text."""
        settings = self.settings(beam, alpha, length_penalty, max_tokens, no_repeat_ngram)
        return self._search(texts, settings, nbest, scores=True)

    def translate(self, texts: str | Sequence[str], beam: int | None = None, alpha: float | None = None,
                  length_penalty: str | None = None, nbest: int = 1, max_tokens: int | None = None,
                  no_repeat_ngram: int | None = None) -> str | list[str] | list[list[str]]:
        """Translate a list of texts: one string per text (nbest 1) or a list of up to ``nbest`` strings,
        best first (nbest > 1). A single string in gives a single string (or list) out."""
        if isinstance(texts, str):
            return self.translate([texts], beam, alpha, length_penalty, nbest, max_tokens, no_repeat_ngram)[0]
        settings = self.settings(beam, alpha, length_penalty, max_tokens, no_repeat_ngram)
        found = self._search(texts, settings, nbest, scores=False)
        if nbest == 1:
            return [hyps[0].text if hyps else "" for hyps in found]
        return [[h.text for h in hyps] for hyps in found]


def load(run_dir: str | Path, device: str | torch.device = "cpu") -> Translator:
    """A :class:`Translator` for a trained run directory (translation or summarization run)."""
    from aiayn.run_dir import load_run

    run = load_run(run_dir, device)
    if run.cfg.task == "lm":
        raise ConfigError(f"{run_dir} is a language-model run: use `aiayn generate` to continue text")
    return Translator(run.model, run.tokenizers, run.cfg, run.path)


# Command line ------------------------------------------------------------------------------------------


def _read_input(path: str | None) -> list[str]:
    """Lines of ``path`` (or stdin), without line endings, as :func:`aiayn.data.corpus.read_lines` reads them."""
    from aiayn.data.corpus import _decode, read_lines

    if path is not None and path != "-":
        return read_lines(path)
    stream = sys.stdin
    raw = stream.buffer.read() if hasattr(stream, "buffer") else stream.read().encode("utf-8")
    lines = _decode(raw, "<stdin>").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def _one_line(text: str) -> str:
    # A model can emit a newline piece (byte fallback); one output line per input line must hold.
    return text.replace("\r", " ").replace("\n", " ")


def format_json(line: int, src: str, hyps: list[Translation]) -> str:
    """The ``--json`` record of one input line: {"line", "src", "hyps": [{"text", "score", "logprob", "tokens"}]}."""
    rec = {"line": line, "src": src,
           "hyps": [{k: v for k, v in asdict(h).items() if k != "ids"} for h in hyps]}
    return json.dumps(rec, ensure_ascii=False)


def translate_cli(args: argparse.Namespace) -> int:
    """``aiayn translate``: one output line per input line, in order.

    Plain output: the best translation per line. ``--json``: one JSON object per line
    ``{"line": n (1-based), "src", "hyps": [{"text", "score", "logprob", "tokens"}, ...]}`` holding
    ``--nbest`` hypotheses, best first (``hyps`` is empty for an empty line). ``--nbest`` above 1 needs
    ``--json``, so that the plain output stays one line per input line.
    """
    nbest = args.nbest
    if nbest < 1:
        raise ConfigError(f"--nbest must be >= 1, got {nbest}")
    if nbest > 1 and not args.json:
        raise ConfigError("--nbest > 1 needs --json (plain output is one line per input line)")
    lines = _read_input(args.input)
    translator = load(args.run, device=args.device)
    opts = dict(beam=args.beam, alpha=args.alpha, length_penalty=args.length_penalty, max_tokens=args.max_tokens,
                no_repeat_ngram=args.no_repeat_ngram)
    settings = translator.settings(**opts)
    settings.check(nbest)
    if args.json:
        found = translator.translate_hypotheses(lines, nbest=nbest, **opts)
        out = [format_json(i + 1, src, hyps) for i, (src, hyps) in enumerate(zip(lines, found))]
    else:
        out = [_one_line(t) for t in translator.translate(lines, **opts)]
    text = "".join(o + "\n" for o in out)
    if args.output is not None and args.output != "-":
        Path(args.output).write_text(text, encoding="utf-8")
    elif hasattr(sys.stdout, "buffer"):  # UTF-8 whatever the locale says
        sys.stdout.flush()
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(text)
    return 0
