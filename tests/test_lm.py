"""Language modelling and summarization (issue 6): LM data blocks, the "document <sep> summary" format,
cached vs uncached generation, ``aiayn generate`` / ``summarize`` / ``evaluate`` on tiny runs."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import GREEDY_GAP, NO_EOS, greedy_gap, shared_data_dir, spec_of  # noqa: E402  (tests/ is on sys.path under pytest)

from aiayn import cli
from aiayn.config import config_from_dict
from aiayn.data.synthetic import WORDS, reverse_pairs
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_tokenizer

REPO = Path(__file__).resolve().parent.parent




pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matrices, one intra-op thread


def _train(cfg: dict, run_dir: Path) -> Path:
    from aiayn.train.run import train

    train(config_from_dict(cfg), run_dir, progress=False)
    return run_dir


TINY = {"d_model": 32, "n_heads": 2, "d_ff": 64, "dropout": 0.0}


@pytest.fixture(scope="module")
def text_lm(tmp_path_factory) -> Path:
    """A char LM (2 layers, context 32) trained 40 updates on word lists: enough for varied output."""
    root = tmp_path_factory.mktemp("text_lm")
    (root / "text.txt").write_text("".join(s + "\n" for s, _ in reverse_pairs(400, seed=7)), encoding="utf-8")
    return _train({
        "task": "lm",
        "model": {**TINY, "n_decoder_layers": 2, "max_positions": 32},
        "data": {"train_src": str(root / "text.txt"), "tokenizer": "char", "block_size": 32, "batch_size": 16},
        "train": {"max_updates": 40, "schedule": "constant", "lr": 3e-3, "label_smoothing": 0.0,
                  "eval_every": 40, "save_every": 40, "log_every": 20},
    }, root / "run")


def _articles(n: int, seed: int) -> list[dict]:
    """Synthetic articles: a few sentences of code words; the summary is the first sentence reversed."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6))) + "." for _ in range(rng.randint(2, 4))]
        rows.append({"document": "\n".join(sents), "summary": " ".join(reversed(sents[0][:-1].split())),
                     "id": str(i)})
    return rows


@pytest.fixture(scope="module")
def articles(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("articles")
    for name, n, seed in (("train", 200, 1), ("valid", 20, 2)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _articles(n, seed)),
                                            encoding="utf-8")
    return root


def _summary_data(articles: Path) -> dict:
    return {"train_src": str(articles / "train.jsonl"), "valid_src": str(articles / "valid.jsonl"),
            "format": "jsonl", "src_field": "document", "tgt_field": "summary", "tokenizer": "char"}


@pytest.fixture(scope="module")
def summary_lm(articles) -> Path:
    """Summarization as language modelling on the synthetic articles (char tokenizer, block 96)."""
    return _train({
        "task": "lm",
        "model": {**TINY, "n_decoder_layers": 2, "max_positions": 96},
        "data": {**_summary_data(articles), "block_size": 96, "batch_size": 16},
        "train": {"max_updates": 20, "schedule": "constant", "lr": 3e-3, "label_smoothing": 0.0,
                  "eval_every": 20, "save_every": 20, "log_every": 10},
    }, articles / "lm_run")


@pytest.fixture(scope="module")
def summary_seq2seq(articles) -> Path:
    """The encoder-decoder on the same (document, summary) JSONL pairs."""
    return _train({
        "task": "summarization",
        "model": {**TINY, "n_encoder_layers": 1, "n_decoder_layers": 1, "max_positions": 64},
        "data": {**_summary_data(articles), "max_tokens": 1024},
        "train": {"max_updates": 60, "schedule": "constant", "lr": 3e-3, "eval_every": 60, "save_every": 60,
                  "log_every": 20},
        "decode": {"beam": 2, "max_len_a": 0.0, "max_len_b": 20},
    }, articles / "s2s_run")


# LM data: nanoGPT's split, contiguous blocks ---------------------------------------------------------------


def test_lm_data_split_by_characters_and_contiguous_blocks(tmp_path):
    from aiayn.data.pipeline import build_lm_data

    text = "".join(s + "\n" for s, _ in reverse_pairs(200, seed=3))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    cfg = config_from_dict({"task": "lm", "model": {**TINY, "n_decoder_layers": 1, "max_positions": 16},
                            "data": {"train_src": str(tmp_path / "t.txt"), "tokenizer": "char", "block_size": 16,
                                     "batch_size": 4}})
    data, tok = build_lm_data(cfg, tmp_path / "run")
    tok = tok.src
    split = int(len(text) * 0.9)  # first 90% of the characters train, the last 10% validate
    assert tok.decode(data.train.read().tolist()) == text[:split]
    assert tok.decode(data.valid.read().tolist()) == text[split:]
    stream = data.train.read().tolist()
    offsets = []
    for epoch in (0, 1, 2):
        blocks = []
        for b in map(data.collate_plan, data.epoch_plan(epoch)):
            assert torch.equal(b.tgt_in[:, 1:], b.tgt_out[:, :-1]) and b.tgt_in.shape[1] == 16
            blocks += [tuple(i + o[-1:]) for i, o in zip(b.tgt_in.tolist(), b.tgt_out.tolist())]
        # the blocks are stream[o + 16k : o + 16k + 17] for one offset o: contiguous slices, consecutive
        # ones sharing one boundary token, so every target token after o is predicted exactly once
        found = [o for o in range(16) if sorted(blocks) == sorted(
            tuple(stream[s : s + 17]) for s in range(o, len(stream) - 16, 16))]
        assert found, f"epoch {epoch}: blocks are not the contiguous cut of the stream at any offset"
        offsets.append(found[0])
    assert len(set(offsets)) > 1  # block boundaries move between epochs
    # validation: fixed, non-overlapping blocks from the start of the held-out text
    vb = data.valid_batches
    first = vb[0].tgt_in[0].tolist() + [vb[0].tgt_out[0, -1].item()]
    assert first == data.valid.read(0, 17).tolist()
    assert sum(b.ntokens for b in vb) == (len(data.valid) - 1) // 16 * 16


# The "document <sep> summary" format ----------------------------------------------------------------------


def test_separator_format_char_tokenizer():
    from aiayn.data.summarization import lm_prompt, lm_sequence, separator_ids

    doc, summ, sep = "the cat sat on the mat. it was warm.", "a cat sat", " <sep> "
    tok = train_tokenizer([doc, summ, sep], kind="char")
    sep_ids = separator_ids(tok, sep)
    row = lm_sequence(tok, doc, summ, sep_ids, block_size=200)
    assert row == [BOS_ID] + tok.encode(doc + sep + summ) + [EOS_ID]
    assert tok.decode(row) == doc + sep + summ
    prompt = lm_prompt(tok, doc, sep_ids, max_len=200)
    assert row[: len(prompt)] == prompt and tok.decode(prompt) == doc + sep
    # too long: the document's end is cut, the separator and the whole summary stay
    short = lm_sequence(tok, doc, summ, sep_ids, block_size=20)
    assert len(short) == 21 and short[-1] == EOS_ID
    assert tok.decode(short) == doc[: 21 - 2 - len(sep) - len(summ)] + sep + summ
    assert lm_sequence(tok, doc, summ, sep_ids, block_size=len(sep) + len(summ)) is None  # no room for the document
    assert tok.decode(lm_prompt(tok, doc, sep_ids, max_len=12)) == doc[:4] + sep


def test_separator_format_bpe_one_piece(tmp_path):
    from aiayn.data.summarization import lm_prompt, lm_sequence, separator_ids

    texts = [" ".join(random.Random(i).choice(WORDS) for _ in range(12)) + "." for i in range(300)]
    tok = train_tokenizer(texts, kind="bpe", vocab_size=400, user_defined_symbols=["<sep>"])
    assert "<sep>" in tok.pieces("alpha bravo. <sep> charlie")  # one piece, never split
    doc, summ, sep = "alpha bravo charlie. delta echo.", "echo delta", " <sep> "
    sep_ids = separator_ids(tok, sep)
    row = lm_sequence(tok, doc, summ, sep_ids, block_size=100)
    # encoding the parts apart gives the ids of the whole text: the format is doc + sep + summary + EOS
    assert row == [BOS_ID] + tok.encode(doc + sep + summ) + [EOS_ID]
    assert tok.decode(row) == doc + sep + summ
    prompt = lm_prompt(tok, doc, sep_ids, max_len=100)
    assert row[: len(prompt)] == prompt


def test_summary_lm_rows_one_article_each(articles, tmp_path):
    from aiayn.data.pipeline import build_data
    from aiayn.data.summarization import collapse_whitespace

    cfg = config_from_dict({"task": "lm", "model": {**TINY, "n_decoder_layers": 1, "max_positions": 40},
                            "data": {**_summary_data(articles), "block_size": 40, "batch_size": 8}})
    data, tok = build_data(cfg, tmp_path / "run")
    rows = [json.loads(ln) for ln in (articles / "train.jsonl").read_text().splitlines()]
    # an article whose summary leaves no room for one document token is dropped (and logged)
    rows = [r for r in rows if 2 + len(" <sep> ") + len(r["summary"]) < 41]
    assert 50 < len(rows) < 200 and len(data.rows["train"]) == len(rows)
    for row, ids in zip(rows, data.rows["train"].rows(range(len(rows)))):
        text = tok.src.decode(ids)
        doc, summ = collapse_whitespace(row["document"]), row["summary"]
        assert len(ids) <= 41 and ids[0] == BOS_ID and ids[-1] == EOS_ID
        assert text.endswith(" <sep> " + summ) and doc.startswith(text[: -len(" <sep> " + summ)])
    batches = [data.collate_plan(p) for p in data.epoch_plan(0)]
    assert sorted(i for b in batches for i in b.indices) == list(range(len(rows)))  # every article once
    for b in batches:
        assert torch.equal(b.tgt_in[:, 1:], b.tgt_out[:, :-1])
        assert b.ntokens == int((b.tgt_out != PAD_ID).sum()) and b.tgt_in.shape[0] * (b.tgt_in.shape[1] + 1) <= 8 * 41
    assert [p.tolist() for p in data.epoch_plan(0)] == [b.indices for b in batches]  # deterministic
    assert [p.tolist() for p in data.epoch_plan(1)] != [b.indices for b in batches]


@pytest.mark.skipif(shared_data_dir() is None or not (shared_data_dir() / "xsum-sample").is_dir(),
                    reason="no shared XSum sample")
def test_xsum_split_and_lead1(monkeypatch):
    from aiayn.data.summarization import lead_1, xsum_pairs, xsum_split

    monkeypatch.setenv("AIAYN_DATA_DIR", str(shared_data_dir()))
    splits = {s: xsum_split(s) for s in ("train", "valid", "test")}
    assert [len(v) for v in splits.values()] == [800, 100, 100]
    ids = [r["id"] for v in splits.values() for r in v]
    assert len(set(ids)) == 1000
    doc, summ = xsum_pairs("test")[0]
    assert "\n" not in doc and doc.startswith(lead_1(splits["test"][0]["document"]))


# Generation: cached == uncached, streaming, context limits --------------------------------------------------


def test_cached_and_uncached_greedy_generation_agree(text_lm):
    from aiayn.run.directory import load_run
    from aiayn.search import sample_list

    run = load_run(text_lm)
    tok = run.tokenizers.src
    for prompt in ("alpha ", "kilo lima mike\n", "x"):
        ids = tok.encode(prompt)
        greedy = spec_of(eos_id=NO_EOS)  # temperature 0: not sampling
        # 40 new tokens from a short prompt: the cached steps, then past the 32-token context (sliding)
        cached = sample_list(run.model, ids, greedy, 40, context_limit=32, use_cache=True)
        uncached = sample_list(run.model, ids, greedy, 40, context_limit=32, use_cache=False)
        assert cached == uncached and len(cached) == 40
    assert len(set(cached)) > 3  # the toy model says something, not one repeated character


def _generate(run: Path, capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["generate", str(run), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_cli_streams_the_greedy_continuation(text_lm, capsys, monkeypatch):
    from aiayn.run.directory import load_run
    from aiayn.search import sample_list

    run = load_run(text_lm)
    ids = sample_list(run.model, run.tokenizers.src.encode("alpha "), spec_of(eos_id=EOS_ID), 25)
    expected = "alpha " + run.tokenizers.src.decode(ids) + "\n"
    writes: list[str] = []
    real = cli._write_stdout
    monkeypatch.setattr(cli, "_write_stdout", lambda s: (writes.append(s), real(s)))
    code, out, err = _generate(text_lm, capsys, "--prompt", "alpha ", "--max-new-tokens", "25", "--temperature", "0")
    assert code == 0 and out == expected
    assert len(writes) == len(ids) + 2  # the prompt, one write per token (flushed), the final new line
    # sampling is repeatable with a seed
    a = _generate(text_lm, capsys, "--prompt", "kilo", "--max-new-tokens", "20", "--seed", "3", "--top-k", "5")
    b = _generate(text_lm, capsys, "--prompt", "kilo", "--max-new-tokens", "20", "--seed", "3", "--top-k", "5")
    assert a == b and a[0] == 0 and a[1].startswith("kilo")
    code, out, _ = _generate(text_lm, capsys, "--max-new-tokens", "10", "--top-p", "0.9", "--seed", "1")
    assert code == 0 and len(out) >= 1  # an empty prompt starts from a new line


def test_generate_refuses_a_prompt_longer_than_the_context_unless_slide(text_lm, capsys):
    long_prompt = "alpha bravo charlie delta echo foxtrot"  # 38 characters, the context is 32
    code, out, err = _generate(text_lm, capsys, "--prompt", long_prompt, "--max-new-tokens", "5")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--slide" in err and "32" in err
    code, out, err = _generate(text_lm, capsys, "--prompt", long_prompt, "--max-new-tokens", "5", "--slide",
                               "--temperature", "0")
    assert code == 0 and out.startswith(long_prompt) and len(out) == len(long_prompt) + 5 + 1
    code, _, err = _generate(text_lm, capsys, "--prompt", "a", "--top-p", "1.5")
    assert code == 2 and "top_p" in err


def test_text_stream_holds_back_incomplete_characters(tmp_path):
    from aiayn.decode.generate import TextStream

    tok = train_tokenizer(["plain ascii text only " * 20] * 20, kind="bpe", vocab_size=300)
    ids = tok.encode("déjà vu ✓")  # unseen characters: byte-fallback pieces, several per character
    stream = TextStream(tok, tok.encode("say"))
    text = "".join(stream.add(i) for i in ids) + stream.finish()
    assert text == " déjà vu ✓" and "\ufffd" not in text


# Summaries ------------------------------------------------------------------------------------------------


def _summarize(run: Path, tmp_path: Path, *args: str) -> list[str]:
    out = tmp_path / "out.txt"
    assert cli.main(["summarize", str(run), "--output", str(out), *args]) == 0
    return out.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.mark.parametrize("which", ["summary_lm", "summary_seq2seq"])
def test_summarize_command(which, request, articles, tmp_path):
    run = request.getfixturevalue(which)
    rows = [json.loads(ln) for ln in (articles / "valid.jsonl").read_text().splitlines()][:5]
    lines = [" ".join(r["document"].split()) for r in rows]
    (tmp_path / "in.txt").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n", encoding="utf-8")
    first = _summarize(run, tmp_path, "--input", str(tmp_path / "in.txt"), "--max-new-tokens", "12")
    assert len(first) == 6 and first[2] == ""  # one line per input line, an empty one stays empty
    assert all("\n" not in s for s in first) and any(first)
    again = _summarize(run, tmp_path, "--input", str(tmp_path / "in.txt"), "--max-new-tokens", "12")
    assert again == first  # deterministic
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    from_jsonl = _summarize(run, tmp_path, "--input", str(tmp_path / "in.jsonl"), "--max-new-tokens", "12")
    assert from_jsonl == first[:2] + first[3:]  # newlines inside a document do not matter


@pytest.mark.parametrize("which", ["summary_lm", "summary_seq2seq"])
def test_summarize_takes_any_iterable_of_documents_and_names_what_is_not_one(which, request, articles):
    from aiayn.decode.generate import summarize
    from aiayn.run.directory import load_run

    run = load_run(request.getfixturevalue(which), "cpu")
    docs = [json.loads(ln)["document"] for ln in (articles / "valid.jsonl").read_text().splitlines()[:2]]
    want = summarize(run, docs, max_new_tokens=6)
    assert summarize(run, (d for d in docs), max_new_tokens=6) == want  # a generator is read once
    with pytest.raises(TypeError, match=r"^documents\[1\]: expected a string, got int$"):
        summarize(run, [docs[0], 7])
    with pytest.raises(TypeError, match=r"^documents: expected a list \(or any iterable\) of strings, got str$"):
        summarize(run, docs[0])


@pytest.mark.parametrize("which", ["summary_lm", "summary_seq2seq"])
def test_summarize_no_repeat_ngram_reaches_the_search(which, request, articles, tmp_path, capsys, monkeypatch):
    import aiayn.search.processing as search

    run_dir = request.getfixturevalue(which)
    seen: list[int] = []
    real = search.repeated_ngram_bans
    monkeypatch.setattr(search, "repeated_ngram_bans", lambda seq, n: seen.append(n) or real(seq, n))
    doc = json.loads((articles / "valid.jsonl").read_text().splitlines()[0])["document"]
    (tmp_path / "in.txt").write_text(" ".join(doc.split()) + "\n", encoding="utf-8")
    assert len(_summarize(run_dir, tmp_path, "--input", str(tmp_path / "in.txt"), "--max-new-tokens", "8")) == 1
    assert set(seen) <= {0}  # off by default (the run's decode.no_repeat_ngram is 0)
    assert len(_summarize(run_dir, tmp_path, "--input", str(tmp_path / "in.txt"), "--max-new-tokens", "8",
                          "--no-repeat-ngram", "3")) == 1
    assert 3 in seen  # the option is applied by the search (its effect is proven in test_search.py)
    assert cli.main(["summarize", str(run_dir), "--input", str(tmp_path / "in.txt"), "--no-repeat-ngram", "-1"]) == 2
    assert capsys.readouterr().err.startswith("aiayn: error: decode.no_repeat_ngram=-1: must be >= 0")


def test_summarize_and_generate_refuse_other_runs(text_lm, summary_lm, summary_seq2seq, tiny_run, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("alpha bravo.\n", encoding="utf-8")
    assert cli.main(["summarize", str(text_lm), "--input", str(tmp_path / "in.txt")]) == 2
    assert cli.main(["summarize", str(summary_lm), "--input", str(tmp_path / "in.txt"), "--beam", "4"]) == 2
    assert cli.main(["summarize", str(tiny_run), "--input", str(tmp_path / "in.txt")]) == 2  # translation
    assert cli.main(["generate", str(summary_seq2seq), "--prompt", "alpha"]) == 2
    err = capsys.readouterr().err
    assert [ln.startswith("aiayn: error") for ln in err.splitlines()] == [True] * 4
    assert "cannot summarize" in err and "greedily" in err and "translate" in err and "language model" in err
    code, out, err = _generate(summary_lm, capsys, "--prompt", "alpha bravo. <sep>", "--max-new-tokens", "5")
    assert code == 0 and out.startswith("alpha bravo. <sep>")  # a summarization LM is still a language model


def test_rouge_of_a_run_on_its_valid_split(summary_lm, summary_seq2seq):
    for run in (summary_lm, summary_seq2seq):
        assert cli.main(["evaluate", str(run), "--split", "valid", "--max-new-tokens", "12"]) == 0
        res = json.loads((run / "eval" / "rouge_valid.json").read_text(encoding="utf-8"))
        assert res["data"]["n_documents"] == 20 and set(res["scores"]) == {"rouge1", "rouge2", "rougeL"}
        assert res["decode"]["max_new_tokens"] == 12
        assert len((run / "eval" / "rouge_valid.hyp").read_text(encoding="utf-8").splitlines()) == 20


def test_evaluate_with_a_split_scores_summaries_by_rouge(summary_lm, summary_seq2seq, capsys):
    from aiayn.eval.summaries import evaluate_summaries

    for run in (summary_lm, summary_seq2seq):
        assert cli.main(["evaluate", str(run), "--split", "valid"]) == 0
        out = capsys.readouterr().out
        assert "rouge1" in out and "rougeL" in out
        res = json.loads((run / "eval" / "rouge_valid.json").read_text(encoding="utf-8"))
        direct = evaluate_summaries(run, "valid")  # the same scores as the library call
        assert res["scores"] == direct["scores"]


def test_rolling_refuses_a_summary_lm_without_a_text(summary_lm, capsys):
    """--rolling scores running text: a model of "document <sep> summary" rows has none (its corpus summarizes), so
    without --src it is refused in one line, and nothing is written."""
    assert cli.main(["evaluate", str(summary_lm), "--rolling"]) == 2
    err = capsys.readouterr().err
    assert "--rolling scores running text: give a summarization LM's text as --src FILE" in err
    assert len(err.strip().splitlines()) == 1 and not list((summary_lm / "eval").glob("rolling*"))


def test_evaluate_summary_lm_reports_perplexity(summary_lm, capsys):
    from aiayn.run.directory import load_run

    assert cli.main(["evaluate", str(summary_lm)]) == 0
    assert "perplexity" in capsys.readouterr().out
    res = json.loads((summary_lm / "eval" / "valid.json").read_text(encoding="utf-8"))
    # recompute: every valid article as one sequence, every token after BOS predicted once
    from aiayn.data.registry import pairs as summary_pairs
    from aiayn.data.summarization import lm_sequence, separator_ids

    run = load_run(summary_lm)
    tok = run.tokenizers.src
    sep = separator_ids(tok, run.cfg.data.separator)
    nll = n = 0.0
    with torch.no_grad():
        for doc, summ in summary_pairs(run.cfg, "valid"):
            row = torch.tensor([lm_sequence(tok, doc, summ, sep, run.cfg.data.block_size)])
            logits = run.model(row[:, :-1])
            nll += F.cross_entropy(logits[0], row[0, 1:], reduction="sum").item()
            n += row.size(1) - 1
    assert res["data"]["n_tokens"] == n
    assert res["scores"]["nll_per_token"] == pytest.approx(nll / n, abs=1e-4)
    assert res["scores"]["ppl"] == pytest.approx(math.exp(res["scores"]["nll_per_token"]), rel=1e-4)


def test_configs_load():
    from aiayn.config import load_config

    for name in ("lm_tinyshakespeare_char", "lm_tinyshakespeare_char_quick", "xsum_lm", "xsum_seq2seq"):
        cfg = load_config(REPO / "configs" / f"{name}.yaml")
        assert cfg.data.block_size <= cfg.model.max_positions or cfg.task != "lm"
    quick = load_config(REPO / "configs" / "lm_tinyshakespeare_char_quick.yaml")
    m, d = quick.model, quick.data
    assert (m.n_decoder_layers, m.n_heads, m.d_model, d.block_size, d.batch_size, quick.train.max_updates,
            m.dropout) == (4, 4, 128, 64, 12, 2000, 0.0)  # nanoGPT's CPU recipe



def test_load_gives_a_generator_for_a_language_model(text_lm, summary_lm, articles):
    import aiayn
    from aiayn.decode.generate import Generator
    from aiayn.search import sample_list

    gen = aiayn.load(text_lm, device="cpu")
    assert isinstance(gen, Generator) and gen.device.type == "cpu"
    tok = gen.tokenizers.src
    ids = sample_list(gen.model, tok.encode("alpha "), spec_of(eos_id=EOS_ID), 12)
    assert gen.generate("alpha ", max_new_tokens=12) == tok.decode(ids)  # greedy unless sample=True
    a = gen.generate("kilo", max_new_tokens=15, sample=True, seed=5, top_k=5)
    assert a == gen.generate("kilo", max_new_tokens=15, sample=True, seed=5, top_k=5) and a
    summaries = aiayn.load(summary_lm, device="cpu").summarize(["alpha bravo charlie. delta echo."],
                                                               max_new_tokens=6)
    assert len(summaries) == 1 and "\n" not in summaries[0]


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_prompts_of_different_lengths_in_one_batch_generate_as_each_alone(positional, one_thread):
    """sample_rows (a server's concurrent completions in one batch: left-padded, each row at its own positions,
    one cache) gives every row the ids sample() gives it alone: greedy, and seeded draws with per-row seeds;
    each row stops at its own EOS or token limit."""
    from aiayn.config import ModelConfig
    from aiayn.model import build_model
    from aiayn.search import sample_list, sample_rows

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=2, d_ff=64, n_decoder_layers=2, dropout=0.0,
                      max_positions=64, positional=positional)
    model = build_model(cfg, "lm").eval()
    prompts = [[2, 5, 6, 7], [2, 9], [2, 11, 12, 13, 14, 15, 16, 17], [2]]
    limits, seeds = [10, 6, 12, 3], [11, 12, 13, 14]
    for opts in ({}, {"sample": True, "temperature": 1.0, "top_p": 0.9}, {"sample": True, "top_k": 5}):
        rows: list[list[int]] = [[] for _ in prompts]
        for step in sample_rows(model, prompts, spec_of(**opts), limits, seeds):
            assert len(step) == len(prompts)
            for r, t in enumerate(step):
                if t is not None:
                    rows[r].append(t)
        alone = [sample_list(model, p, spec_of(**opts, seed=s), n) for p, s, n in zip(prompts, seeds, limits)]
        if not opts:  # greedy: every pick beats its runner-up by a margin no float summation order can undo
            assert min(greedy_gap(model, p, a) for p, a in zip(prompts, alone)) > GREEDY_GAP
        assert rows == alone, opts
        assert [len(r) for r in rows] != [0, 0, 0, 0]
    with pytest.raises(ValueError, match="positions"):
        next(sample_rows(model, [[2] * 60], spec_of(), [10], [None]))
