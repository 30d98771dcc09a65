"""Decoding options in one object, sampling for translation, and ``aiayn translate`` streaming chunk by chunk."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import spec_of  # tests/ is on sys.path under pytest

import aiayn
from aiayn import cli
from aiayn.config import DecodeOptions, config_from_dict
from aiayn.data.synthetic import reverse_split
from aiayn.decode.stream import format_record, iter_lines, translate_stream
from aiayn.decode.translator import Translation, Translator
from aiayn.errors import ConfigError, DataError
from aiayn.search import greedy_search, sample_search

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def translator(tiny_run) -> Translator:
    return aiayn.load(tiny_run, device="cpu")


@pytest.fixture(scope="module")
def sources() -> list[str]:
    return [s for s, _ in reverse_split("test")[:10]]


# DecodeOptions ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values, message", [
    ({"beam": 0}, "decode.beam=0: must be >= 1"),
    ({"alpha": float("nan")}, "decode.alpha=nan: expected a finite number"),
    ({"alpha": float("inf")}, "decode.alpha=inf"),
    ({"nbest": 5, "beam": 4}, "decode.nbest=5: at most the beam size"),
    ({"length_penalty": "avg"}, "decode.length_penalty='avg'"),
    ({"stop": "early"}, "decode.stop='early'"),
    ({"top_p": 0.0}, "decode.top_p=0.0"),
    ({"top_k": 0}, "decode.top_k=0"),
    ({"temperature": -1.0}, "decode.temperature=-1.0"),
    ({"max_len_a": -0.5}, "decode.max_len_a=-0.5"),
    ({"min_len": -1}, "decode.min_len=-1"),
    ({"max_tokens": 0}, "decode.max_tokens=0"),
    ({"no_repeat_ngram": -2}, "decode.no_repeat_ngram=-2"),
])
def test_decode_options_refuse_bad_values_in_yaml_and_in_calls(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict({"decode": values})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DecodeOptions().replace(**values)


def test_decode_options_replace_keeps_none_and_checks_names_and_types():
    base = DecodeOptions(beam=5, alpha=1.0)
    assert base.replace(beam=None, alpha=None) == base
    assert base.replace(beam=2).beam == 2 and base.beam == 5  # a copy
    assert base.replace(nbest=8, sample=True).nbest == 8  # sampling: nbest draws, whatever the beam
    with pytest.raises(ConfigError, match="unknown decoding option bream"):
        base.replace(bream=3)
    with pytest.raises(ConfigError, match="decode.beam: expected an integer"):
        base.replace(beam="four")
    assert DecodeOptions().batch_tokens("cpu") == 4096 and DecodeOptions(max_tokens=7).batch_tokens("cuda") == 7
    assert DecodeOptions().batch_tokens("cuda") > DecodeOptions().batch_tokens("cpu")


# Sampling for translation ------------------------------------------------------------------------------------


def _src(translator: Translator, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from aiayn.data.batching import pad_batch

    sp = translator.tokenizers.specials
    src = pad_batch([translator.tokenizers.src.encode(t) + [sp.eos] for t in texts], sp.pad)
    return src, src != sp.pad


def test_sampling_at_temperature_0_or_top_k_1_is_greedy(translator, sources):
    src, mask = _src(translator, sources)
    d = translator.cfg.decode
    greedy = greedy_search(translator.model, src, mask, spec=spec_of(max_len_a=d.max_len_a, max_len_b=d.max_len_b))
    for kw in ({"temperature": 0.0}, {"top_k": 1, "temperature": 1.3, "seed": 4}):
        drawn = sample_search(translator.model, src, mask, spec=spec_of(nbest=2, max_len_a=d.max_len_a,
                                                                        max_len_b=d.max_len_b, **kw))
        assert [[h.tokens for h in hyps] for hyps in drawn] == [[g, g] for g in greedy]
        assert all(math.isfinite(h.logprob) and h.logprob <= 0 for hyps in drawn for h in hyps)


def test_sampling_is_repeatable_with_a_seed_and_varies_without(translator, sources):
    a = translator.translate(sources, sample=True, nbest=3, seed=7, temperature=1.5)
    b = translator.translate(sources, sample=True, nbest=3, seed=7, temperature=1.5)
    c = translator.translate(sources, sample=True, nbest=3, seed=8, temperature=1.5)
    assert a == b and a != c
    assert all(len(draws) == 3 for draws in a)
    assert len({d for draws in a for d in draws}) > len(sources)  # the draws differ, not n copies
    hyps = translator.translate_hypotheses(sources[:3], sample=True, nbest=3, seed=7, temperature=1.5)
    assert all(h[i].score >= h[i + 1].score for h in hyps for i in range(len(h) - 1))  # best first


def test_sampling_logprob_is_the_models(translator, sources):
    """A drawn hypothesis' logprob equals the teacher-forced log-probability of its tokens (+ EOS)."""
    from aiayn.search import score_tokens

    src, mask = _src(translator, sources[:4])
    d = translator.cfg.decode
    drawn = sample_search(translator.model, src, mask, spec=spec_of(nbest=1, seed=3, max_len_a=d.max_len_a,
                                                                    max_len_b=d.max_len_b))
    spec = spec_of(alpha=d.alpha, length_penalty=d.length_penalty, max_len_a=d.max_len_a, max_len_b=d.max_len_b)
    again = score_tokens(translator.model, src, mask, [h[0].tokens for h in drawn], spec)
    for h, r in zip(drawn, again):
        assert h[0].logprob == pytest.approx(r.logprob, abs=1e-4)
        assert h[0].score == pytest.approx(r.score, abs=1e-4)


# Streaming ------------------------------------------------------------------------------------------------


def test_the_stream_writes_each_chunk_before_reading_the_next(translator, sources):
    read: list[int] = []

    def lines():
        for i, s in enumerate(sources):
            read.append(i)
            yield s

    writes: list[tuple[int, str]] = []
    opts = translator.options(beam=2)
    stats = translate_stream(translator, lines(), lambda s: writes.append((len(read), s)), opts, "text", chunk=3)
    assert stats.lines == len(sources)
    assert [n for n, _ in writes] == [3, 6, 9, 10]  # output of lines 1-3 written when 3 lines had been read
    # each chunk is one call: exactly what translating the same chunks gives
    chunks = [translator.translate(sources[i:i + 3], beam=2) for i in range(0, len(sources), 3)]
    assert "".join(s for _, s in writes) == "".join(t + "\n" for chunk in chunks for t in chunk)


def test_formats_and_plain_nbest(translator, sources):
    lines = [sources[0], "", sources[1]]
    opts = translator.options(beam=3, nbest=3)
    found = translator.search(lines, opts)
    text = "".join(format_record("text", i + 1, s, h, 3) for i, (s, h) in enumerate(zip(lines, found)))
    assert text.split("\n")[:-1] == [h.text for h in found[0]] + [""] * 3 + [h.text for h in found[2]]
    tsv = "".join(format_record("tsv", i + 1, s, h, 3) for i, (s, h) in enumerate(zip(lines, found)))
    rows = [r.split("\t") for r in tsv.splitlines()]
    assert [(r[0], r[1]) for r in rows] == [("1", "1"), ("1", "2"), ("1", "3"), ("3", "1"), ("3", "2"), ("3", "3")]
    assert [r[4] for r in rows] == [h.text for h in found[0] + found[2]]
    nan = Translation("x", float("nan"), float("-inf"), ["x"], [9])
    rec = json.loads(format_record("json", 1, "s", [nan], 1))  # never NaN in JSON
    assert rec["hyps"][0]["score"] is None and rec["hyps"][0]["logprob"] is None


def test_cli_nbest_plain_text_is_n_lines_per_input(tiny_run, translator, sources, tmp_path):
    inp, out = tmp_path / "in.txt", tmp_path / "out.txt"
    inp.write_text(sources[0] + "\n\n" + sources[1] + "\n", encoding="utf-8")
    assert cli.main(["translate", str(tiny_run), "--input", str(inp), "--output", str(out), "--beam", "2",
                     "--nbest", "2", "--chunk", "1", "--device", "cpu"]) == 0
    got = out.read_text(encoding="utf-8").split("\n")[:-1]
    want = translator.translate([sources[0], "", sources[1]], beam=2, nbest=2)
    assert got == want[0] + ["", ""] + want[2]


def test_iter_lines_reads_bytes_and_names_a_bad_line():
    assert list(iter_lines(io.BytesIO("\ufeffa\r\nb\n\nc".encode()))) == ["a", "b", "", "c"]
    with pytest.raises(DataError, match=r"<stdin>: line 2: not valid UTF-8 \(byte 0xff at column 2\)"):
        list(iter_lines(io.BytesIO(b"ok\nx\xffy\n")))


def test_a_failed_stream_leaves_the_output_file_as_it_was(tiny_run, tmp_path, capsys):
    inp, out = tmp_path / "in.txt", tmp_path / "out.txt"
    inp.write_bytes(b"alpha bravo\n" * 3 + b"bad \xff byte\n")
    out.write_text("precious\n", encoding="utf-8")
    assert cli.main(["translate", str(tiny_run), "--input", str(inp), "--output", str(out), "--chunk", "1",
                     "--device", "cpu"]) == 2
    assert "line 4: not valid UTF-8" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == "precious\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def _fifo(path, data: bytes):
    """A named pipe at ``path`` (as bash's ``<(...)`` gives) that a thread fills with ``data`` once it is opened:
    it can be read once, and reading ahead consumes it."""
    import os
    import threading

    os.mkfifo(path)

    def feed() -> None:
        with open(path, "wb") as f:
            f.write(data)

    threading.Thread(target=feed, daemon=True).start()
    return path


@pytest.mark.skipif(sys.platform == "win32", reason="named pipes: POSIX")
def test_a_pipe_is_input_like_a_file(tiny_run, translator, sources, tmp_path, caplog):
    """``--input <(zcat corpus.gz)`` was "/dev/fd/63: no such file" (only regular files passed), and with --progress
    the line count read the pipe ahead, leaving nothing to translate; ``evaluate --src/--ref`` pipes read as "no
    lines" (the gzip sniff opened the pipe once more). A pipe is read once, as it comes."""
    import gzip
    import logging

    from aiayn.data.corpus import read_lines

    caplog.set_level(logging.INFO, logger="aiayn")
    text = (sources[0] + "\n" + sources[1] + "\n").encode()
    out = tmp_path / "out.txt"
    assert cli.main(["translate", str(tiny_run), "--input", str(_fifo(tmp_path / "in", text)), "--output", str(out),
                     "--progress", "--device", "cpu"]) == 0
    assert out.read_text(encoding="utf-8").splitlines() == translator.translate(sources[:2])
    assert "translate: 2 lines in " in caplog.text  # the progress counted them as they came
    assert read_lines(_fifo(tmp_path / "gz", gzip.compress(text))) == sources[:2]
    assert read_lines(_fifo(tmp_path / "plain", text)) == sources[:2]


def test_closed_stdin_is_one_line(tiny_run):
    r = subprocess.run([sys.executable, "-m", "aiayn", "translate", str(tiny_run), "--device", "cpu"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == ""  # an empty input gives an empty output
    r = subprocess.run(f"{sys.executable} -m aiayn translate {tiny_run} --device cpu <&-", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "aiayn: error: no input: standard input is closed (give --input FILE)"]


# aiayn.load -----------------------------------------------------------------------------------------------


def test_load_resolves_auto_to_cpu_here_and_moves(tiny_run):
    tr = aiayn.load(tiny_run)
    assert isinstance(tr, Translator) and tr.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert tr.to("cpu").device.type == "cpu"
    with pytest.raises(aiayn.errors.DeviceError, match="device 'cuda'"):
        if not torch.cuda.is_available():
            tr.to("cuda")
        else:  # pragma: no cover - a GPU machine: check an index that cannot exist instead
            tr.to("cuda:99")


def test_load_takes_the_weights_by_name_by_file_or_as_tensors(tiny_run, lm_run, capsys):
    """aiayn.load is the one public loader, and it takes ``weights`` as `aiayn evaluate --weights` names them
    (issue 72 point 4e): the last checkpoint by name equals it by file and as tensors; a bad name is one line."""
    from safetensors.torch import load_file

    from aiayn.errors import CheckpointError
    from aiayn.run.weights import checkpoint_paths, list_checkpoints

    last = checkpoint_paths(tiny_run, list_checkpoints(tiny_run)[-1])[0]
    by_name = aiayn.load(tiny_run, "cpu", weights="last").model.state_dict()
    for other in (last, str(last), load_file(last)):
        got = aiayn.load(tiny_run, "cpu", weights=other).model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in by_name.items())
    default = aiayn.load(tiny_run, "cpu").model.state_dict()
    model = aiayn.load(tiny_run, "cpu", weights="model").model.state_dict()
    assert all(torch.equal(default[k], v) for k, v in model.items())
    with pytest.raises(CheckpointError, match=r"^--weights newest: expected one of model, last") as e:
        aiayn.load(tiny_run, "cpu", weights="newest")
    assert "\n" not in str(e.value)
    assert not hasattr(aiayn.decode, "load") and not hasattr(aiayn.decode.translator, "load")  # one public load
    r = cli.main(["translate", str(lm_run), "--device", "cpu"])  # the commands that translate refuse an LM run
    assert r == 2 and "is a language-model run: load it with aiayn.load()" in capsys.readouterr().err


def test_translate_takes_any_iterable_of_strings_and_names_what_is_not_one(translator, sources):
    """A generator was read twice (IndexError: list assignment index out of range), and bytes, None or a number
    were AttributeErrors from inside the tokenizer. Any iterable of strings is read once; anything else is one
    TypeError naming the item."""
    want = translator.translate(sources[:3])
    assert translator.translate(s for s in sources[:3]) == want
    assert translator.translate(tuple(sources[:3])) == want
    assert [h[0].text for h in translator.translate_hypotheses(iter(sources[:3]))] == want
    for bad, message in [(None, r"^texts: expected a list \(or any iterable\) of strings, got NoneType$"),
                         (b"a b", r"^texts: expected .* got bytes$"),
                         ([sources[0], None], r"^texts\[1\]: expected a string, got NoneType$"),
                         ([b"a b"], r"^texts\[0\]: expected a string, got bytes \(decode bytes to str first\)$"),
                         ([["a"]], r"^texts\[0\]: expected a string, got list$"), ([1], r"got int$")]:
        with pytest.raises(TypeError, match=message):
            translator.translate(bad)
    with pytest.raises(TypeError, match=r"^options: expected a DecodeOptions \(or None\), got str; single options "):
        translator.translate(sources[:1], "beam=4")


def test_unwritable_outputs_fail_before_any_decoding(tiny_run, tmp_path, capsys, monkeypatch):
    import shutil

    from aiayn.decode import translator as tr_mod

    calls = []
    real = tr_mod.decode_ids
    monkeypatch.setattr(tr_mod, "decode_ids", lambda *a, **k: calls.append(1) or real(*a, **k))
    inp = tmp_path / "in.txt"
    inp.write_text("alpha bravo\n", encoding="utf-8")
    (tmp_path / "adir").mkdir()
    assert cli.main(["translate", str(tiny_run), "--input", str(inp), "--output", str(tmp_path / "adir"),
                     "--device", "cpu"]) == 2
    assert "adir: is a directory" in capsys.readouterr().err
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    shutil.rmtree(run / "eval", ignore_errors=True)
    (run / "eval").write_text("not a directory")  # RUN/eval cannot be created: the evaluation has nowhere to go
    assert cli.main(["evaluate", str(run), "--split", "test", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval is a file, not a directory" in err[0]  # the output guard says so first
    assert calls == []  # nothing was decoded


def test_a_line_without_end_is_one_line_not_all_memory(tiny_run, capsys):
    """``--input /dev/zero`` read one endless line until memory ran out (then said "lower data.max_tokens")."""
    with pytest.raises(DataError, match=r"x: line 2: longer than 8 characters"):
        list(iter_lines(io.BytesIO(b"ok\n" + b"\0" * 100), "x", max_line=8))
    assert list(iter_lines(io.StringIO("12345678\nab"), max_line=8)) == ["12345678", "ab"]
    assert cli.main(["translate", str(tiny_run), "--input", "/dev/zero", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/dev/zero: line 1: longer than" in err[0], err
