"""Data layer: tokenizers, corpus readers and their errors, batching, known datasets."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import statistics
from pathlib import Path

import pytest
import torch

from aiayn.data import datasets
from aiayn.data.batching import collate, lm_batches, lm_blocks, token_batches
from aiayn.data.corpus import (
    DataError,
    clean_pairs,
    describe_clean_stats,
    read_jsonl,
    read_jsonl_rows,
    read_lines,
    read_parallel,
    read_text,
    read_tsv,
)
from aiayn.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    CharTokenizer,
    MosesPretokenized,
    TokenizerPair,
    load_tokenizer,
    train_tokenizer,
    train_tokenizer_pair,
)

REPO = Path(__file__).resolve().parent.parent
WORDS_EN = "the a cat dog man woman sits runs on in red blue green house street park ball with".split()
WORDS_DE = "der die das Katze Hund Mann Frau sitzt läuft auf im rot blau grün Haus Straße Park Ball".split()


def synthetic(words: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    return synthetic(WORDS_EN, 300, 0), synthetic(WORDS_DE, 300, 1)


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    return train_tokenizer(corpus[0] + corpus[1], tmp_path_factory.mktemp("tok"), vocab_size=400)


# --- tokenizers -----------------------------------------------------------------------------------


def test_bpe_special_ids_and_round_trip(bpe):
    assert [bpe.id_to_piece(i) for i in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert bpe.kind == "bpe" and 300 <= bpe.vocab_size <= 400
    # Unseen scripts, emoji, tabs and repeated spaces survive through byte fallback + no normalization.
    for text in ["the cat sits on the mat", "Straße  grün\tHaus", "日本語のテキスト", "Ελληνικά 🙂 ﬁ x²", ""]:
        ids = bpe.encode(text)
        assert UNK_ID not in ids
        assert bpe.decode(ids) == text
    ids = bpe.encode("the cat")
    assert BOS_ID not in ids and EOS_ID not in ids  # encode adds no specials
    assert bpe.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == "the cat"
    assert "".join(bpe.pieces("the cat")).replace("\u2581", " ").strip() == "the cat"
    # Real merges were learnt: a frequent word is one piece, far fewer pieces than characters.
    assert len(bpe.encode("the house")) <= 3


def test_bpe_training_is_deterministic_and_saved(corpus, tmp_path, bpe):
    again = train_tokenizer(corpus[0] + corpus[1], tmp_path, vocab_size=400)
    assert again.model_proto == bpe.model_proto
    loaded = load_tokenizer(tmp_path)
    text = "a woman runs in the park"
    assert loaded.encode(text) == bpe.encode(text)


def test_bpe_vocab_too_small_is_a_clear_error(corpus):
    with pytest.raises(ValueError, match="vocab_size=200 is too small.*byte_fallback.*at least 261"):
        train_tokenizer(corpus[0], vocab_size=200)
    # The corpus alphabet plus byte pieces does not fit: SentencePiece's error becomes one line.
    texts = corpus[0] + ["".join(chr(0x4E00 + i) for i in range(60))]
    with pytest.raises(DataError, match="vocab_size=300 is too small for this corpus.*at least 3"):
        train_tokenizer(texts, vocab_size=300)
    no_fallback = train_tokenizer(corpus[0], vocab_size=100, byte_fallback=False)
    assert no_fallback.encode("日")[-1] == UNK_ID  # after the word-boundary piece


def test_shared_and_separate_pairs_round_trip(corpus, tmp_path):
    src, tgt = corpus
    shared = train_tokenizer_pair(src, tgt, tmp_path / "shared", shared=True, vocab_size=400)
    separate = train_tokenizer_pair(src, tgt, tmp_path / "separate", shared=False, vocab_size=350)
    assert shared.shared and not separate.shared
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["shared.model", "tokenizer.json"]
    assert sorted(p.name for p in (tmp_path / "separate").iterdir()) == ["src.model", "tgt.model", "tokenizer.json"]
    meta = json.loads((tmp_path / "separate" / "tokenizer.json").read_text())
    assert meta["kind"] == "bpe" and meta["shared"] is False and meta["tgt_vocab_size"] == separate.tgt.vocab_size
    for pair, d in ((shared, "shared"), (separate, "separate")):
        loaded = TokenizerPair.load(tmp_path / d)
        assert loaded.shared == pair.shared
        for s, t in zip(src[:50], tgt[:50]):
            assert loaded.src.encode(s) == pair.src.encode(s)
            assert loaded.tgt.encode(t) == pair.tgt.encode(t)
    # Separate vocabularies really differ: German words are single pieces only in the target model.
    assert separate.tgt.encode("Straße") != separate.src.encode("Straße")


def test_moses_pretokenized_pair_tokenizes_like_the_literature_and_survives_reloading(corpus, tmp_path):
    """data.pretokenize=moses: lowercase, normalize punctuation, split it off (per side, in its language),
    then the shared BPE; decode detokenizes. tokenizer.json records it, so a reloaded pair does the same."""
    src, tgt = corpus
    src = [s.capitalize() + ", " + s + "." for s in src]  # punctuation for Moses to split off
    tgt = [t.capitalize() + "." for t in tgt]
    pair = train_tokenizer_pair(src, tgt, tmp_path / "moses", vocab_size=400, lowercase=True,
                                pretokenize="moses", langs=("en", "de"))
    meta = json.loads((tmp_path / "moses" / "tokenizer.json").read_text())
    assert (meta["pretokenize"], meta["src_lang"], meta["tgt_lang"]) == ("moses", "en", "de")
    assert sorted(p.name for p in (tmp_path / "moses").iterdir()) == ["shared.model", "tokenizer.json"]
    loaded = TokenizerPair.load(tmp_path / "moses")
    for p in (pair, loaded):
        assert p.shared and p.pretokenize == "moses" and p.src.lowercases
        assert isinstance(p.src, MosesPretokenized) and (p.src.lang, p.tgt.lang) == ("en", "de")
        # What the BPE sees: lowercased, punctuation normalized (the curly quotes) and split off.
        assert p.src.pretokenize("The dog, «red» runs.") == 'the dog , " red " runs .'
        assert p.tgt.pretokenize("Der Hund läuft.") == "der hund läuft ."
        # The comma is its own piece, the word before it keeps no attached punctuation.
        assert p.src.pieces("Dog, man.")[:3] == p.src.inner.pieces("dog , man .")[:3]
        # decode detokenizes: the text comes back as plain (lowercased) text, not Moses tokens.
        assert p.tgt.decode(p.tgt.encode("Der Hund, die Katze.")) == "der hund, die katze."
        assert p.src.encode("Dog, man.") == pair.src.encode("Dog, man.")
    # Without the option nothing is pretokenized and files written before it load as "none".
    plain = train_tokenizer_pair(src, tgt, tmp_path / "plain", vocab_size=400)
    assert plain.pretokenize == "none"
    meta = json.loads((tmp_path / "plain" / "tokenizer.json").read_text())
    del meta["pretokenize"]
    (tmp_path / "plain" / "tokenizer.json").write_text(json.dumps(meta))
    assert TokenizerPair.load(tmp_path / "plain").pretokenize == "none"
    meta["pretokenize"] = "spacy"
    (tmp_path / "plain" / "tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="pretokenize 'spacy'"):
        TokenizerPair.load(tmp_path / "plain")
    with pytest.raises(DataError, match="pretokenize 'spacy'"):
        train_tokenizer_pair(src, tgt, vocab_size=400, pretokenize="spacy")


def test_lowercase_bpe_folds_case_everywhere_and_nothing_else(corpus, tmp_path, bpe):
    """data.lowercase: the rule lives in the SentencePiece model, so a reloaded tokenizer lowercases too;
    only case changes (no NFKC, whitespace kept), and the default tokenizer stays lossless."""
    src, tgt = corpus
    pair = train_tokenizer_pair(src, tgt, tmp_path / "lc", vocab_size=400, lowercase=True)
    assert json.loads((tmp_path / "lc" / "tokenizer.json").read_text())["lowercase"] is True
    loaded = TokenizerPair.load(tmp_path / "lc").src
    for tok in (pair.src, loaded):
        assert tok.lowercases
        for text, low in [("Der Hund läuft über die STRASSE", "der hund läuft über die strasse"),
                          ("Zwei  Männer\tÄÖÜ", "zwei  männer\täöü"), ("ﬁ x² 🙂 ΣΑ", "ﬁ x² 🙂 σα")]:
            assert tok.encode(text) == tok.encode(low)
            assert tok.decode(tok.encode(text)) == low
    assert not bpe.lowercases  # the default: "A" and "a" are different ids
    shared = train_tokenizer_pair(src, tgt, tmp_path / "cased", vocab_size=400)
    assert json.loads((tmp_path / "cased" / "tokenizer.json").read_text())["lowercase"] is False
    with pytest.raises(DataError, match="lowercase needs a BPE tokenizer"):
        train_tokenizer(["Abc"], kind="char", lowercase=True)
    assert shared.src.decode(shared.src.encode("Der Hund")) == "Der Hund"


def test_char_tokenizer(tmp_path):
    text = "First Citizen:\nBefore we proceed, hear me speak.\n"
    tok = train_tokenizer([text], tmp_path, kind="char")
    assert isinstance(tok, CharTokenizer) and tok.kind == "char"
    assert tok.vocab_size == 4 + len(set(text))
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("F§") == [tok.encode("F")[0], UNK_ID]  # unseen character
    assert tok.decode([BOS_ID, *tok.encode("hear"), EOS_ID, PAD_ID]) == "hear"
    assert load_tokenizer(tmp_path).encode(text) == tok.encode(text)
    # Ids follow sorted characters, after the four specials.
    assert tok.id_to_piece(4) == sorted(set(text))[0]
    pair = TokenizerPair(tok, tok)
    pair.save(tmp_path / "pair")
    assert (tmp_path / "pair" / "shared.json").is_file()
    assert TokenizerPair.load(tmp_path / "pair").src.encode(text) == tok.encode(text)


def test_tokenizer_load_errors(tmp_path):
    with pytest.raises(DataError, match="tokenizer.json: no such file"):
        TokenizerPair.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer description"):
        TokenizerPair.load(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"garbage")
    with pytest.raises(DataError, match="not a readable SentencePiece model"):
        load_tokenizer(tmp_path)


# --- corpus readers and their errors --------------------------------------------------------------


def write(path: Path, text: str | bytes) -> Path:
    data = text.encode("utf-8") if isinstance(text, str) else text
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def test_read_parallel_plain_and_gz(tmp_path):
    src = write(tmp_path / "a.en", "Hello  world \r\nsecond line\n\nlast")  # CRLF, blank line, no final newline
    tgt = write(tmp_path / "a.de.gz", "Hallo  Welt \nzweite Zeile\n\nletzte\n")
    assert read_parallel(src, tgt) == [
        ("Hello  world ", "Hallo  Welt "),
        ("second line", "zweite Zeile"),
        ("", ""),
        ("last", "letzte"),
    ]
    # U+2028 is not a line break for us (str.splitlines would split there and misalign the files).
    assert read_lines(write(tmp_path / "b.txt", "a\u2028b\nc\n")) == ["a\u2028b", "c"]


def test_mismatched_parallel_files_name_both(tmp_path):
    src = write(tmp_path / "train.en", "a\nb\nc\n")
    tgt = write(tmp_path / "train.de", "x\ny\n")
    with pytest.raises(DataError) as e:
        read_parallel(src, tgt)
    msg = str(e.value)
    assert str(src) in msg and str(tgt) in msg and "3 lines" in msg and "2 lines" in msg
    assert "\n" not in msg


def test_bad_utf8_names_line(tmp_path):
    path = write(tmp_path / "bad.en", b"fine\nalso fine\nbroken \xff here\n")
    with pytest.raises(DataError, match=r"bad\.en: line 3: not valid UTF-8 \(byte 0xff at column 8\)"):
        read_lines(path)
    gz = write(tmp_path / "bad.en.gz", b"ok\n\xc3\n")
    with pytest.raises(DataError, match="line 2: not valid UTF-8"):
        read_lines(gz)


def test_missing_empty_and_corrupt_files(tmp_path):
    ok = write(tmp_path / "ok.de", "x\n")
    with pytest.raises(DataError, match=r"nope\.en: no such file"):
        read_parallel(tmp_path / "nope.en", ok)
    a, b = write(tmp_path / "e.en", ""), write(tmp_path / "e.de", "")
    with pytest.raises(DataError) as e:
        read_parallel(a, b)
    assert "empty corpus" in str(e.value) and str(a) in str(e.value) and str(b) in str(e.value)
    with pytest.raises(DataError, match="empty corpus"):
        read_text(write(tmp_path / "empty.txt", ""))
    trunc = tmp_path / "trunc.gz"
    trunc.write_bytes(gzip.compress(b"hello world\n" * 100)[:30])
    with pytest.raises(DataError, match=r"trunc\.gz: not a valid gzip file"):
        read_lines(trunc)


def test_read_text_keeps_everything(tmp_path):
    text = "ROMEO:\n  But, soft!\r\n\n"
    assert read_text(write(tmp_path / "t.txt.gz", text)) == text


def test_read_tsv(tmp_path):
    path = write(tmp_path / "c.tsv", "id\ten\tde\n1\tHello \"you\"\tHallo\n2\ta b\tc d\n")
    assert read_tsv(path, "en", "de") == [('Hello "you"', "Hallo"), ("a b", "c d")]
    assert read_tsv(path, "de", "en")[1] == ("c d", "a b")
    # Column indices: no header row.
    assert read_tsv(path, "1", "2")[0] == ("en", "de")
    with pytest.raises(DataError, match=r"no column 'fr' in the header row \(columns: id, en, de\)"):
        read_tsv(path, "en", "fr")
    short = write(tmp_path / "s.tsv", "en\tde\nhello\tHallo\nalone\n")
    with pytest.raises(DataError, match=r"s\.tsv: line 3: 1 columns, expected at least 2"):
        read_tsv(short, "en", "de")


def test_read_jsonl(tmp_path):
    rows = [{"document": "Long text.\nMore.", "summary": "Short.", "id": "1"}, {"document": "B", "summary": "b"}]
    path = write(tmp_path / "x.jsonl.gz", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_jsonl(path, "document", "summary") == [("Long text.\nMore.", "Short."), ("B", "b")]
    assert read_jsonl_rows(path) == rows
    with pytest.raises(DataError, match=r"x\.jsonl\.gz: line 2: no field 'id'"):
        read_jsonl(path, "document", "id")
    bad = write(tmp_path / "bad.jsonl", '{"src": "a", "tgt": "b"}\n{"src": "a", tgt\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2: not valid JSON"):
        read_jsonl(bad)
    typed = write(tmp_path / "typed.jsonl", '{"src": "a", "tgt": 3}\n')
    with pytest.raises(DataError, match="line 1: field 'tgt' is int, expected a string"):
        read_jsonl(typed)


def test_clean_pairs_drops_and_counts():
    pairs = [("a b", "x y"), ("", "x"), ("a", "  \t"), ("long " * 9, "y"), ("c", "z")]
    ids = [([1, 2], [3, 4]), ([], [5]), ([6], [7]), ([8] * 9, [9]), ([10], [11])]
    kept, stats = clean_pairs(pairs, ids, max_len=9)  # 9 tokens + EOS = 10 > 9
    assert kept == [0, 4]
    assert stats == {"empty": 2, "too_long": 1, "kept": 2}
    assert describe_clean_stats(stats, 9) == (
        "kept 2 of 5 pairs (dropped 2 with an empty side, 1 longer than 9 tokens)"
    )
    assert clean_pairs(pairs, ids, max_len=10)[1]["too_long"] == 0  # 9 + 1 fits exactly
    assert clean_pairs(pairs)[1] == {"empty": 2, "too_long": 0, "kept": 3}


# --- batching -------------------------------------------------------------------------------------


def lengths(n: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    src = [rng.randint(1, 60) for _ in range(n)]
    return src, [max(1, s + rng.randint(-5, 5)) for s in src]


def test_token_batches_budget_coverage_determinism():
    src, tgt = lengths(2000, 0)
    src[7] = 700  # longer than the whole budget: its own batch, not dropped
    budget = 512
    batches = token_batches(src, tgt, budget, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(2000))
    for b in batches:
        cost = len(b) * max(max(src[i], tgt[i]) + 1 for i in b)
        assert cost <= budget or b == [7]
    assert [7] in batches
    assert token_batches(src, tgt, budget, seed=3, epoch=0) == batches
    other = token_batches(src, tgt, budget, seed=3, epoch=1)
    assert other != batches and sorted(map(sorted, other)) != sorted(map(sorted, batches))
    # Batches are filled: on average well over half the budget is used.
    assert statistics.mean(len(b) * max(max(src[i], tgt[i]) + 1 for i in b) for b in batches) > 0.8 * budget


def test_token_batches_group_similar_lengths():
    src, tgt = lengths(2000, 1)
    batches = token_batches(src, tgt, 1024, seed=1, epoch=0)
    spread = statistics.mean(max(src[i] for i in b) - min(src[i] for i in b) for b in batches)
    rng = random.Random(0)
    perm = list(range(2000))
    rng.shuffle(perm)
    sizes = [len(b) for b in batches]
    random_batches, pos = [], 0
    for s in sizes:
        random_batches.append(perm[pos : pos + s])
        pos += s
    random_spread = statistics.mean(max(src[i] for i in b) - min(src[i] for i in b) for b in random_batches)
    assert spread < 0.25 * random_spread
    # Without shuffling: sorted, shortest first, and independent of seed and epoch.
    fixed = token_batches(src, None, 1024, seed=1, shuffle=False)
    assert fixed == token_batches(src, None, 1024, seed=9, epoch=4, shuffle=False)
    flat = [src[i] for b in fixed for i in b]
    assert flat == sorted(flat)


def test_collate_exact():
    batch = collate([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], indices=[4, 2])
    assert batch.src.tolist() == [[5, 6, 7, EOS_ID], [8, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 9, 10, PAD_ID], [BOS_ID, 11, 12, 13]]
    assert batch.tgt_out.tolist() == [[9, 10, EOS_ID, PAD_ID], [11, 12, 13, EOS_ID]]
    assert batch.src.dtype == torch.long and batch.ntokens == 7 and batch.indices == [4, 2]
    moved = batch.to("cpu")
    assert torch.equal(moved.tgt_out, batch.tgt_out) and moved.ntokens == 7 and len(moved) == 2


def test_lm_blocks_contiguous_and_deterministic():
    stream = torch.arange(1000) + 10  # value = position + 10: slices are easy to recognise
    L = 16
    blocks = lm_blocks(stream, L, seed=1, epoch=0)
    assert blocks.shape[1] == L + 1 and blocks.dtype == torch.long
    starts = sorted(int(b[0]) - 10 for b in blocks)
    for b in blocks:  # every block is a contiguous slice of the stream
        s = int(b[0]) - 10
        assert torch.equal(b, stream[s : s + L + 1])
    offset = starts[0]
    assert 0 <= offset < L and starts == list(range(offset, offset + L * len(starts), L))
    assert len(starts) == (1000 - offset - 1) // L
    assert torch.equal(lm_blocks(stream, L, seed=1, epoch=0), blocks)
    moved = [lm_blocks(stream, L, seed=1, epoch=e)[:, 0].sort().values[0].item() for e in range(1, 8)]
    assert len(set(moved) | {offset + 10}) > 1  # boundaries move between epochs
    assert not torch.equal(lm_blocks(stream, L, seed=1, epoch=1), blocks)
    ordered = lm_blocks(stream, L, shuffle=False)
    assert ordered[0].tolist() == stream[: L + 1].tolist() and ordered.shape[0] == 999 // L
    batches = lm_batches(blocks, batch_size=8)
    assert sum(len(b) for b in batches) == blocks.shape[0] and batches[0].src is None
    first = batches[0]
    assert torch.equal(first.tgt_in[:, 1:], first.tgt_out[:, :-1])  # target = input shifted by one
    assert torch.equal(first.tgt_in, blocks[:8, :-1]) and first.ntokens == 8 * L
    with pytest.raises(ValueError, match="shorter than one block"):
        lm_blocks(torch.arange(10), 16)


# --- known datasets -------------------------------------------------------------------------------


def shared_data_dir() -> Path | None:
    env = os.environ.get("AIAYN_DATA_DIR")
    candidate = Path(env) if env else REPO.parent / "shared" / "data"
    return candidate if (candidate / "multi30k").is_dir() else None


def test_multi30k_from_data_dir(monkeypatch):
    data_dir = shared_data_dir()
    if data_dir is None:
        pytest.skip("no shared data folder (set AIAYN_DATA_DIR or place it at ../shared/data)")
    monkeypatch.setenv("AIAYN_DATA_DIR", str(data_dir))
    pairs = datasets.multi30k_split("val", "en", "de")
    assert len(pairs) == 1014
    assert pairs[0][0] == "A group of men are loading cotton onto a truck"
    assert all(s and t for s, t in pairs)
    with pytest.raises(DataError, match="multi30k has no split 'dev'.*test_2016_flickr"):
        datasets.multi30k_split("dev")
    with pytest.raises(DataError, match=r"multi30k test_2017_mscoco has no language 'cs' \(languages: de, en, fr\)"):
        datasets.multi30k_split("test_2017_mscoco", "en", "cs")


@pytest.fixture
def fake_dataset(tmp_path, monkeypatch):
    """A known dataset 'toy' whose source is a file:// URL, with the cache in tmp_path."""
    (tmp_path / "remote").mkdir()
    source = write(tmp_path / "remote" / "toy.txt", "hi\n")
    good = hashlib.sha256(source.read_bytes()).hexdigest()
    monkeypatch.delenv("AIAYN_DATA_DIR", raising=False)
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(
        datasets.DATASETS, "toy", datasets.Dataset("toy-dir", {"toy.txt": datasets.RemoteFile(source.as_uri(), good)})
    )
    return source, good


def test_download_verifies_and_caches(fake_dataset, tmp_path, monkeypatch):
    source, _ = fake_dataset
    path = datasets.dataset_path("toy", "toy.txt")
    assert path == tmp_path / "cache" / "toy-dir" / "toy.txt" and path.read_text() == "hi\n"
    assert [p.name for p in path.parent.iterdir()] == ["toy.txt"]  # no temp file left behind
    # Cached: the source is not fetched again.
    monkeypatch.setattr(datasets, "fetch", lambda url, dest: pytest.fail("fetched again"))
    assert datasets.dataset_path("toy", "toy.txt") == path
    # A corrupted cache entry is fetched again.
    path.write_text("tampered")
    calls = []
    monkeypatch.setattr(datasets, "fetch", lambda url, dest: calls.append(url) or dest.write_bytes(b"hi\n"))
    assert datasets.dataset_path("toy", "toy.txt").read_text() == "hi\n" and calls == [source.as_uri()]


def test_download_checksum_mismatch(fake_dataset, tmp_path):
    source, good = fake_dataset
    source.write_text("changed upstream\n")
    with pytest.raises(DataError, match=f"sha256 mismatch \\(expected {good}, got [0-9a-f]{{64}}\\); the download"):
        datasets.dataset_path("toy", "toy.txt")
    leftovers = list((tmp_path / "cache").rglob("*"))
    assert all(p.is_dir() for p in leftovers)  # the bad download was deleted


def test_download_failure_and_unknown_names(fake_dataset, tmp_path, monkeypatch):
    monkeypatch.setitem(
        datasets.DATASETS,
        "toy",
        datasets.Dataset("toy-dir", {"toy.txt": datasets.RemoteFile((tmp_path / "gone.txt").as_uri(), "0" * 64)}),
    )
    with pytest.raises(DataError, match="cannot download file://.*gone.txt.*AIAYN_DATA_DIR"):
        datasets.dataset_path("toy", "toy.txt")
    with pytest.raises(DataError, match="unknown dataset 'wmt99'.*multi30k"):
        datasets.dataset_path("wmt99", "x")
    with pytest.raises(DataError, match="dataset multi30k has no file 'train.xx.gz'"):
        datasets.dataset_path("multi30k", "train.xx.gz")


def test_data_dir_missing_and_tampered(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAYN_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match=r"tinyshakespeare[/\\]input\.txt: no such file \(AIAYN_DATA_DIR is set"):
        datasets.tinyshakespeare_text()
    (tmp_path / "tinyshakespeare").mkdir()
    write(tmp_path / "tinyshakespeare" / "input.txt", "not it")
    with pytest.raises(DataError, match="sha256 mismatch.*replace it"):
        datasets.tinyshakespeare_text()
    assert (tmp_path / "tinyshakespeare" / "input.txt").exists()  # a user's file is never deleted


# The tokenized corpus: a token store in the cache ----------------------------------------------------------------


def test_the_cached_store_is_reused_and_replaced_by_new_text_tokenizer_or_damage(tmp_path, monkeypatch):
    """A config without data.prepared trains from a store in $AIAYN_CACHE_DIR/stores: a resume or another rank
    encodes nothing; new text or a new tokenizer gives another store; a damaged cached store is rebuilt, not
    trusted; a run that has its tokenizer (resume, --init-from) gets ids of that tokenizer even when the cache
    was emptied, and trains no other."""
    import shutil

    from aiayn.config import config_from_dict
    from aiayn.data import pipeline
    from aiayn.data.tokenizer import SentencePieceTokenizer

    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    rng = random.Random(0)
    lines = [" ".join(rng.choices(words, k=rng.randint(2, 6))) for _ in range(300)]
    for split, part in (("train", lines[:250]), ("valid", lines[250:])):
        (tmp_path / f"{split}.src").write_text("\n".join(part) + "\n", encoding="utf-8")
        (tmp_path / f"{split}.tgt").write_text("\n".join(" ".join(reversed(x.split())) for x in part) + "\n",
                                               encoding="utf-8")

    def cfg(vocab: int = 280):
        return config_from_dict({"data": {"train_src": str(tmp_path / "train.src"),
                                          "train_tgt": str(tmp_path / "train.tgt"),
                                          "valid_src": str(tmp_path / "valid.src"),
                                          "valid_tgt": str(tmp_path / "valid.tgt"), "vocab_size": vocab},
                                 "model": {"d_model": 32, "n_heads": 2, "d_ff": 64}})

    def stores():
        return sorted(p.name for p in (tmp_path / "cache" / "stores").iterdir())

    calls = []
    real = SentencePieceTokenizer.encode
    monkeypatch.setattr(SentencePieceTokenizer, "encode", lambda self, t: calls.append(t) or real(self, t))
    run = tmp_path / "run"
    first, _ = pipeline.build_translation_data(cfg(), run)
    assert len(calls) == 2 * 300 and len(stores()) == 1
    calls.clear()
    again, _ = pipeline.build_translation_data(cfg(), run)  # --resume, or another DDP rank
    assert calls == [] and again.src.path == first.src.path and len(stores()) == 1
    # new text: another store, encoded again
    (tmp_path / "train.src").write_text("\n".join(lines[:249] + ["golf hotel"]) + "\n", encoding="utf-8")
    newer, _ = pipeline.build_translation_data(cfg(), run)
    assert len(calls) == 2 * 300 and len(stores()) == 2 and newer.src.path != first.src.path
    # a new tokenizer (same text): another store
    calls.clear()
    shutil.rmtree(run / "tokenizer")
    pipeline.build_translation_data(cfg(290), run)
    assert len(calls) >= 2 * 300 and len(stores()) == 3  # (the tokenizer's own training may encode too)
    # a damaged cached store is rebuilt, not trusted
    ids = newer.src.path  # the store of the text as it now is, vocabulary 280
    ids.write_bytes(ids.read_bytes()[:-2])
    calls.clear()
    for vocab in (280, 290):
        pipeline.build_translation_data(cfg(vocab), tmp_path / f"other{vocab}")
    assert len(calls) == 2 * 300  # one of the two stores was rebuilt
    # the cache emptied under a run that has its tokenizer: a store of that tokenizer's ids, no tokenizer trained
    shutil.rmtree(tmp_path / "cache" / "stores")
    tokenizer = (run / "tokenizer" / "tokenizer.json").read_bytes()
    calls.clear()
    again, tok = pipeline.build_translation_data(cfg(290), run)
    assert len(calls) == 2 * 300 and (run / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer
    assert again.src[0] == tok.src.encode(lines[0])


def _reference_token_batches(src_lens, tgt_lens, max_tokens, seed, epoch, shuffle, pad_to_multiple, buckets):
    """token_batches as first written (Python's sort and a running maximum): the batches every earlier run was
    trained on, which the faster planning must reproduce exactly."""
    from aiayn.data.batching import _rng, padded_length

    true_len = [s + 1 for s in src_lens] if tgt_lens is None else [max(s, t) + 1 for s, t in zip(src_lens, tgt_lens)]
    padded = pad_to_multiple > 1 or bool(buckets)
    cost_len = [padded_length(c, pad_to_multiple, buckets) for c in true_len] if padded else true_len
    order = list(range(len(src_lens)))
    rng = _rng(seed, epoch)
    if shuffle:
        rng.shuffle(order)
    order.sort(key=(lambda i: (cost_len[i], true_len[i], src_lens[i])) if padded else
               (lambda i: (cost_len[i], src_lens[i])))
    batches, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, cost_len[i])
        if cur and (len(cur) + 1) * new_max > max_tokens:
            batches.append(cur)
            cur, new_max = [], cost_len[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    if shuffle:
        rng.shuffle(batches)
    return batches


def test_token_batches_plans_exactly_the_batches_of_the_reference_algorithm():
    rng = random.Random(5)
    for trial in range(150):
        n = rng.randint(0, 300)
        src = [rng.randint(0, 60) for _ in range(n)]
        tgt = None if trial % 5 == 0 else [rng.randint(0, 60) for _ in range(n)]
        args = (rng.choice([1, 50, 200, 1000]), trial, trial % 3, rng.random() < 0.8, rng.choice([1, 1, 8]),
                rng.choice([(), (), (16, 32, 48), (8, 64)]))
        want = _reference_token_batches(src, tgt, *args)
        got = token_batches(src, tgt, args[0], args[1], args[2], shuffle=args[3], pad_to_multiple=args[4],
                            buckets=args[5])
        assert got == want, (trial, args)


def test_corpora_of_a_million_pairs_and_more_plan_with_numpy_s_tie_break():
    """From NUMPY_TIE_BREAK_FROM examples the tie-break is numpy's permutation (Python's shuffle cost seconds per
    epoch at WMT14's size): still every example once, sorted within batches by length, under the budget,
    the same plan for the same (seed, epoch) and another for the next epoch. Smaller corpora keep Python's."""
    import numpy as np

    from aiayn.data.batching import NUMPY_TIE_BREAK_FROM, plan_batches

    n = NUMPY_TIE_BREAK_FROM + 7
    gen = np.random.default_rng(0)
    src, tgt = gen.integers(1, 60, n), gen.integers(1, 60, n)
    plan = plan_batches(src, tgt, 2048, seed=3, epoch=0)
    flat = np.concatenate(plan)
    assert len(flat) == n and np.array_equal(np.sort(flat), np.arange(n))
    longest = [int(np.maximum(src[b], tgt[b]).max()) + 1 for b in plan]
    assert all(len(b) * w <= 2048 for b, w in zip(plan, longest))
    again = plan_batches(src, tgt, 2048, seed=3, epoch=0)
    assert all(np.array_equal(a, b) for a, b in zip(plan, again)) and len(plan) == len(again)
    other = plan_batches(src, tgt, 2048, seed=3, epoch=1)
    assert not all(np.array_equal(a, b) for a, b in zip(plan, other))
    # exactly the plan of numpy's permutation sorted by np.lexsort, as first written (recorded runs trained on it)
    from aiayn.data.batching import _numpy_rng, _rng

    true_len = np.maximum(src, tgt) + 1
    order = _numpy_rng(3, 0).permutation(n)
    order = order[np.lexsort((src[order], true_len[order]))]
    cuts, size, widest = [], 0, 0
    for k, w in enumerate(true_len[order].tolist()):
        if size and (size + 1) * max(widest, w) > 2048:
            cuts.append(k)
            size, widest = 0, 0
        size, widest = size + 1, max(widest, w)
    want = np.split(order, cuts)
    _rng(3, 0).shuffle(want)
    assert len(want) == len(plan) and all(np.array_equal(a, b) for a, b in zip(plan, want))
    small = [int(x) for x in src[:1000]], [int(x) for x in tgt[:1000]]  # below the threshold: Python's shuffle
    assert token_batches(*small, 512, 3, 0) == _reference_token_batches(*small, 512, 3, 0, True, 1, ())
