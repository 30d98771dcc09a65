"""Metrics are thin wrappers over sacreBLEU / sacremoses / rouge-score (checked against direct calls and
hand examples), and ``aiayn evaluate`` writes eval/<name>.json + .hyp that agree with the translator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from aiayn import cli, load
from aiayn.data.synthetic import reverse_split
from aiayn.eval.scorers import (
    bleu_lc_tok,
    lowercase_moses,
    perplexity,
    rouge_scores,
    sacrebleu_scores,
)
from aiayn.train.parallel import Dist
from aiayn.train.validation import validation_bleu_fn

HYPS = ["Ein Hund läuft über die Wiese.", "Zwei Männer sprechen miteinander.", "Eine Frau liest ein Buch."]
REFS = ["Ein Hund rennt über die Wiese.", "Zwei Männer reden miteinander.", "Eine Frau liest eine Zeitung."]


pytestmark = pytest.mark.usefixtures("one_thread")


# Metrics -----------------------------------------------------------------------------------------------


def test_sacrebleu_scores_equal_direct_sacrebleu():
    got = sacrebleu_scores(HYPS, REFS)
    assert got["bleu"] == sacrebleu.corpus_bleu(HYPS, [REFS]).score
    assert got["chrf"] == sacrebleu.corpus_chrf(HYPS, [REFS]).score
    assert 0 < got["bleu"] < 100
    assert "tok:13a" in got["bleu_signature"] and "case:mixed" in got["bleu_signature"]
    assert got["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0")
    with pytest.raises(ValueError, match="2 hypotheses but 3 references"):
        sacrebleu_scores(HYPS[:2], REFS)


def test_bleu_lc_tok_ignores_case_and_tokenization():
    # sacreBLEU (cased, 13a) sees a difference; the lowercased Moses-tokenized BLEU of Multi30k papers does not.
    assert sacrebleu.corpus_bleu(["Ein Hund läuft."], [["ein hund läuft ."]]).score < 50
    score, desc, detail = bleu_lc_tok(["Ein Hund läuft."], ["ein hund läuft ."], "de")
    assert score == pytest.approx(100.0)
    assert "lowercased" in desc and "Moses" in desc and "tok:none" in desc and "lang=de" in desc
    assert detail.startswith("BLEU = 100.00 100.0/100.0/100.0/100.0 (BP = 1.000 ratio = 1.000 hyp_len = 4 ref_len = 4")
    assert lowercase_moses(['Der Hund "Rex" läuft.'], "de") == ['der hund " rex " läuft .']
    # on tokenized lowercase input it is sacreBLEU with tokenize='none'
    lc = lowercase_moses(HYPS, "de"), lowercase_moses(REFS, "de")
    assert bleu_lc_tok(HYPS, REFS, "de")[0] == sacrebleu.corpus_bleu(lc[0], [lc[1]], tokenize="none").score


def test_rouge_hand_example():
    # Porter stemming: cats -> cat, running/runs -> run. hyp "the cat are run", ref "the cat run":
    # unigrams P 3/4, R 3/3 -> F1 6/7; bigrams {the cat, cat are, are run} vs {the cat, cat run}: F1 0.4;
    # LCS "the cat run" = 3 -> same as ROUGE-1.
    got = rouge_scores(["the cats are running"], ["the cat runs"])
    assert got["rouge1"] == pytest.approx(600 / 7)
    assert got["rouge2"] == pytest.approx(40.0)
    assert got["rougeL"] == pytest.approx(600 / 7)
    two = rouge_scores(["the cats are running", "a b"], ["the cat runs", "a b"])  # mean over pairs
    assert two["rouge2"] == pytest.approx((40.0 + 100.0) / 2)


def test_perplexity():
    assert perplexity(math.log(10.0)) == pytest.approx(10.0)
    assert perplexity(0.0) == 1.0
    assert perplexity(1e6) == math.inf


def test_validation_bleu_fn_equals_greedy_translation(tiny_run):
    translator = load(tiny_run)
    tok = translator.tokenizers
    pairs = reverse_split("valid")[:20]
    data = SimpleNamespace(valid_src=[tok.src.encode(s) for s, _ in pairs],
                           valid_tgt=[tok.tgt.encode(t) for _, t in pairs])
    fn = validation_bleu_fn(translator.cfg, data, tok)
    model = translator.model.train()  # the trainer calls it between updates
    got = fn(model)
    assert model.training  # mode restored
    model.eval()
    hyps = translator.translate([s for s, _ in pairs], beam=1)
    assert got == {"valid_bleu": sacrebleu.corpus_bleu(hyps, [[t for _, t in pairs]]).score}


def _bleu_on_rank(rank: int, world: int, init_file: str, run: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        translator = load(run)
        tok = translator.tokenizers
        pairs = reverse_split("valid")[:23]  # not a multiple of the world: the shares differ in size
        data = SimpleNamespace(valid_src=[tok.src.encode(s) for s, _ in pairs],
                               valid_tgt=[tok.tgt.encode(t) for _, t in pairs])
        got = validation_bleu_fn(translator.cfg, data, tok)(translator.model, Dist(rank=rank, world=world))
        Path(f"{out}.{rank}").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_validation_bleu_is_shared_out_over_processes_and_equals_one_process(tiny_run, tmp_path):
    torch.multiprocessing.spawn(_bleu_on_rank, args=(2, str(tmp_path / "init"), str(tiny_run), str(tmp_path / "bleu")),
                                nprocs=2, join=True)
    translator = load(tiny_run)
    tok = translator.tokenizers
    pairs = reverse_split("valid")[:23]
    data = SimpleNamespace(valid_src=[tok.src.encode(s) for s, _ in pairs],
                           valid_tgt=[tok.tgt.encode(t) for _, t in pairs])
    one = validation_bleu_fn(translator.cfg, data, tok)(translator.model)
    for rank in (0, 1):  # every process gets the score of all the sentences
        assert json.loads((tmp_path / f"bleu.{rank}").read_text()) == one


# aiayn evaluate ----------------------------------------------------------------------------------------


def test_evaluate_src_ref_writes_json_and_hyp(tiny_run, tmp_path, capsys):
    pairs = reverse_split("test")[:15]
    src, ref = tmp_path / "small.en", tmp_path / "small.de"
    src.write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    ref.write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    argv = ["evaluate", str(tiny_run), "--src", str(src), "--ref", str(ref), "--beam", "2", "--alpha", "1.0",
            "--length-penalty", "power"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "BLEU" in out and "chrF" in out and "tok:13a" in out and "lc-tok" in out
    result = json.loads((tiny_run / "eval" / "small.json").read_text(encoding="utf-8"))
    hyps = (tiny_run / "eval" / "small.hyp").read_text(encoding="utf-8").split("\n")
    assert hyps[-1] == "" and len(hyps[:-1]) == len(pairs) == result["n_sentences"]
    hyps = hyps[:-1]
    translator = load(tiny_run)
    assert hyps == translator.translate([s for s, _ in pairs], beam=2, alpha=1.0, length_penalty="power")
    refs = [t for _, t in pairs]
    direct = sacrebleu_scores(hyps, refs)
    assert result["scores"]["bleu"] == pytest.approx(direct["bleu"], abs=1e-4)
    assert result["scores"]["chrf"] == pytest.approx(direct["chrf"], abs=1e-4)
    lc = bleu_lc_tok(hyps, refs, "de")
    assert result["scores"]["bleu_lc_tok"] == pytest.approx(lc.score, abs=1e-4)
    assert result["bleu_lc_tok_detail"] == lc.detail
    assert result["signatures"]["bleu"] == direct["bleu_signature"]
    assert result["signatures"]["chrf"] == direct["chrf_signature"]
    assert "Moses" in result["signatures"]["bleu_lc_tok"]
    d = result["decode"]
    assert (d["beam"], d["alpha"], d["length_penalty"]) == (2, 1.0, "power")
    assert d["max_len_b"] == translator.cfg.decode.max_len_b
    assert result["run"]["weights"] == "model.safetensors" and "last step" in result["run"]["weights_source"]
    assert result["data"] == {"src": str(src), "ref": str(ref)}
    assert result["truncated_lines"] == []
    # The time is a finite number of seconds, and the one the terminal summary shows.
    assert isinstance(result["wall_s"], float) and math.isfinite(result["wall_s"])
    assert f"({d['length_penalty']}), {result['wall_s']:.1f} s" in out


def test_evaluate_split(tiny_run, capsys):
    assert cli.main(["evaluate", str(tiny_run), "--split", "test", "--beam", "1", "--name", "test_greedy"]) == 0
    assert "test_greedy: 300 sentences" in capsys.readouterr().out
    result = json.loads((tiny_run / "eval" / "test_greedy.json").read_text(encoding="utf-8"))
    hyps = (tiny_run / "eval" / "test_greedy.hyp").read_text(encoding="utf-8").splitlines()
    pairs = reverse_split("test")
    assert result["n_sentences"] == len(hyps) == len(pairs) == 300
    assert result["data"] == {"split": "test", "dataset": "reverse"}
    assert result["scores"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [[t for _, t in pairs]]).score,
                                                     abs=1e-4)


def test_evaluate_int8_writes_beside_fp32(tiny_run, capsys):
    """--precision int8 keeps its record apart from fp32's of the same split, and says it is int8."""
    assert cli.main(["evaluate", str(tiny_run), "--split", "test", "--beam", "1", "--precision", "int8"]) == 0
    assert "test.int8: 300 sentences" in capsys.readouterr().out
    result = json.loads((tiny_run / "eval" / "test.int8.json").read_text(encoding="utf-8"))
    assert result["decode"]["precision"] == "int8" and result["n_sentences"] == 300


@pytest.mark.parametrize("argv, message", [
    (["--split", "test", "--src", "{tmp}/a"], "either --split NAME or --src FILE --ref FILE"),
    ([], "either --split NAME or --src FILE --ref FILE"),
    (["--src", "{tmp}/a"], "--src and --ref go together"),
    (["--src", "{tmp}/a", "--ref", "{tmp}/b3"], "a has 1 line, "),
    (["--src", "{tmp}/missing", "--ref", "{tmp}/b3"], "missing: no such file"),
    (["--split", "nope"], "no split 'nope'"),
    (["--split", "test", "--name", "../x"], "plain file name"),
])
def test_evaluate_bad_input_exits_2_with_one_line(tiny_run, tmp_path, capsys, argv, message):
    (tmp_path / "a").write_text("alpha bravo\n")
    (tmp_path / "b3").write_text("x\ny\nz\n")
    argv = ["evaluate", str(tiny_run)] + [a.format(tmp=tmp_path) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aiayn: error:") and message in err[0], err


def test_evaluate_missing_run(tmp_path, capsys):
    assert cli.main(["evaluate", str(tmp_path / "nope"), "--split", "test"]) == 2
    assert "no such run directory" in capsys.readouterr().err


# Language models: perplexity ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A char-level LM trained 5 updates on a small text file (about 2 s)."""
    from aiayn.config import config_from_dict
    from aiayn.data.synthetic import reverse_pairs
    from aiayn.train.run import train

    root = tmp_path_factory.mktemp("lm")
    (root / "text.txt").write_text("".join(s + "\n" for s, _ in reverse_pairs(300, seed=5)), encoding="utf-8")
    cfg = config_from_dict({
        "task": "lm",
        "model": {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_decoder_layers": 1, "dropout": 0.0, "max_positions": 32},
        "data": {"train_src": str(root / "text.txt"), "tokenizer": "char", "block_size": 16, "batch_size": 8,
                 "valid_fraction": 0.2},
        "train": {"max_updates": 5, "warmup": 2, "eval_every": 5, "save_every": 5, "log_every": 5},
    })
    train(cfg, root / "run", progress=False)
    return root


def test_lm_perplexity_on_the_validation_text(lm_run, capsys):
    from aiayn.run.directory import load_run

    assert cli.main(["evaluate", str(lm_run / "run")]) == 0
    assert "perplexity" in capsys.readouterr().out
    result = json.loads((lm_run / "run" / "eval" / "valid.json").read_text(encoding="utf-8"))
    # Recompute independently: the last 20% of the text, non-overlapping blocks of 16 predicted tokens.
    run = load_run(lm_run / "run")
    text = (lm_run / "text.txt").read_text(encoding="utf-8")
    ids = torch.tensor(run.tokenizers.src.encode(text[int(len(text) * 0.8):]))
    n = (ids.numel() - 1) // 16
    blocks = torch.stack([ids[i * 16 : i * 16 + 17] for i in range(n)])
    with torch.no_grad():
        logits = run.model(blocks[:, :-1])
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), blocks[:, 1:].reshape(-1)).item()
    assert result["task"] == "lm" and result["data"]["n_tokens"] == n * 16
    assert result["scores"]["nll_per_token"] == pytest.approx(nll, abs=1e-5)
    assert result["scores"]["ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert cli.main(["evaluate", str(lm_run / "run"), "--split", "test"]) == 2


def test_translator_validation_bleu_and_explorer_decode_alike_ban_pad_included(tiny_run):
    """The three consumers of the id-level decoding (aiayn translate, training's validation BLEU, the attention
    explorer) go through search.decode_ids: with decode.ban_pad on a model whose pad logit would win every
    step, all three give the same non-pad greedy output."""
    import dataclasses

    from aiayn.decode.translator import Translator
    from aiayn.run.directory import Run, load_run
    from aiayn.search import SearchSpec, greedy_search
    from aiayn.viz.attention import attention_data

    run = load_run(tiny_run, device="cpu")
    pad = run.tokenizers.specials.pad
    bias = torch.zeros(run.model.decoder.output_proj.weight.size(0))
    bias[pad] = 100.0  # without the ban, pad wins every step
    run.model.decoder.output_bias = torch.nn.Parameter(bias)
    cfg = dataclasses.replace(run.cfg, decode=run.cfg.decode.replace(ban_pad=True))
    tok = run.tokenizers
    pairs = reverse_split("valid")[:8]
    src = torch.tensor([tok.src.encode(pairs[0][0]) + [tok.specials.eos]])
    unbanned = greedy_search(run.model, src, spec=SearchSpec(cfg.decode.replace(ban_pad=False), tok.specials))[0]
    assert unbanned and set(unbanned) == {pad}  # the ban matters on this model

    translator = Translator(Run(run.path, cfg, run.model, tok))
    found = translator.translate_hypotheses([s for s, _ in pairs], beam=1)
    assert all(h[0].ids and pad not in h[0].ids for h in found)
    hyps = [h[0].text for h in found]
    data = SimpleNamespace(valid_src=[tok.src.encode(s) for s, _ in pairs],
                           valid_tgt=[tok.tgt.encode(t) for _, t in pairs])
    assert validation_bleu_fn(cfg, data, tok)(run.model) == {
        "valid_bleu": sacrebleu.corpus_bleu(hyps, [[tok.tgt.decode(t) for t in data.valid_tgt]]).score}
    shown = attention_data(Run(run.path, cfg, run.model, tok), pairs[0][0])
    assert shown.generated and shown.tgt == hyps[0]


def test_rolling_without_src_scores_the_validation_text_as_training_cut_it(lm_run, tmp_path):
    import shutil

    from aiayn.config import load_config
    from aiayn.data.corpus import read_text
    from aiayn.data.tokenizer import TokenizerPair
    from aiayn.eval.evaluate import EvalData, evaluate_run

    run = shutil.copytree(lm_run / "run", tmp_path / "run")
    cfg = load_config(run / "config.yaml")
    text = read_text(cfg.data.train_src)
    tail = text[int(len(text) * (1 - cfg.data.valid_fraction)):]
    result = evaluate_run(run, EvalData(rolling=True), device="cpu")
    assert result["data"]["split"] == "valid"
    assert result["data"]["n_tokens"] == len(TokenizerPair.load(run / "tokenizer").src.encode(tail))
