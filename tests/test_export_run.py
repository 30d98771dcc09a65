"""``aiayn export ctranslate2 RUN OUT``: a self-contained directory (model, vocabularies, tokenizer,
README) whose CTranslate2 beam search, driven by the copied SentencePiece model as the README says,
returns exactly aiayn's beam search (length_penalty='power', exact stop) on the run's test sentences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import agree_up_to_ties, same_hypotheses, spec_of  # tests/ is on sys.path under pytest

ctranslate2 = pytest.importorskip("ctranslate2")
spm = pytest.importorskip("sentencepiece")

from aiayn import cli, load  # noqa: E402
from aiayn.config import ConfigError  # noqa: E402
from aiayn.data.synthetic import reverse_split  # noqa: E402
from aiayn.interop.ctranslate2 import export_run  # noqa: E402
from aiayn.search import beam_search  # noqa: E402

EOS = 3


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    return export_run(tiny_run, tmp_path_factory.mktemp("export") / "ct2")


def test_export_is_self_contained(tiny_run, exported):
    names = {p.name for p in exported.iterdir()}
    assert {"model.bin", "config.json", "README.txt"} <= names
    for p in (tiny_run / "tokenizer").iterdir():  # tokenizer.json + shared.model, byte for byte
        assert (exported / p.name).read_bytes() == p.read_bytes()
    readme = (exported / "README.txt").read_text(encoding="utf-8")
    assert "sentencepiece" in readme and "shared.model" in readme and "patience" in readme
    assert not any(p.name.endswith((".tmp-run-export", ".tmp-export")) for p in exported.parent.iterdir())


def test_ct2_beam_equals_aiayn_beam_search(tiny_run, exported):
    translator = load(tiny_run)
    model, cfg = translator.model, translator.cfg.decode
    sp = spm.SentencePieceProcessor(model_file=str(exported / "shared.model"))  # the copied tokenizer
    ct2 = ctranslate2.Translator(str(exported), device="cpu", inter_threads=1, intra_threads=1)
    alpha = 0.6
    texts = [s for s, _ in reverse_split("test")[:8]]
    swaps = 0
    for text in texts:
        pieces = sp.encode(text, out_type=str)
        ids = translator.tokenizers.src.encode(text)
        assert [sp.piece_to_id(p) for p in pieces] == ids
        limit = int(cfg.max_len_a * (len(ids) + 1) + cfg.max_len_b)  # our max_len (source + EOS)
        r = ct2.translate_batch(
            [pieces], beam_size=4, num_hypotheses=4, length_penalty=alpha, patience=1000.0,
            return_end_token=True, max_decoding_length=limit, min_decoding_length=0, return_scores=True,
        )[0]
        spec = spec_of(beam=4, alpha=alpha, length_penalty="power", nbest=4, max_len_a=cfg.max_len_a,
                       max_len_b=cfg.max_len_b, stop="exact")
        ours = beam_search(model, torch.tensor([ids + [EOS]]), spec=spec)[0]
        theirs = [[sp.piece_to_id(p) for p in (h[:-1] if h and h[-1] == "</s>" else h)] for h in r.hypotheses]
        # the same hypotheses and scores, but for two whose scores tie (they may come in either order)
        swaps += same_hypotheses([(h.tokens, h.score) for h in ours], list(zip(theirs, r.scores)), text)
        # and through text: the README's recipe gives the Translator's output
        best = sp.decode(r.hypotheses[0][:-1] if r.hypotheses[0][-1:] == ["</s>"] else r.hypotheses[0]).strip()
        options = translator.options(alpha=alpha, length_penalty="power")
        [[mine]] = translator.search([text], options)
        if agree_up_to_ties(translator, [text], [mine.ids], theirs[:1], options) == 0:
            assert best == mine.text
    assert swaps <= len(texts) // 4


def test_export_refusals_and_cli(tiny_run, exported, tmp_path, capsys):
    with pytest.raises(ConfigError, match="already exists"):
        export_run(tiny_run, exported)
    with pytest.raises(ConfigError, match="not a valid quantization"):
        export_run(tiny_run, tmp_path / "bad", quantization="int3")
    assert not (tmp_path / "bad").exists() and list(tmp_path.iterdir()) == []
    assert cli.main(["export", "ctranslate2", str(tiny_run), str(exported)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert cli.main(["export", "ctranslate2", str(tmp_path / "no_run"), str(tmp_path / "x")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    out = tmp_path / "int8"
    assert cli.main(["export", "ctranslate2", str(tiny_run), str(out), "--quantization", "int8"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    ct2 = ctranslate2.Translator(str(out), device="cpu", compute_type="int8", inter_threads=1, intra_threads=1)
    sp = spm.SentencePieceProcessor(model_file=str(out / "shared.model"))
    r = ct2.translate_batch([sp.encode("alpha bravo charlie", out_type=str)], beam_size=2, max_decoding_length=8)
    assert len(r[0].hypotheses[0]) <= 8


def test_exports_carry_no_path_of_this_machine(tiny_run, exported, tmp_path):
    """The files an export writes are published with the model: none may hold the absolute path of the run,
    of the export or of the user's home (the model card and README name the run by its directory name)."""
    from aiayn.cli import main

    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    assert main(["export", "hf", str(tiny_run), str(hf)]) == 0
    needles = {str(tiny_run.resolve()), str(tiny_run), str(exported.resolve().parent), str(hf.resolve()),
               str(Path.home())}
    for directory in (exported, hf):
        for f in directory.iterdir():
            data = f.read_bytes()
            found = [n for n in needles if n.encode() in data]
            assert not found, (f.name, found)
    assert tiny_run.name in (hf / "README.md").read_text() and tiny_run.name in (exported / "README.txt").read_text()
