"""The Python reading of the sentence splitter that ``aiayn export argos`` ships (what ``aiayn serve``'s
LibreTranslate routes and ``aiayn translate --split-sentences`` split with) splits exactly as the real MiniSBD does
with the packaged ONNX model: on the rule's cases, on random texts of marks, quotes and white space, and on
paragraphs longer than MiniSBD's 1,000-unit window."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from aiayn.interop.sentence_splitter import sentence_splitter_onnx, split_sentences

CASES = {
    "Hello world. This is a test! Is it? Yes.": ["Hello world.", "This is a test!", "Is it?", "Yes."],
    'He said "Hi." Then he left.': ['He said "Hi."', "Then he left."],
    "Pi is 3.14 today. 42 is next.": ["Pi is 3.14 today.", "42 is next."],
    "See e.g. this one. Done": ["See e.g. this one.", "Done"],
    "Wait... Really?! Yes": ["Wait...", "Really?!", "Yes"],
    "Dr. Smith came.": ["Dr.", "Smith came."],  # no list of abbreviations: a trained model knows them
    "你好。再见！": ["你好。", "再见！"],
    "one sentence without a mark": ["one sentence without a mark"],
    "  spaces around. And\tinside.  ": ["spaces around.", "And\tinside."],
    "A man rides a bicycle. Two dogs play in the snow.": ["A man rides a bicycle.", "Two dogs play in the snow."],
    "it ends. lower case goes on": ["it ends. lower case goes on"],
    "": [],
    "   ": [],
}


def test_split_sentences_cases():
    for text, want in CASES.items():
        assert split_sentences(text) == want, text


def _random_texts() -> list[str]:
    rng = random.Random(0)
    chars = list("ab Cd. ! ? \" ' ) ( 3 。 … é Ж\t» ") + ["Dr.", " x", "ß", "日"]
    words = "A man rides a bicycle . Two dogs play in the snow ! Is it ? \" Hi . \" Dr. Smith 3.14 e.g. 。 x".split()
    short = ["".join(rng.choice(chars) for _ in range(rng.randint(1, 30))) for _ in range(600)]
    long = [" ".join(rng.choice(words) for _ in range(rng.randint(300, 600))) for _ in range(12)]
    return short + long


def test_split_sentences_equals_minisbd_with_the_packaged_model(tmp_path: Path):
    minisbd = pytest.importorskip("minisbd")
    path = tmp_path / "en.onnx"
    path.write_bytes(sentence_splitter_onnx("en"))
    sbd = minisbd.SBDetect(str(path), use_gpu=False)
    texts = list(CASES) + _random_texts()
    assert any(len(t) > 1000 for t in texts)  # MiniSBD's windows are covered
    for text in texts:
        if text.strip():  # MiniSBD is not asked about empty paragraphs (Argos translates them as empty)
            assert split_sentences(text) == sbd.sentences(text), text


def test_translate_split_sentences_translates_each_sentence_and_joins_as_argos(tiny_run, tmp_path: Path, capsys):
    from aiayn import cli, load
    from aiayn.interop.sentence_splitter import argos_join

    lines = ["A b c d. B a d! Is c a b?", "", "c d a b", "d c. A b."]
    src = tmp_path / "in.txt"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tr = load(tiny_run, "cpu")
    want = [argos_join([[h[0].text for h in tr.search(split_sentences(line), tr.options(), scores=False)]])
            if line else "" for line in lines]
    assert cli.main(["translate", str(tiny_run), "--input", str(src), "--split-sentences", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines() == want
    assert cli.main(["translate", str(tiny_run), "--input", str(src), "--split-sentences", "--device", "cpu",
                     "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["hyps"][0]["text"] if r["hyps"] else "" for r in records] == want
    # a joined hypothesis' score is its sentences' summed
    first = tr.search(split_sentences(lines[0]), tr.options(), scores=True)
    assert abs(records[0]["hyps"][0]["score"] - sum(h[0].score for h in first)) < 1e-4
