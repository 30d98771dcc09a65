"""The Task table (aiayn/task.py): what each ``task:`` means, asked through ``cfg.kind`` instead of comparing the
name (issue 63)."""

from __future__ import annotations

import pytest

from aiayn.config import Config, DataConfig, ModelConfig
from aiayn.errors import ConfigError
from aiayn.task import TASKS, task_named


def test_each_task_answers_what_was_asked_by_name():
    t, s, lm = TASKS["translation"], TASKS["summarization"], TASKS["lm"]
    assert (t.encoder, s.encoder, lm.encoder) == (True, True, False)
    assert (t.translates, s.translates, lm.translates) == (True, False, False)
    assert (t.corpora, s.corpora, lm.corpora) == (("pairs", "pairs"), ("documents", "documents"), ("stream", "rows"))
    assert (t.valid_scores, s.valid_scores, lm.valid_scores) == (("bleu",), ("bleu",), ())
    assert (t.weights_scores, s.weights_scores, lm.weights_scores) == (("bleu",), (), ())
    assert (t.loader, s.loader, lm.loader) == ("translator", "translator", "generator")
    assert dict(lm.decoding) == {"sample": True, "temperature": 1.0} and not t.decoding and not s.decoding
    assert (t.evaluator, s.evaluator, lm.evaluator) == ("pairs", "summaries", "language_model")
    assert (t.extra_scores, s.extra_scores, lm.extra_scores) == ((), ("rouge",), ())


def test_every_evaluator_and_validation_score_a_task_names_is_there():
    from aiayn.eval.evaluate import EVALUATORS
    from aiayn.train.validation import VALID_SCORES

    assert {t.evaluator for t in TASKS.values()} <= set(EVALUATORS)
    assert {n for t in TASKS.values() for n in t.valid_scores + t.weights_scores} <= set(VALID_SCORES)
    # which tasks each export takes: the export targets declare it (tests/test_export_registry.py); which route
    # serves each: the server maps it (tests/test_serve.py)


def test_a_config_resolves_its_task_and_refuses_an_unknown_one():
    assert Config(task="lm").kind is TASKS["lm"] is task_named("lm")
    assert Config().kind is TASKS["translation"] and str(Config().kind) == "translation"
    with pytest.raises(ConfigError, match="task='speech': expected one of translation, lm, summarization"):
        Config(task="speech")


def test_the_language_model_default_decoding_is_the_one_generate_uses():
    from aiayn.config import DecodeOptions

    opts = DecodeOptions().replace(**{**TASKS["lm"].decoding, "temperature": 0.7})
    assert opts.sample and opts.temperature == 0.7


def test_each_task_refuses_the_work_it_does_not_do_in_its_own_words():
    t, s, lm = TASKS["translation"], TASKS["summarization"], TASKS["lm"]
    for kind, work in ((lm, "table3"), (s, "table3"), (lm, "sweep"), (s, "sweep"), (t, "generate"),
                       (s, "generate"), (t, "load_generator"), (s, "load_generator"), (t, "summarize")):
        with pytest.raises(ConfigError, match=f"^runs/x.* {kind.name}"):
            kind.check_does(work, "runs/x")
    for kind, work in ((t, "table3"), (t, "sweep"), (lm, "generate"), (lm, "load_generator"), (s, "summarize"),
                       (lm, "summarize")):
        kind.check_does(work, "runs/x")  # no refusal
    with pytest.raises(ConfigError, match="^runs/x is a translation run: `aiayn generate` needs a language model"):
        t.check_does("generate", "runs/x")


def test_a_task_checks_the_config_fields_whose_meaning_is_its_own():
    with pytest.raises(ConfigError, match="data.pretokenize='moses' is for translation, not task lm"):
        Config(task="lm", data=DataConfig(pretokenize="moses"))
    with pytest.raises(ConfigError, match="data.shared_vocab=false needs model.share_embeddings=false"):
        TASKS["summarization"].check_config("none", False, True)
    TASKS["lm"].check_config("none", False, True)


def test_a_config_reads_and_batches_the_corpus_its_task_and_dataset_make():
    from aiayn.data.pipeline import CORPORA, DOCUMENTS, PAIRS, ROWS, STREAM, corpus_of

    def cfg(task: str, **data) -> Config:
        return Config(task=task, data=DataConfig(**data))

    assert corpus_of(cfg("translation")) is PAIRS and corpus_of(cfg("translation", format="jsonl")) is PAIRS
    assert corpus_of(cfg("summarization", dataset="xsum")) is corpus_of(cfg("summarization")) is DOCUMENTS
    assert corpus_of(cfg("lm", dataset="tinyshakespeare")) is STREAM
    assert corpus_of(cfg("lm", dataset="xsum")) is ROWS and corpus_of(cfg("lm", format="jsonl")) is ROWS
    assert {c for t in TASKS.values() for c in t.corpora} == set(CORPORA)
    assert not PAIRS.fixed_shapes(cfg("translation")) and PAIRS.fixed_shapes(cfg("translation", length_buckets=[32]))
    assert DOCUMENTS.build is PAIRS.build and DOCUMENTS.check is PAIRS.check  # documents are pairs, cut to fit
    assert STREAM.fixed_shapes(cfg("lm")) and not ROWS.fixed_shapes(cfg("lm", dataset="xsum"))
    with pytest.raises(ConfigError, match="^a language-model corpus is a token stream, not pairs$"):
        from aiayn.data.pipeline import pair_sources

        pair_sources(cfg("lm", dataset="tinyshakespeare"))


def test_a_server_refuses_a_route_in_the_words_of_the_task_it_runs():
    t, s, lm = TASKS["translation"], TASKS["summarization"], TASKS["lm"]
    assert lm.refusal("libretranslate") == ("this server runs a lm run; LibreTranslate's API needs a translation run "
                                            "(language models answer /v1/completions)")
    assert s.refusal("libretranslate").startswith("this server runs a summarization run;")
    assert t.refusal("lm_route", "/tokenize") == "/tokenize needs a language-model run; this server runs a " \
                                                 "translation run"
    assert s.refusal("completions") == ("this server runs a summarization run; completions need a language model "
                                        "or a translation run")
    assert t.refusal("libretranslate") is lm.refusal("lm_route", "/tokenize") is t.refusal("completions") is None


def test_summaries_come_from_what_the_run_was_trained_on():
    from types import SimpleNamespace

    from aiayn.decode.generate import SUMMARIZERS, summarize, summarize_lm, summarize_seq2seq

    assert {k: (v.run, v.greedy) for k, v in SUMMARIZERS.items()} == {"rows": (summarize_lm, True),
                                                                      "documents": (summarize_seq2seq, False)}

    def run(task: str, **data) -> SimpleNamespace:
        return SimpleNamespace(cfg=Config(task=task, data=DataConfig(**data)), path="runs/x")

    with pytest.raises(ConfigError, match="^runs/x is a language model of running text, .* it cannot summarize$"):
        summarize(run("lm", dataset="tinyshakespeare"), ["a document"])
    with pytest.raises(ConfigError, match="^a language-model run summarizes greedily"):
        summarize(run("lm", dataset="xsum"), ["a document"], beam=4)
    with pytest.raises(ConfigError, match="^runs/x is a translation run: use `aiayn translate`$"):
        summarize(run("translation"), ["a document"])


def test_only_an_encoder_decoder_training_starts_from_a_run_of_its_own_task():
    assert TASKS["lm"].refusal("init_from") == "language models: not supported"
    assert TASKS["translation"].refusal("init_from") is TASKS["summarization"].refusal("init_from") is None


def test_a_summarizer_s_store_cuts_the_documents_a_translation_s_store_drops(tmp_path):
    """The corpus a task names decides what a store does with a source too long for the model: a translation's
    pairs drop it, a summarizer's documents (:data:`aiayn.data.pipeline.DOCUMENTS`) keep it, cut to fit."""
    from aiayn.data.pipeline import corpus_recipe
    from aiayn.data.store import prepare_store

    files = {}
    for split, n in (("train", 40), ("valid", 6)):
        for side, text in (("src", lambda i: "abcdefgh " * (1 + 6 * (i % 4 == 0))), ("tgt", lambda i: "hgf")):
            path = tmp_path / f"{split}.{side}"
            path.write_text("".join(text(i) + "\n" for i in range(n)), encoding="utf-8")
            files[f"{split}_{side}"] = str(path)
    stats = {}
    for task in ("translation", "summarization"):
        cfg = Config(task=task, model=ModelConfig(max_positions=24), data=DataConfig(**files, tokenizer="char"))
        store = prepare_store(tmp_path / task, corpus_recipe(cfg, workers=1))
        stats[task] = store.manifest["splits"]["train"]["pairs"], int(store.splits["train"].src.lengths().max())
    assert stats == {"translation": (30, 9), "summarization": (40, 23)}  # 23: the source, room for its EOS
