"""Text in, text out: the Translator and ``aiayn translate`` keep the input order through length-sorted
batches, map empty lines to empty lines, truncate over-long sources with a warning naming the line,
and return exactly what the search functions return on the same ids."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import SUM_TOL, same_hypotheses, spec_of  # tests/ is on sys.path under pytest

import aiayn
from aiayn import cli
from aiayn.config import DEFAULT_DECODE_TOKENS, ConfigError, DecodeOptions
from aiayn.data.batching import token_batches
from aiayn.data.synthetic import reverse_split
from aiayn.decode.translator import Translator
from aiayn.search import SearchSpec, beam_search, decode_batches, decode_ids, greedy_search, score_tokens
from aiayn.search import sources as sources_module

EOS = 3


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def translator(tiny_run) -> Translator:
    return aiayn.load(tiny_run)


@pytest.fixture(scope="module")
def sources() -> list[str]:
    """Test sentences of varied lengths, shuffled so that length order differs from input order."""
    return [s for s, _ in reverse_split("test")[:12]]


def long_line(translator: Translator) -> str:
    line = " ".join(["alpha", "bravo", "charlie"] * 40)
    assert len(translator.tokenizers.src.encode(line)) > translator.cfg.model.max_positions
    return line


def test_batched_equals_one_by_one(translator, sources):
    texts = sources[:6] + [""] + sources[6:] + ["   "]
    # A budget that makes several length-sorted batches whose order is not the input order.
    max_tokens = 4 * 40
    widths = [len(translator.tokenizers.src.encode(t)) + 1 for t in sources]
    batches = decode_batches(widths, translator.options(max_tokens=max_tokens), "cpu")
    assert len(batches) > 2 and [i for b in batches for i in b] != list(range(len(sources)))
    found = translator.translate_hypotheses(texts, max_tokens=max_tokens)
    batched = [h[0].text if h else "" for h in found]
    assert batched == translator.translate(texts, max_tokens=max_tokens)  # the same batches: exactly
    # Alone, each sentence gets the same best hypothesis, or one whose score ties it (padding sums in another order)
    swaps = 0
    for text, hyps in zip(texts, found):
        [alone] = translator.translate_hypotheses([text])
        swaps += same_hypotheses([(h.ids, h.score) for h in hyps[:1]], [(h.ids, h.score) for h in alone[:1]], text)
        if hyps and hyps[0].ids == alone[0].ids:
            assert hyps[0].text == alone[0].text
    assert swaps <= 1  # not a test of ties: almost every sentence gets the very same tokens
    assert len(batched) == len(texts)
    assert batched[6] == "" and batched[-1] == ""
    # Not vacuous: most lines got a non-empty translation (a 60-update toy model may stop at once on a few).
    nonempty = [batched[i] for i in range(len(texts)) if texts[i].strip()]
    assert sum(1 for t in nonempty if t) >= 0.5 * len(nonempty) and len(set(nonempty)) > 3
    assert translator.translate(sources[0]) == batched[0]  # a single string in, a single string out


def test_translate_equals_direct_beam_search(translator, sources):
    cfg, tok, model = translator.cfg.decode, translator.tokenizers, translator.model
    found = translator.translate_hypotheses(sources, nbest=3, max_tokens=200)
    swaps = 0
    for text, hyps in zip(sources, found):
        src = torch.tensor([tok.src.encode(text) + [EOS]])
        spec = spec_of(beam=cfg.beam, alpha=cfg.alpha, length_penalty=cfg.length_penalty, max_len_a=cfg.max_len_a,
                       max_len_b=cfg.max_len_b, nbest=3)
        ours = beam_search(model, src, spec=spec)[0]
        # batched (padded) vs alone: the same tokens and scores up to rounding, except that two candidates whose
        # scores tie (this 60-update toy model has 3rd and 4th candidates 1e-6 apart) may come in either order
        swaps += same_hypotheses([(h.ids, h.score) for h in hyps], [(h.tokens, h.score) for h in ours], text)
        for h, o in zip(hyps, ours):
            if h.ids == o.tokens:
                assert h.logprob == pytest.approx(o.logprob, **SUM_TOL)
                assert h.text == tok.tgt.text(o.tokens) and h.tokens == [tok.tgt.id_to_piece(i) for i in o.tokens]
    assert swaps <= len(sources) // 4
    # The same batches as `found`: exactly the same hypotheses.
    plain = translator.translate(sources, nbest=3, max_tokens=200)
    assert plain == [[h.text for h in hyps] for hyps in found]


def test_greedy_equals_direct_greedy_search_and_scores_match_beam(translator, sources):
    cfg, tok, model = translator.cfg.decode, translator.tokenizers, translator.model
    found = translator.translate_hypotheses(sources, beam=1, length_penalty="power", alpha=1.0)
    for text, hyps in zip(sources, found):
        src = torch.tensor([tok.src.encode(text) + [EOS]])
        assert [h.ids for h in hyps] == greedy_search(model, src, spec=spec_of(max_len_a=cfg.max_len_a,
                                                                               max_len_b=cfg.max_len_b))
    # The teacher-forced score of greedy outputs follows the search's conventions: re-scoring beam
    # hypotheses (ended by EOS or cut at the limit) gives back their logprob and penalized score.
    for text in sources[:4]:
        src = torch.tensor([tok.src.encode(text) + [EOS]])
        hyps = beam_search(model, src, spec=spec_of(beam=4, alpha=1.0, length_penalty="power",
                                                    max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b, nbest=4))[0]
        src_n = src.expand(len(hyps), -1)  # the same source, hence the same step limit, for every hypothesis
        spec = spec_of(alpha=1.0, length_penalty="power", max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b)
        rescored = score_tokens(model, src_n, src_n != 0, [h.tokens for h in hyps], spec)
        for h, r in zip(hyps, rescored):
            assert r.tokens == h.tokens
            assert r.logprob == pytest.approx(h.logprob, abs=1e-4)
            assert r.score == pytest.approx(h.score, abs=1e-4)


def test_truncation_warns_with_the_line_number(translator, sources, caplog):
    line = long_line(translator)
    limit = translator.cfg.model.max_positions - 1
    with caplog.at_level("WARNING", logger="aiayn.translate"):
        out = translator.translate([sources[0], line, sources[1]])
    assert len(out) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("line 2:")
    # The cut source decodes exactly like its first `limit` ids given to the search directly.
    cfg, tok = translator.cfg.decode, translator.tokenizers
    src = torch.tensor([tok.src.encode(line)[:limit] + [EOS]])
    spec = spec_of(beam=cfg.beam, alpha=cfg.alpha, length_penalty=cfg.length_penalty, max_len_a=cfg.max_len_a,
                   max_len_b=cfg.max_len_b)
    best = beam_search(translator.model, src, spec=spec)[0][0]
    assert out[1] == tok.tgt.decode(best.tokens)


def test_options_and_errors(translator, sources):
    assert translator.options().beam == translator.cfg.decode.beam
    assert translator.options(beam=2, alpha=0.0, length_penalty="none").length_penalty == "none"
    assert translator.options(beam=None).beam == translator.cfg.decode.beam  # None keeps the run's value
    with pytest.raises(ConfigError, match="nbest"):
        translator.translate(sources[:1], beam=2, nbest=3)
    with pytest.raises(ConfigError, match="length_penalty"):
        translator.translate(sources[:1], length_penalty="average")
    with pytest.raises(ConfigError, match="alpha"):
        translator.translate(sources[:1], alpha=float("nan"))
    with pytest.raises(ConfigError, match="unknown decoding option"):
        translator.translate(sources[:1], bream=3)
    assert isinstance(aiayn.load(translator.path), Translator)


def test_decode_batches_fill_the_device_budget():
    widths = [16] * 1500 + [4] * 100  # 15 and 3 tokens and their EOS
    per_device = {d: decode_batches(widths, DecodeOptions(), d) for d in ("cpu", "cuda", "mps")}
    for device, batches in per_device.items():
        assert sorted(i for b in batches for i in b) == list(range(len(widths)))  # every source once
        budget = DEFAULT_DECODE_TOKENS[device]  # source tokens x beam 4
        assert all(len(b) * max(widths[i] for i in b) * 4 <= budget for b in batches)
    full = {d: max(len(b) for b in batches if widths[b[0]] == 16) for d, batches in per_device.items()}
    assert full == {"cpu": 64, "cuda": 512, "mps": 128}  # a GPU gets 8x the CPU's rows
    assert {len(b) for b in decode_batches([16] * 100, DecodeOptions(max_tokens=640), "cuda")} == {10}
    sampled = decode_batches([16] * 100, DecodeOptions(sample=True, nbest=2, max_tokens=640), "cpu")
    assert {len(b) for b in sampled} == {20}  # rows are the draws when sampling
    assert decode_batches([9, 3], DecodeOptions(max_tokens=8), "cpu") == [[1], [0]]  # one over the budget: alone


@pytest.mark.parametrize("beam,sample,budget", [(4, False, 120), (1, False, 64), (3, True, 4096), (5, False, 3)])
def test_decode_batches_are_the_batches_translations_were_made_in(beam, sample, budget):
    """The search's own batching cuts the batches it cut when it borrowed training's (token_batches with the
    EOS left to its +1): the same batches, so the same outputs, token for token."""
    import random

    rng = random.Random(beam * budget)
    lengths = [rng.randrange(0, 40) for _ in range(300)]
    opts = DecodeOptions(beam=beam, nbest=beam if sample else 1, sample=sample, max_tokens=budget)
    before = token_batches(lengths, None, max(1, budget // beam), shuffle=False)
    assert decode_batches([n + 1 for n in lengths], opts, "cpu") == before


def test_decode_ids_searches_the_token_budget_batches(translator, sources, monkeypatch):
    seen = []

    def record(model, src, src_mask, spec, scores=True):
        seen.append(sorted(src_mask.sum(1).tolist()))
        return [[] for _ in range(src.size(0))]

    monkeypatch.setattr(sources_module, "search_batch", record)
    ids = [translator.tokenizers.src.encode(t) for t in sources]
    opts = translator.options(max_tokens=4 * 30)
    decode_ids(translator.model, ids, SearchSpec(opts, translator.tokenizers.specials))
    want = decode_batches([len(x) + 1 for x in ids], opts, "cpu")
    # in any order: with two intra-op threads, two batches may be searched side by side (search_batches)
    assert len(want) > 2 and sorted(seen) == sorted(sorted(len(ids[i]) + 1 for i in b) for b in want)


# Command line -----------------------------------------------------------------------------------------


def test_cli_file_to_file_and_json(tiny_run, translator, sources, tmp_path):
    lines = sources[:5] + [""] + sources[5:8]
    inp, out, js = tmp_path / "in.txt", tmp_path / "out.txt", tmp_path / "out.jsonl"
    inp.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    assert cli.main(["translate", str(tiny_run), "--input", str(inp), "--output", str(out), "--beam", "2"]) == 0
    got = out.read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and got[:-1] == translator.translate(lines, beam=2)
    assert got[5] == ""

    argv = ["translate", str(tiny_run), "--input", str(inp), "--output", str(js), "--json", "--nbest", "2",
            "--beam", "2", "--alpha", "1.0", "--length-penalty", "power"]
    assert cli.main(argv) == 0
    records = [json.loads(x) for x in js.read_text(encoding="utf-8").splitlines()]
    expected = translator.translate_hypotheses(lines, beam=2, alpha=1.0, length_penalty="power", nbest=2)
    assert [r["line"] for r in records] == list(range(1, len(lines) + 1))
    assert [r["src"] for r in records] == lines
    assert records[5]["hyps"] == []
    for r, hyps in zip(records, expected):
        assert [set(h) for h in r["hyps"]] == [{"text", "score", "logprob", "tokens"}] * len(hyps)
        assert [h["text"] for h in r["hyps"]] == [h.text for h in hyps]
        assert [h["tokens"] for h in r["hyps"]] == [h.tokens for h in hyps]
        assert [h["score"] for h in r["hyps"]] == [h.score for h in hyps]
        assert all(h["score"] >= h2["score"] for h, h2 in zip(r["hyps"], r["hyps"][1:]))
    # beam 1 --json: greedy output, with finite scores from the teacher-forced pass
    argv = ["translate", str(tiny_run), "--input", str(inp), "--output", str(js), "--json", "--beam", "1"]
    assert cli.main(argv) == 0
    records = [json.loads(x) for x in js.read_text(encoding="utf-8").splitlines()]
    assert [r["hyps"][0]["text"] if r["hyps"] else "" for r in records] == translator.translate(lines, beam=1)
    assert all(math.isfinite(r["hyps"][0]["logprob"]) for r in records if r["hyps"])


def test_cli_stdin_to_stdout(tiny_run, translator, sources, monkeypatch, capsys):
    lines = [sources[0], "", sources[1]]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    assert cli.main(["translate", str(tiny_run), "--beam", "1"]) == 0
    assert capsys.readouterr().out == "".join(x + "\n" for x in translator.translate(lines, beam=1))


def test_cli_subprocess_stdin_warning_on_stderr(tiny_run, translator, sources):
    """The real process: stdin -> stdout, one line per input line, the truncation warning on stderr."""
    lines = [sources[0], long_line(translator), "", sources[2]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "aiayn", "translate", str(tiny_run), "--beam", "1"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == translator.translate(lines, beam=1)
    warn = [ln for ln in proc.stderr.splitlines() if "WARNING" in ln]
    assert len(warn) == 1 and "line 2:" in warn[0] and "positions" in warn[0]


@pytest.mark.parametrize("argv, message", [
    (["translate", "{tmp}/no_such_run"], "no such run directory"),
    (["translate", "{run}", "--input", "{tmp}/missing.txt"], "missing.txt: no such file"),
    (["translate", "{run}", "--json", "--nbest", "5"], "decode.nbest=5: at most the beam size"),
    (["translate", "{run}", "--beam", "0"], "decode.beam=0: must be >= 1"),
    (["translate", "{run}", "--alpha", "nan", "--json"], "decode.alpha=nan: expected a finite number"),
    (["translate", "{run}", "--top-p", "1.5", "--sample"], "decode.top_p=1.5"),
    (["translate", "{run}", "--device", "bogus"], "device 'bogus': unknown"),
    (["translate", "{run}", "--chunk", "0"], "--chunk must be >= 1"),
])
def test_cli_bad_input_exits_2_with_one_line(tiny_run, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "stdin", io.StringIO("alpha\n"))
    argv = [a.format(tmp=tmp_path, run=tiny_run) for a in argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aiayn: error:") and message in err[0], err
