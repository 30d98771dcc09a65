"""Hugging Face Marian directories in and out, against transformers itself (offline: every directory is built
here - tiny SentencePiece models, a vocab.json in Marian's layout, a random MarianMTModel saved with
save_pretrained - in the OPUS-MT shape: eos 0, unk 1, pad last and the decoder start, a pad ban with
renormalized logits, clean-up of tokenization spaces).

Proven: the imported run tokenizes as MarianTokenizer does and translates as generate() does, token for
token; it fine-tunes with --init-from (weights move, tokenizer files do not); exported back, it is the same
directory for transformers (every tensor torch.equal, the same tokenization); an aiayn run exported as a
Marian directory generates what ``aiayn translate --length-penalty power --stop hf`` does; bad inputs end
with one line and exit status 2.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
from conftest import agree_up_to_ties  # noqa: E402  (tests/ is on sys.path under pytest)
from transformers import GenerationConfig, MarianConfig, MarianMTModel, MarianTokenizer  # noqa: E402

import aiayn  # noqa: E402
from aiayn.cli import main  # noqa: E402
from aiayn.config import load_config  # noqa: E402
from aiayn.data.tokenizer import TokenizerPair  # noqa: E402
from aiayn.errors import ConfigError  # noqa: E402
from aiayn.interop.hf import export_hf, hf_generate, import_hf  # noqa: E402
from aiayn.run.weights import read_weights  # noqa: E402
from aiayn.train.run import train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

EN = ["a dog runs in the park", "two men talk about the weather", "the cat sleeps on a red chair",
      "children play football near the river", "a woman reads a book in the garden", "the old man walks home"]
DE = ["ein hund läuft im park", "zwei männer reden über das wetter", "die katze schläft auf einem roten stuhl",
      "kinder spielen fußball am fluss", "eine frau liest ein buch im garten", "der alte mann geht nach hause"]
SOURCES = ["a dog runs", "two men read a book", "the cat walks in the park near the river", "children",
           "Football, weather & a garden!", "a red chair", "the old woman sleeps", "  two  spaces  "]
# Text MarianTokenizer treats specially: special-token strings, a language code, unknown characters, NFKC.
TRICKY = ["a </s> dog<unk>runs <pad>", ">>de<< a dog", ">>xx<<", "ﬁne ½ Ⅻ", "你好 😀 ünï", "", "   ", "a\tb\nc",
          " leading and trailing ", "it 's a dog , is n't it ?", "<s> a"]
LANG_CODE = ">>de<<"


def train_spm(texts: list[str], vocab_size: int) -> bytes:
    """A SentencePiece model as Marian trains them: SentencePiece's defaults (NFKC, unk/bos/eos, no pad)."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts * 5), model_writer=out, vocab_size=vocab_size,
                                   model_type="unigram", hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return out.getvalue()


def marian_vocab(*protos: bytes) -> dict[str, int]:
    """vocab.json in Marian's layout: </s> 0, <unk> 1, a language code, the pieces of both models, <pad> last."""
    vocab = {"</s>": 0, "<unk>": 1, LANG_CODE: 2}
    for proto in protos:
        sp = spm.SentencePieceProcessor(model_proto=proto)
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    return vocab


def make_marian_dir(d: Path, seed: int = 0, steps: int = 100, pad_bias: float = 8.0) -> Path:
    """A small Marian model in the OPUS-MT shape, trained ``steps`` Adam updates on EN -> DE (so that it reads
    its source and ends its outputs at varied lengths), with its tokenizer files, as save_pretrained writes it.
    ``pad_bias`` is added to the pad logit: without the ban, generate() would then emit pad."""
    d.mkdir(parents=True)
    src_proto, tgt_proto = train_spm(EN, 60), train_spm(DE, 60)
    (d / "source.spm").write_bytes(src_proto)
    (d / "target.spm").write_bytes(tgt_proto)
    vocab = marian_vocab(src_proto, tgt_proto)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=2), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "source_lang": "en", "target_lang": "de", "model_max_length": 512,
        "clean_up_tokenization_spaces": True, "separate_vocabs": False}), encoding="utf-8")
    V, pad = len(vocab), len(vocab) - 1
    cfg = MarianConfig(vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       max_position_embeddings=64, activation_function="swish", scale_embedding=True,
                       share_encoder_decoder_embeddings=True, tie_word_embeddings=True, pad_token_id=pad,
                       eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0, dropout=0.1)
    torch.manual_seed(seed)
    model = MarianMTModel(cfg)
    batch = MarianTokenizer(str(d / "source.spm"), str(d / "target.spm"), str(d / "vocab.json"))(
        EN, text_target=DE, padding=True, return_tensors="pt")
    batch["labels"][batch["labels"] == pad] = -100
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        model.final_logits_bias[0, pad] += pad_bias
    model.generation_config = GenerationConfig(
        num_beams=4, max_length=40, length_penalty=0.8, bad_words_ids=[[pad]], renormalize_logits=True,
        forced_eos_token_id=0, decoder_start_token_id=pad, eos_token_id=0, pad_token_id=pad)
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> Path:
    return make_marian_dir(tmp_path_factory.mktemp("hf") / "opus-mt-tiny")


@pytest.fixture(scope="module")
def imported(marian_dir, tmp_path_factory) -> Path:
    return import_hf(marian_dir, tmp_path_factory.mktemp("runs") / "imported")


def generate_ids(model_dir: Path, texts: list[str]) -> list[list[int]]:
    """Plain generate() with the directory's own generation config, texts encoded by MarianTokenizer."""
    tok = MarianTokenizer.from_pretrained(model_dir)
    hf = MarianMTModel.from_pretrained(model_dir).eval()
    eos = hf.generation_config.eos_token_id
    out = []
    with torch.no_grad():
        for t in texts:
            seq = hf.generate(**tok([t], return_tensors="pt"))[0, 1:].tolist()
            out.append(seq[: seq.index(eos)] if eos in seq else seq)
    return out


def aiayn_ids(run: Path, texts: list[str], **opts) -> list[list[int]]:
    return [h[0].ids for h in aiayn.load(run, "cpu").translate_hypotheses(texts, **opts)]


# Import ------------------------------------------------------------------------------------------------------


def test_imported_run_tokenizes_as_marian_tokenizer(marian_dir, imported):
    mt = MarianTokenizer.from_pretrained(marian_dir)
    tok = TokenizerPair.load(imported / "tokenizer")
    assert tok.shared and tok.src.kind == "marian" and tok.src is not tok.tgt
    sp = tok.specials
    assert (sp.eos, sp.unk, sp.pad, sp.decoder_start) == (0, 1, len(mt.encoder) - 1, len(mt.encoder) - 1)
    for text in SOURCES + TRICKY:
        assert tok.src.encode(text) + [sp.eos] == mt(text)["input_ids"], text
        assert tok.tgt.encode(text) + [sp.eos] == mt(text_target=text)["input_ids"], text
    assert tok.src.encode(f"{LANG_CODE} a dog")[0] == 2 and tok.src.encode("a </s> b").count(0) == 1
    g = torch.Generator().manual_seed(0)
    for _ in range(30):  # decode as batch_decode(skip_special_tokens=True), specials and clean-up included
        ids = torch.randint(0, len(mt.encoder), (12,), generator=g).tolist()
        assert tok.tgt.decode(ids) == mt.decode(ids, skip_special_tokens=True), ids


def test_imported_run_translates_as_generate(marian_dir, imported):
    cfg = load_config(imported / "config.yaml")
    d = cfg.decode
    assert (d.beam, d.alpha, d.length_penalty, d.stop, d.max_len_a, d.max_len_b, d.ban_pad) == (
        4, 0.8, "power", "hf", 0.0, 39, True)
    want = generate_ids(marian_dir, SOURCES)
    agree_up_to_ties(aiayn.load(imported, "cpu"), SOURCES, aiayn_ids(imported, SOURCES), want)
    lengths = [len(w) for w in want]
    assert len(set(lengths)) >= 3 and max(lengths) < 39  # varied, all ended by EOS (none cut at max_length)
    # The pad ban is what makes them equal here: without it the search emits pad.
    unbanned = aiayn_ids(imported, SOURCES, ban_pad=False)
    assert unbanned != want and any(cfg.model.pad_id in ids for ids in unbanned)


def fake_hub_cache(cache: Path, repo_id: str, marian_dir: Path, commit: str = "a" * 40) -> str:
    """``marian_dir`` laid out as huggingface_hub caches a download of ``repo_id`` at ``commit`` (the main
    branch's ref pointing at it), so that HF_HUB_OFFLINE=1 finds it: no network in the tests."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(marian_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


def test_an_offline_hub_that_asks_the_network_falls_back_to_the_cache(monkeypatch, tmp_path):
    """huggingface_hub 1.x asks the Hub for a pinned commit's file list even with HF_HUB_OFFLINE set (2.x reads
    the cache): hub_snapshot then takes the cached copy alone, and a copy the cache lacks is aiayn's one line."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    from aiayn.errors import DataError
    from aiayn.interop.hf import hub_snapshot

    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        calls.append(local_files_only)
        if not local_files_only:
            raise OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/models/...: offline mode is enabled")
        if repo_id == "absent/model":
            raise LocalEntryNotFoundError("not cached")
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert hub_snapshot("owner/model", "a" * 40) == tmp_path / "snapshot" and calls == [False, True]
    with pytest.raises(DataError, match="not in the Hugging Face cache"):
        hub_snapshot("absent/model", "b" * 40)


def test_hub_id_imports_from_the_cache_offline(marian_dir, imported, tmp_path, capsys, monkeypatch):
    """`aiayn import hf OWNER/NAME RUN` with HF_HUB_OFFLINE=1 imports the cached snapshot (a fresh process: the
    environment variable as a user sets it), as the local directory imports; a pinned revision too; a model the
    cache lacks is one line and exit 2."""
    import subprocess
    import sys

    commit = fake_hub_cache(tmp_path / "hub", "Helsinki-NLP/opus-mt-tiny", marian_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-m", "aiayn", "import", "hf", "Helsinki-NLP/opus-mt-tiny",
                           str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ours, theirs = read_weights(tmp_path / "run" / "model.safetensors"), read_weights(imported / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as f:
        assert f.metadata()["source"] == f"imported from Helsinki-NLP/opus-mt-tiny@{commit}"

    import huggingface_hub.constants as hub  # the same switches, in this process

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    assert run_cli(capsys, "import", "hf", "Helsinki-NLP/opus-mt-tiny", str(tmp_path / "pinned"),
                   "--revision", commit)[0] == 0
    for argv, msg in [(["Helsinki-NLP/opus-mt-absent"], "not in the Hugging Face cache"),
                      (["Helsinki-NLP/opus-mt-tiny", "--revision", "b" * 40], "not in the Hugging Face cache"),
                      ([str(marian_dir), "--revision", "main"], "--revision is for a Hub id"),
                      (["no/such/dir"], "no such directory")]:
        code, err = run_cli(capsys, "import", "hf", argv[0], str(tmp_path / "absent"), *argv[1:])
        assert code == 2 and msg in err and "\n" not in err, err
        assert not (tmp_path / "absent").exists()


def test_pytorch_model_bin_imports_the_same(marian_dir, imported, tmp_path):
    bin_dir = tmp_path / "bin"
    shutil.copytree(marian_dir, bin_dir)
    (bin_dir / "model.safetensors").unlink()
    torch.save(MarianMTModel.from_pretrained(marian_dir).state_dict(), bin_dir / "pytorch_model.bin")
    run = import_hf(bin_dir, tmp_path / "run")
    a, b = read_weights(run / "model.safetensors"), read_weights(imported / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Fine-tuning -------------------------------------------------------------------------------------------------


def test_fine_tune_with_init_from(imported, tmp_path):
    for name, lines in (("train.en", EN * 4), ("train.de", DE * 4), ("valid.en", EN[:2]), ("valid.de", DE[:2])):
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    recipe = tmp_path / "finetune.yaml"
    recipe.write_text(f"""\
data: {{train_src: {tmp_path}/train.en, train_tgt: {tmp_path}/train.de, valid_src: {tmp_path}/valid.en,
       valid_tgt: {tmp_path}/valid.de, max_tokens: 256}}
train: {{max_updates: 6, schedule: constant, lr: 1.0e-3, warmup: 1, log_every: 1, eval_every: 6, save_every: 6,
        device: cpu, inference_weights: last}}
""", encoding="utf-8")
    run = tmp_path / "tuned"
    state = train(load_config(recipe), run, progress=False, init_from=imported)
    assert state.step == 6
    for f in (imported / "tokenizer").iterdir():  # the tokenizer is copied, not retrained
        assert (run / "tokenizer" / f.name).read_bytes() == f.read_bytes(), f.name
    assert load_config(run / "config.yaml").model == load_config(imported / "config.yaml").model
    assert load_config(run / "config.yaml").decode.ban_pad  # the imported run's decoding settings stay
    before, after = read_weights(imported / "model.safetensors"), read_weights(run / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    nll = [m["train_nll"] for m in logged if "train_nll" in m]
    assert len(nll) == 6 and all(math.isfinite(x) for x in nll), nll
    # Training started from the imported weights: the first update's NLL is far below a fresh model's ln(V).
    assert nll[0] < 0.5 * math.log(load_config(imported / "config.yaml").model.vocab_size), nll
    # A recipe whose model section names another model is refused before anything is written.
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text() + "model: {d_model: 64}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"model\.d_model=64 \(the run has 32\)"):
        train(load_config(bad), tmp_path / "refused", progress=False, init_from=imported)
    assert not (tmp_path / "refused").exists()


# Export ------------------------------------------------------------------------------------------------------


def test_round_trip_hf_aiayn_hf_is_identical(marian_dir, imported, tmp_path):
    out = export_hf(imported, tmp_path / "exported")
    a = MarianMTModel.from_pretrained(marian_dir).state_dict()
    b = MarianMTModel.from_pretrained(out).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ta, tb = MarianTokenizer.from_pretrained(marian_dir), MarianTokenizer.from_pretrained(out)
    for text in SOURCES + TRICKY:
        assert ta(text)["input_ids"] == tb(text)["input_ids"], text
        ids = ta(text)["input_ids"]
        assert ta.decode(ids, skip_special_tokens=True) == tb.decode(ids, skip_special_tokens=True)
    assert generate_ids(out, SOURCES) == generate_ids(marian_dir, SOURCES)
    # Exporting again over an earlier export is allowed; over anything else it is refused.
    assert export_hf(imported, out) == out
    with pytest.raises(ConfigError, match="not empty"):
        export_hf(imported, marian_dir)


def test_model_card_says_languages_data_training_bleu_and_license(tiny_run, tmp_path):
    """The exported card carries the run's facts; BLEU appears once the weights it would describe were evaluated."""
    from aiayn.eval.evaluate import EvalData, evaluate_run

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    shutil.rmtree(run / "eval", ignore_errors=True)  # other tests evaluate the shared run: start from none
    export_hf(run, tmp_path / "before")
    card = (tmp_path / "before" / "README.md").read_text(encoding="utf-8")
    assert "language:\n- en\n- de\nlicense: other\n" in card
    assert "- Languages: English (en) -> German (de)" in card and "- Data: the `reverse` dataset" in card
    assert "- Training: 60 updates; weights: last step 60" in card and "- BLEU: not measured" in card
    assert "- License: not set by aiayn" in card
    (tmp_path / "src.txt").write_text("one two three\nfour five\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("three two one\nfive four\n", encoding="utf-8")
    result = evaluate_run(run, EvalData(src=str(tmp_path / "src.txt"), ref=str(tmp_path / "ref.txt"), name="mine"),
                          device="cpu")
    export_hf(run, tmp_path / "after")
    card = (tmp_path / "after" / "README.md").read_text(encoding="utf-8")
    assert f"- BLEU: mine (2 sentences, beam 4): {result['scores']['bleu']:.2f} sacreBLEU" in card


def test_aiayn_run_exports_to_generate(tiny_run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", "hf", str(tiny_run), str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "generation_config.json", "model.safetensors",
                                               "source.spm", "target.spm", "vocab.json", "tokenizer_config.json"}
    tok, hf = MarianTokenizer.from_pretrained(out), MarianMTModel.from_pretrained(out).eval()
    translator = aiayn.load(tiny_run, "cpu")
    texts = ["one two three", "seven eight nine ten", "four five", "six one two seven eight", "three"]
    for text in texts:  # MarianTokenizer reads text as the run's tokenizer does
        assert tok(text)["input_ids"] == translator.tokenizers.src.encode(text) + [3]
    opts = translator.options(beam=4, length_penalty="power", stop="hf")
    ours = translator.translate_hypotheses(texts, opts)
    theirs = hf_generate(hf, tok, texts, opts, translator.cfg.model.max_positions)
    agree_up_to_ties(translator, texts, [h[0].ids for h in ours], theirs, opts)
    assert any(theirs) and len({len(t) for t in theirs}) > 1
    start = hf.generation_config.decoder_start_token_id
    assert [h[0].text for h in ours] == tok.batch_decode([[start] + h[0].ids for h in ours], skip_special_tokens=True)
    # Plain generate() with the exported config, on a source whose aiayn limit is the model's: the same.
    gen = hf.generate(**tok([texts[0]], return_tensors="pt"), max_length=int(len(tok(texts[0])["input_ids"])
                      + translator.cfg.decode.max_len_b) + 1)[0, 1:].tolist()
    agree_up_to_ties(translator, texts[:1], [gen[: gen.index(3)] if 3 in gen else gen], theirs[:1], opts)


def separate_vocab_run(d: Path, bias: dict[str, float] | None = None, **decode) -> Path:
    """A run with two vocabularies (data.shared_vocab=false) and a random model: the paper's interleaved
    sinusoids, separate source/target embeddings, a logits bias raising EOS so outputs end at varied lengths.
    ``bias``: target pieces (or "</s>") and what to add to their logits instead; ``decode``: the run's decode
    options beyond length_penalty power, stop hf and max_len_b 10."""
    from aiayn.config import Config, DataConfig, DecodeOptions, ModelConfig, save_config
    from aiayn.data.tokenizer import train_tokenizer_pair
    from aiayn.model import Transformer
    from aiayn.run.weights import save_weights

    tok = train_tokenizer_pair(EN * 3, DE * 3, d / "tokenizer", shared=False, vocab_size=300)
    m = ModelConfig(vocab_size=tok.src.vocab_size, tgt_vocab_size=tok.tgt.vocab_size, d_model=32, n_heads=4, d_ff=64,
                    n_encoder_layers=2, n_decoder_layers=2, dropout=0.0, max_positions=64, share_embeddings=False,
                    tie_output=True, output_bias=True)
    torch.manual_seed(0)
    model = Transformer(m).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for piece, add in (bias or {"</s>": 1.5}).items():
            i = 3 if piece == "</s>" else tok.tgt.sp.piece_to_id(piece)
            assert tok.tgt.id_to_piece(i) == piece, piece
            model.decoder.output_bias[i] += add
    save_weights(model, d / "model.safetensors")
    save_config(Config(model=m, data=DataConfig(shared_vocab=False),
                       decode=DecodeOptions(length_penalty="power", stop="hf", max_len_b=10, **decode)),
                d / "config.yaml")
    return d


def test_separate_vocabularies_round_trip(tmp_path):
    run = separate_vocab_run(tmp_path / "run")
    out = export_hf(run, tmp_path / "hf")
    assert json.loads((out / "tokenizer_config.json").read_text())["separate_vocabs"] is True
    tok, hf = MarianTokenizer.from_pretrained(out), MarianMTModel.from_pretrained(out).eval()
    translator = aiayn.load(run, "cpu")
    for text in SOURCES:
        assert tok(text)["input_ids"] == translator.tokenizers.src.encode(text) + [3]
    ours = translator.translate_hypotheses(SOURCES)
    theirs = hf_generate(hf, tok, SOURCES, translator.cfg.decode, 64)
    agree_up_to_ties(translator, SOURCES, [h[0].ids for h in ours], theirs)
    assert len({len(t) for t in theirs}) > 2
    assert [h[0].text for h in ours] == tok.batch_decode([[2] + h[0].ids for h in ours], skip_special_tokens=True)
    back = import_hf(out, tmp_path / "back")  # and into aiayn again: two id spaces, the same outputs
    pair = TokenizerPair.load(back / "tokenizer")
    assert not pair.shared and pair.tgt.vocab_size == translator.tokenizers.tgt.vocab_size
    back_tr = aiayn.load(back, "cpu")
    agree_up_to_ties(back_tr, SOURCES, aiayn_ids(back, SOURCES, max_len_a=1.0, max_len_b=10), theirs,
                     back_tr.options(max_len_a=1.0, max_len_b=10))


def test_a_lone_word_boundary_first_never_reaches_the_text(tmp_path, capsys):
    """A model whose output starts with a lone ``▁`` piece (built: output biases rank it first, then a piece
    that starts a word, then EOS, 100 logits apart; greedy, and no_repeat_ngram=1 lets each come once) gives,
    through the Python API, ``aiayn translate`` and ``aiayn serve``, the text Hugging Face's decode gives."""
    sp = TokenizerPair.load(separate_vocab_run(tmp_path / "probe") / "tokenizer").tgt.sp
    word = next(p for p in map(sp.id_to_piece, range(sp.get_piece_size())) if p.startswith("▁") and len(p) > 2)
    bias = {"▁": 300.0, word: 200.0, "</s>": 100.0}  # far above the random model's logits (std ~20)
    run = separate_vocab_run(tmp_path / "run", bias=bias, beam=1, no_repeat_ngram=1)
    translator = aiayn.load(run, "cpu")
    tgt = translator.tokenizers.tgt
    [[best]] = translator.translate_hypotheses(["a dog runs"])
    assert best.tokens == ["▁", word]  # the model's first piece is a lone word boundary ...
    assert tgt.decode(best.ids).startswith(" ")  # ... which SentencePiece's decode keeps as a space
    out = export_hf(run, tmp_path / "hf")
    hf_tok = MarianTokenizer.from_pretrained(out)
    theirs = hf_tok.batch_decode([[2] + best.ids, [2] + best.ids + [best.ids[0]]], skip_special_tokens=True)
    assert theirs[0] == word[1:] and best.text == theirs[0] and translator.translate("a dog runs") == theirs[0]
    assert tgt.text(best.ids + [best.ids[0]]) == theirs[1]  # a lone boundary last: stripped too
    src = tmp_path / "in.txt"
    src.write_text("a dog runs\ntwo men\n", encoding="utf-8")
    assert main(["translate", str(run), "--input", str(src), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == [theirs[0]] * 2
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from aiayn.serve.app import create_app
    from aiayn.serve.batcher import Batching

    with TestClient(create_app(translator, batching=Batching(max_wait_ms=0.0)), base_url="http://localhost") as c:
        r = c.post("/v1/translate", json={"text": ["a dog runs"]})
    assert r.json()["translations"][0]["text"] == theirs[0]


# Refusals ----------------------------------------------------------------------------------------------------


class NotAWeight:  # pickled by reference: torch.load(weights_only=True) refuses it
    pass


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_bad_directories_are_refused_in_one_line(marian_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text('{"model_type": "bert"}')
    pickled = tmp_path / "pickled"
    shutil.copytree(marian_dir, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2), "code": NotAWeight()}, pickled / "pytorch_model.bin")
    cases = [(empty, "no config.json"), (bert, "model_type='bert', not a Marian model"),
             (pickled, "refused: torch.load(weights_only=True) cannot read it")]
    for src, msg in cases:
        code, err = run_cli(capsys, "import", "hf", str(src), str(tmp_path / "run"))
        assert code == 2 and err.startswith("aiayn: error: ") and msg in err and "\n" not in err, err
        assert not (tmp_path / "run").exists()


def test_runs_marian_cannot_hold_are_refused(tiny_run, tmp_path, capsys):
    moses = tmp_path / "moses"
    shutil.copytree(tiny_run, moses)
    meta = json.loads((moses / "tokenizer" / "tokenizer.json").read_text())
    meta.update(pretokenize="moses", src_lang="en", tgt_lang="de")
    (moses / "tokenizer" / "tokenizer.json").write_text(json.dumps(meta))
    code, err = run_cli(capsys, "export", "hf", str(moses), str(tmp_path / "out"))
    assert code == 2 and "Moses pretokenization" in err and "\n" not in err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, "export", "hf", str(tiny_run), str(taken))
    assert code == 2 and "not empty" in err and (taken / "notes.txt").read_text() == "mine"


def test_imported_run_exports_to_ctranslate2(imported, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from aiayn.interop.ctranslate2 import export_run

    out = export_run(imported, tmp_path / "ct2")
    assert "<pad>" in (out / "README.txt").read_text() and (out / "source.spm").is_file()
    translator = aiayn.load(imported, "cpu")
    tok, d = translator.tokenizers, translator.cfg.decode
    pieces = [[tok.src.id_to_piece(i) for i in tok.src.encode(t)] for t in SOURCES]
    results = ctranslate2.Translator(str(out), device="cpu").translate_batch(
        pieces, beam_size=d.beam, length_penalty=d.alpha, patience=1000.0, return_end_token=True,
        max_decoding_length=d.max_len_b, min_decoding_length=0, suppress_sequences=[["<pad>"]])
    theirs = [[tok.tgt.vocab.ids[p] for p in r.hypotheses[0] if p != "</s>"] for r in results]
    agree_up_to_ties(translator, SOURCES, aiayn_ids(imported, SOURCES, stop="exact"), theirs,
                     translator.options(stop="exact"))


def test_staged_directory_replaces_whole_or_not_at_all(tmp_path):
    from aiayn.files import staged_directory

    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_directory(target) as stage:
        (stage / "new.txt").write_text("new")
        raise RuntimeError("export failed half way")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (target / "old.txt").read_text() == "old"
    with staged_directory(target) as stage:
        (stage / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in target.iterdir()] == ["new.txt"]


@pytest.mark.parametrize("stop,early_stopping", [("exact", "never"), ("hf", False), ("first", True)])
def test_each_stop_rule_crosses_to_generate_and_back(stop, early_stopping):
    """An export writes each aiayn stop rule as generate()'s early_stopping and an import reads it back, with no note
    (tests/test_search.py proves each pair decodes token for token alike)."""
    from aiayn.config import DecodeOptions
    from aiayn.data.tokenizer import SpecialIds
    from aiayn.interop.hf import decode_options_from, generation_config_for

    opts = DecodeOptions(beam=4, alpha=0.6, length_penalty="power", stop=stop, max_len_a=0.0, max_len_b=20)
    g = generation_config_for(opts, SpecialIds(pad=0, bos=2, eos=3, decoder_start=0), max_positions=64)
    assert g.early_stopping == early_stopping
    back, notes = decode_options_from(g, pad_id=0)
    assert back.stop == stop and not [n for n in notes if "early_stopping" in n], notes
