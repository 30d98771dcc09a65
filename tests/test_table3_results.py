"""Table 3's results files: one reader for every file (a broken one is one line naming it, before any work), and
one table is one set of settings (a result of other settings is refused, naming the setting). (Issue 44.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from refusals import one_line, snapshot  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    """A tiny translation recipe on corpus files (nothing here trains: results are written by the test)."""
    for name in ("train.src", "train.tgt", "valid.src", "valid.tgt"):
        (tmp_path / name).write_text("a b c\n", encoding="utf-8")
    path = tmp_path / "base.yaml"
    path.write_text(f"""task: translation
model: {{d_model: 32, n_heads: 2, d_ff: 64, n_encoder_layers: 1, n_decoder_layers: 1, max_positions: 64}}
data: {{train_src: {tmp_path}/train.src, train_tgt: {tmp_path}/train.tgt, valid_src: {tmp_path}/valid.src,
       valid_tgt: {tmp_path}/valid.tgt, tokenizer: bpe, vocab_size: 300, src_lang: en, tgt_lang: en}}
train: {{max_updates: 12, threads: 1}}
decode: {{beam: 2}}
""", encoding="utf-8")
    return path


def _result(recipe: Path, row: str, seed: int = 1, **changes) -> dict:
    """A complete result of ``row`` as the runner writes it, with this recipe's settings."""
    from aiayn.config import load_config
    from aiayn.table3 import BY_NAME, _row_label, base_settings, row_config

    base = load_config(recipe)
    r = BY_NAME[row]
    rec = {"row": row, "group": r.group, "change": r.change, "seed": seed,
           "here": _row_label(r, row_config(recipe, r, seed), base), "updates": 12, "parameters": 50_000,
           "valid_nll": 2.0, "ppl": 7.389, "bleu": 10.0, "chrf": 30.0, "bleu_signature": "nrefs:1|case:mixed",
           "beam": 2, "train_s": 1.0, "eval_s": 1.0, "wall_s": 2.0, "threads": 1,
           "base_settings": base_settings(base)}
    rec.update(changes)
    return rec


def _write(out: Path, name: str, content) -> Path:
    import json

    path = out / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return path


@pytest.mark.parametrize("content, word", [
    (bytes(range(256)) * 4, "not UTF-8 text"),
    (b'{"row": "base", "seed": 1, "ppl"', "not JSON"),
    (b"[1, 2, 3]", "a JSON list, not an object"),
    ({"row": "base", "seed": 1}, "its field 'group' is missing"),
    ("bleu", "its field 'bleu' is not a number"),
    ("row", "holds row 'D3' seed 1, not the row and seed its name says"),
], ids=["random bytes", "partial JSON", "a list", "missing fields", "bleu a string", "another row's file"])
def test_a_broken_result_is_one_line_naming_it_before_any_work(content, word, recipe, tmp_path, capsys):
    out = tmp_path / "table"
    if content == "bleu":
        content = _result(recipe, "base", bleu="high")
    elif content == "row":
        content = _result(recipe, "D3")
    path = _write(out, "base-seed1.json", content)
    before = snapshot(out)
    line = one_line(capsys, ["table3", str(recipe), "--out", str(out), "--rows", "D3"])
    assert f"{path}: " in line and word in line and "delete it" in line
    assert snapshot(out) == before  # nothing trained, prepared or written


def test_a_result_of_other_settings_is_refused_naming_the_setting(recipe, tmp_path, capsys):
    out = tmp_path / "table"
    _write(out, "base-seed1.json", _result(recipe, "base"))
    path = _write(out, "D3-seed1.json", _result(recipe, "D3"))
    # the same settings: both rows are done, the table is written from them without training anything
    from aiayn.table3 import run_table

    table = run_table(recipe, out, rows="D3", seeds=[1], extra=["train.threads=1"])  # threads: not a setting
    assert [r["row"] for r in table["rows"]] == ["base", "D3"] and not (out / "runs").exists()
    # a rerun with another --set: refused at once, naming the file and the setting, nothing written
    before = snapshot(out)
    line = one_line(capsys, ["table3", str(recipe), "--out", str(out), "--rows", "D3", "--set", "train.lr_scale=2"])
    assert "-seed1.json: made with train.lr_scale=1.0, this table has train.lr_scale=2.0" in line
    line = one_line(capsys, ["table3", str(recipe), "--out", str(out), "--rows", "D3", "--set", "decode.beam=5"])
    assert "made with decode.beam=2, this table has decode.beam=5" in line
    assert snapshot(out) == before
    # a runner of other settings on the same --out wrote one (two runners, two --set): the table names it
    other = _result(recipe, "D3")
    other["base_settings"]["model.dropout"] = 0.3
    path.write_text(__import__("json").dumps(other), encoding="utf-8")
    line = one_line(capsys, ["table3", str(recipe), "--out", str(out), "--rows", "D3"])
    assert f"{path}: made with model.dropout=0.3, this table has model.dropout=0.1" in line
