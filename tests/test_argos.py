"""``aiayn export argos RUN OUT.argosmodel``: the real ``argostranslate`` installs the package from the file and
translates with it offline (every connection refused), as ``aiayn translate`` does with Argos' decoding settings;
the packaged sentence splitter (MiniSBD's format, run by the real ``minisbd``) splits where the rule says."""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path

import pytest

argostranslate = pytest.importorskip("argostranslate")
pytest.importorskip("minisbd")
pytest.importorskip("ctranslate2")

from conftest import PAIRS  # noqa: E402  (tests/ is on sys.path under pytest)

from aiayn import cli, load  # noqa: E402
from aiayn.config import ConfigError  # noqa: E402
from aiayn.interop.argos import ARGOS_FLAGS, ARGOS_SEARCH, export_argos  # noqa: E402
from aiayn.interop.sentence_splitter import sentence_splitter_onnx  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Scores (length-penalized log-probabilities) this far apart never swap between two implementations: their float
# sums differ by ~1e-6 of a score (conftest.TIE is 1e-4).
MARGIN = 1e-2

def argos_translate(package_file: Path, lines: list[str], home: Path, src: str = "en", tgt: str = "de") -> dict:
    """argostranslate in a fresh process, offline, with empty Argos directories (benchmarks.argos_agreement),
    computing in float32 as aiayn (Argos' default "auto" quantizes to int8 on most CPUs)."""
    from benchmarks.argos_agreement import argos_translate as run

    return run(package_file, lines, home, src, tgt, compute_type="float32")


@pytest.fixture(scope="module")
def package(learned_run, tmp_path_factory) -> Path:
    return export_argos(learned_run, tmp_path_factory.mktemp("argos") / "en_de.argosmodel")


def test_package_layout(learned_run, package):
    with zipfile.ZipFile(package) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names}
        assert top == {"translate-en_de-1_0"}  # one directory, as argospm's packages
        meta = json.loads(z.read("translate-en_de-1_0/metadata.json"))
        assert meta["from_code"] == "en" and meta["to_code"] == "de" and meta["type"] == "translate"
        assert meta["from_name"] == "English" and meta["to_name"] == "German"
        assert meta["package_version"] == "1.0" and meta["argos_version"]
        sp_model = (learned_run / "tokenizer" / "shared.model").read_bytes()
        assert z.read("translate-en_de-1_0/sentencepiece.model") == sp_model
        assert z.read("translate-en_de-1_0/minisbd/en.onnx") == sentence_splitter_onnx("en")
        assert {"translate-en_de-1_0/model/model.bin", "translate-en_de-1_0/model/config.json",
                "translate-en_de-1_0/README.md"} <= set(names)
        readme = z.read("translate-en_de-1_0/README.md").decode()
    assert "install_from_path('en_de.argosmodel')" in readme and learned_run.name in readme
    assert "- Languages: English (en) -> German (de)" in readme and "- BLEU: not measured" in readme
    assert "- Training: " in readme and "- License: not set by aiayn" in readme
    assert f"aiayn translate RUN {ARGOS_FLAGS}" in readme
    assert str(learned_run.resolve().parent) not in readme  # no path of this machine goes into the package


def test_argostranslate_installs_and_translates_offline_as_aiayn(learned_run, package, tmp_path):
    """Argos' translation of each sentence is aiayn's with Argos' settings, and a paragraph of several sentences
    is split by the packaged splitter and translated sentence by sentence, as aiayn translates each."""
    sources = [src for src, _ in PAIRS]
    paragraphs = [" ".join(sources[i:i + 3]) for i in range(0, len(sources), 3)]
    got = argos_translate(package, sources + paragraphs, tmp_path)
    assert got["installed"] == ["de", "en"]
    translator = load(learned_run, "cpu")
    # Argos' search: beam 4, CTranslate2's length penalty 0.2 (|Y|^0.2), its early stop (done once 4 hypotheses
    # have ended: stop "first"), no EOS first, at most 256 tokens. With "hf" instead, a model trained on another
    # CPU (simulated: AIAYN_TEST_ROUNDING) gave "Wo ist der Bahnhof?" where Argos stopped at "W ist der Bahnhof?".
    ours = translator.translate(sources, **ARGOS_SEARCH)
    # Exact text is a fair demand here by construction: the model knows these sentences by heart, so each best
    # hypothesis beats the runner-up by far more than another float summation order (CTranslate2's) can move it.
    for hyps in translator.translate_hypotheses(sources, **{**ARGOS_SEARCH, "nbest": 2}):
        assert hyps[0].score - hyps[1].score > MARGIN, [(h.text, h.score) for h in hyps]
    assert got["out"][:len(sources)] == ours
    assert sum(a == tgt for a, (_, tgt) in zip(ours, PAIRS)) >= len(PAIRS) - 2  # it has learned them
    assert got["out"][len(sources):] == [" ".join(ours[i:i + 3]) for i in range(0, len(ours), 3)]


def test_sentence_splitter_splits_as_the_rule_says():
    from minisbd import SBDetect

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "en.onnx"
        path.write_bytes(sentence_splitter_onnx("en"))
        sbd = SBDetect(str(path), use_gpu=False)
        from test_sentence_split import CASES  # the rule's cases, which split_sentences passes too

        cases = {text: want for text, want in CASES.items() if text.strip()}  # MiniSBD is given no empty paragraph
        cases["Ein Satz.\n\nEin Absatz."] = ["Ein Satz.", "Ein Absatz."]
        for text, want in cases.items():
            assert sbd.sentences(text) == want, text


def test_export_argos_refusals_and_cli(tiny_run, package, tmp_path, capsys):
    with pytest.raises(ConfigError, match="already exists"):
        export_argos(tiny_run, package)
    with pytest.raises(ConfigError, match=r"ends in \.argosmodel"):
        export_argos(tiny_run, tmp_path / "model.zip")
    with pytest.raises(ConfigError, match="not a MiniSBD .onnx"):
        export_argos(tiny_run, tmp_path / "x.argosmodel", sentence_model=tmp_path / "missing.onnx")
    with pytest.raises(ConfigError, match="not a valid quantization"):
        export_argos(tiny_run, tmp_path / "x.argosmodel", quantization="int3")
    assert list(tmp_path.iterdir()) == []  # nothing left behind by a refusal
    assert cli.main(["export", "argos", str(tiny_run), str(tmp_path / "y.argosmodel"), "--sentence-model",
                     str(tmp_path / "missing.onnx")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert cli.main(["export", "hf", str(tiny_run), str(tmp_path / "h"), "--sentence-model", "x.onnx"]) == 2
    assert "--sentence-model is for Argos" in capsys.readouterr().err
    # a trained MiniSBD model given by the user is packaged as given; int8 as Argos' own packages
    mine = tmp_path / "mine.onnx"
    mine.write_bytes(sentence_splitter_onnx("en"))
    out = tmp_path / "int8.argosmodel"
    assert cli.main(["export", "argos", str(tiny_run), str(out), "--quantization", "int8",
                     "--sentence-model", str(mine)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    with zipfile.ZipFile(out) as z:
        assert "translate-en_de-1_0/minisbd/mine.onnx" in z.namelist()
        assert "translate-en_de-1_0/minisbd/en.onnx" not in z.namelist()


def test_agreement_benchmark_reports_both_decoders(learned_run, tmp_path, capsys):
    """``python -m benchmarks.argos_agreement`` (its numbers in BENCHMARKS.md) on the learned run's validation."""
    from benchmarks import argos_agreement

    out = tmp_path / "agreement.json"
    assert argos_agreement.main([str(learned_run), "--split", "valid", "--out-json", str(out)]) == 0
    rows = {r["decoder"]: r for r in json.loads(out.read_text())["rows"]}
    fp32 = rows["argos, ARGOS_COMPUTE_TYPE=float32"]
    assert fp32["identical_to_argos"] == fp32["lines"] == len(PAIRS)
    assert rows["aiayn, Argos' settings"]["identical_to_argos"] == len(PAIRS)
    assert rows["aiayn, Argos' settings"]["bleu"] == fp32["bleu"] > 50
    assert rows["argos, its default (auto)"]["lines"] == len(PAIRS)
    assert "identical to Argos" in capsys.readouterr().out
