"""LibreTranslate's routes answer as LibreTranslate (through Argos Translate) does (issue 71): a text is read as
paragraphs of sentences, each sentence translated alone with the splitter an Argos package ships and the
translations joined as Argos joins them (html: each text node so), the answer formatted as LibreTranslate formats
it; both switchable (``aiayn serve --no-split-sentences``, ``--no-libre-formatting``). ``/languages`` lists the
pairs served, html with alternatives is 200 with none, and LibreTranslate's limits are off unless set."""

from __future__ import annotations

import html

import pytest
from starlette.testclient import TestClient

import aiayn
from aiayn.interop.sentence_splitter import argos_join, split_sentences
from aiayn.serve.app import create_app
from aiayn.serve.batcher import Batching  # noqa: E402
from aiayn.serve.libretranslate import libre_format
from aiayn.serve.schemas import Limits
from aiayn.serve.service import Choices

pytestmark = pytest.mark.usefixtures("one_thread")
PARAGRAPH = "A b c d. B a d! Is c a b?\nd c b a."


@pytest.fixture(scope="module")
def translator(tiny_run):
    return aiayn.load(tiny_run, device="cpu")


def client(translator, **choices) -> TestClient:
    limits = choices.pop("limits", None)
    return TestClient(create_app(translator, batching=Batching(max_wait_ms=1.0), limits=limits,
                                 choices=Choices(**choices)),
                      base_url="http://localhost")


def nbest(translator, texts: list[str], n: int = 1) -> list[list[str]]:
    opts = translator.options(nbest=n, beam=max(n, translator.cfg.decode.beam)) if n > 1 else translator.options()
    return [[h.text for h in hyps] or [""] for hyps in translator.search(texts, opts, scores=False)]


def argos(translator, text: str, k: int = 0, n: int = 1) -> str:
    """``text`` translated as Argos does: each line's sentences alone (their k-th hypotheses), joined."""
    paragraphs = [split_sentences(p) for p in text.split("\n")]
    return argos_join([[h[min(k, len(h) - 1)] for h in nbest(translator, p, n)] if p else [] for p in paragraphs])


def test_libre_format_is_libretranslates_formatting():
    cases = [
        (("Hello!", "Hallo."), "Hallo!"),          # the source's final mark replaces the translation's
        (("Hello world.", "hallo Welt"), "Hallo Welt."),  # added, and the first letter's case carried
        (("hello", "Hallo."), "hallo"),            # no mark at the source's end: the translation's goes
        (("hello world", "Hallo Welt"), "hallo welt"),  # an all-lower-case source: all lower case
        (("HELLO", "Hallo"), "HALLO"),             # an all-upper-case source: all upper case
        (("Dog", "Hund Hund Hund Hund"), "Hund"),  # LibreTranslate's guard against one word repeated
        (("Dog", "der Hund"), "Der Hund"),
        (("  Hi. ", "Hallo"), "Hallo."),           # the source is read without its white space
        (("   ", "x"), ""),                        # an empty source: empty
        (("Hi", ""), "Hi"),                        # an empty translation: the source
        (("你好。", "Hello"), "Hello。"),
        (("123", "eins."), "eins"),                # no case in the source: the translation's kept
    ]
    for (source, translation), want in cases:
        assert libre_format(source, translation) == want, (source, translation)


def test_a_paragraph_is_translated_sentence_by_sentence_and_joined_as_argos_joins(translator):
    assert split_sentences(PARAGRAPH.split("\n")[0]) == ["A b c d.", "B a d!", "Is c a b?"]
    with client(translator) as c:
        r = c.post("/translate", json={"q": PARAGRAPH, "source": "en", "target": "de"})
        assert r.status_code == 200
        assert r.json() == {"translatedText": html.unescape(libre_format(PARAGRAPH, argos(translator, PARAGRAPH)))}
        # a list of texts: each so, in one model call with the others' sentences
        texts = [PARAGRAPH, "a b. c d.", "", "\nc a."]
        r = c.post("/translate", json={"q": texts, "source": "en", "target": "de"})
        assert r.json()["translatedText"] == [html.unescape(libre_format(t, argos(translator, t))) for t in texts]
    with client(translator, split_sentences=False, libre_formatting=False) as c:  # the switches: one sentence,
        r = c.post("/translate", json={"q": PARAGRAPH, "source": "en", "target": "de"})  # as the model writes it
        assert r.json() == {"translatedText": nbest(translator, [PARAGRAPH])[0][0]}
    with client(translator, libre_formatting=False) as c:
        r = c.post("/translate", json={"q": PARAGRAPH, "source": "en", "target": "de"})
        assert r.json() == {"translatedText": argos(translator, PARAGRAPH)}


def test_alternatives_join_each_sentences_hypotheses_as_argos(translator):
    q = "a b c. b c a."
    with client(translator, libre_formatting=False) as c:
        r = c.post("/translate", json={"q": q, "source": "en", "target": "de", "alternatives": 2}).json()
    hyps = [argos(translator, q, k, n=3) for k in range(3)]
    assert r["translatedText"] == hyps[0]
    assert r["alternatives"] == [h for i, h in enumerate(hyps[1:]) if h not in (hyps[0], "") and h not in hyps[1:i + 1]]


def test_html_text_nodes_are_split_into_sentences_and_alternatives_are_none(translator):
    doc = '<p class="x">A b c. B a d.</p>\n<ul><li>c d a</li></ul>'
    with client(translator) as c:
        r = c.post("/translate", json={"q": doc, "source": "en", "target": "de", "format": "html",
                                       "alternatives": 2})
        assert r.status_code == 200, r.text  # LibreTranslate: 200, with no alternatives for html
        first, second = argos(translator, "A b c. B a d."), argos(translator, "c d a")
        want = (f'<p class="x">{html.escape(first, quote=False)}</p>\n'
                f'<ul><li>{html.escape(second, quote=False)}</li></ul>')
        assert r.json() == {"translatedText": want, "alternatives": []}  # html: not formatted, as LibreTranslate
        r = c.post("/translate", json={"q": [doc, "<b>a</b>"], "source": "en", "target": "de", "format": "html",
                                       "alternatives": 1})
        assert r.status_code == 200 and r.json()["alternatives"] == [[], []]


def test_languages_settings_and_limits_as_libretranslate(translator):
    with client(translator) as c:
        assert c.get("/languages").json() == [{"code": "en", "name": "English", "targets": ["de", "en"]},
                                              {"code": "de", "name": "German", "targets": ["de"]}]
        for source, target in (("en", "en"), ("de", "de")):  # every pair /languages lists is served
            r = c.post("/translate", json={"q": "a b", "source": source, "target": target})
            assert r.status_code == 200 and r.json()["translatedText"] == "a b"
        settings = c.get("/frontend/settings").json()
        assert settings["charLimit"] == -1 and settings["language"]["source"] == {"code": "auto",
                                                                                  "name": "Auto Detect"}
        # no limit of characters or texts unless set (LibreTranslate's -1): 129 texts, a 2,400-character text
        r = c.post("/translate", json={"q": ["a b"] * 129, "source": "en", "target": "de"})
        assert r.status_code == 200 and len(r.json()["translatedText"]) == 129
        long = " ".join(["A b c d."] * 300)
        assert len(long) > 2400
        r = c.post("/translate", json={"q": long, "source": "en", "target": "de"})
        assert r.status_code == 200 and r.json()["translatedText"]
    with client(translator, limits=Limits(char_limit=20, batch_limit=2)) as c:
        assert c.get("/frontend/settings").json()["charLimit"] == 20
        r = c.post("/translate", json={"q": "a" * 21, "source": "en", "target": "de"})
        assert r.status_code == 400 and r.json() == {"error": "Invalid request: request (21) exceeds text limit (20)"}
        r = c.post("/translate", json={"q": ["a"] * 3, "source": "en", "target": "de"})
        assert r.status_code == 400 and r.json() == {"error": "Invalid request: request (3) exceeds text limit (2)"}
        assert c.post("/translate", json={"q": ["a b"] * 2, "source": "en", "target": "de"}).status_code == 200


def test_a_sentence_too_long_for_the_model_is_named_by_its_text(translator):
    with client(translator) as c:
        q = ["a b.", "a b. C " + "c " * (translator.max_source_tokens + 5)]
        r = c.post("/translate", json={"q": q, "source": "en", "target": "de"})
        assert r.status_code == 413 and r.json()["error"].startswith("q[1] sentence[1]:"), r.text
        assert c.post("/translate", json={"q": "a b", "source": "en", "target": "de"}).status_code == 200


def test_serve_flags_reach_the_routes_and_bad_limits_are_one_line(tiny_run, capsys):
    from aiayn import cli
    from aiayn.serve.server import ServeOptions

    args = cli.build_parser().parse_args(["serve", str(tiny_run), "--no-split-sentences", "--no-libre-formatting",
                                          "--char-limit", "5", "--batch-limit", "3"])
    assert (args.split_sentences, args.libre_formatting, args.char_limit, args.batch_limit) == (False, False, 5, 3)
    choices = ServeOptions(split_sentences=False, libre_formatting=False).choices()
    assert (choices.split_sentences, choices.libre_formatting) == (False, False)
    defaults = cli.build_parser().parse_args(["serve", str(tiny_run)])
    assert (defaults.split_sentences, defaults.libre_formatting, defaults.char_limit) == (True, True, -1)
    for flag, value in (("--char-limit", "0"), ("--batch-limit", "-2")):
        assert cli.main(["serve", str(tiny_run), flag, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "must be >= 1 (or -1: none)" in err, err
