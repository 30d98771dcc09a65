"""``aiayn serve`` answers as a real LibreTranslate server does (issue 71): the same run, exported as an Argos
package and served by LibreTranslate (offline, float32 as exported), and served by ``aiayn serve`` with Argos'
search, give the same answers to 20 paragraphs of 2-4 sentences (some lower case, some html, some of two lines),
to a list, to alternatives and to ``/languages``, through HTTP and through libretranslatepy.

LibreTranslate runs from a separate environment (benchmarks/libretranslate_peer.py says how to make one):
``AIAYN_LIBRETRANSLATE`` names its ``libretranslate`` executable; without it the test is skipped, saying so."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest

pytest.importorskip("starlette")
from benchmarks import libretranslate_peer  # noqa: E402

LIBRETRANSLATE, WHY_NOT = libretranslate_peer.executable()
pytestmark = pytest.mark.skipif(LIBRETRANSLATE is None, reason=WHY_NOT)

from conftest import PAIRS  # noqa: E402  (tests/ is on sys.path under pytest)
from starlette.testclient import TestClient  # noqa: E402

import aiayn  # noqa: E402
from aiayn.interop.argos import ARGOS_FLAGS, ARGOS_SEARCH  # noqa: E402
from aiayn.serve.app import create_app  # noqa: E402
from aiayn.serve.batcher import Batching  # noqa: E402
from aiayn.serve.service import Choices  # noqa: E402


def paragraphs() -> list[str]:
    """20 paragraphs of the learned sentences: 2-4 sentences each; every fifth lower case (not split: no sentence
    starts), html, or two lines."""
    rng, sentences = random.Random(0), [src for src, _ in PAIRS]
    out = []
    for i in range(20):
        chosen = rng.sample(sentences, rng.randint(2, 4))
        text = " ".join(chosen)
        text = {1: text.lower(), 2: f"<p>{text}</p>", 3: chosen[0] + "\n" + " ".join(chosen[1:])}.get(i % 5, text)
        out.append(text)
    return out


@pytest.fixture(scope="module")
def libretranslate(learned_run, tmp_path_factory):
    """A LibreTranslate server with the run's Argos package installed, offline (Argos' index: a local empty one),
    computing in float32 as aiayn does; its URL."""
    peer = libretranslate_peer.start(learned_run, tmp_path_factory.mktemp("libretranslate"), LIBRETRANSLATE,
                                     ("en", "de"), {"ARGOS_COMPUTE_TYPE": "float32", "ARGOS_INTRA_THREADS": "1"})
    try:
        yield peer.url
    finally:
        peer.stop()


@pytest.fixture(scope="module")
def aiayn_server(learned_run):
    model = aiayn.load(learned_run, device="cpu")
    with TestClient(create_app(model, batching=Batching(max_wait_ms=1.0), choices=Choices(decode=dict(ARGOS_SEARCH))),
                    base_url="http://localhost") as c:
        yield c


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/translate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=300).read())


def test_aiayn_serve_answers_as_a_real_libretranslate_server(libretranslate, aiayn_server):
    texts = paragraphs()
    assert all(2 <= t.count(".") + t.count("!") + t.count("?") <= 4 for t in texts)
    equal = []
    for text in texts:
        body = {"q": text, "source": "en", "target": "de", "format": "html" if text.startswith("<") else "text"}
        equal.append(post(libretranslate, body) == aiayn_server.post("/translate", json=body).json())
    assert sum(equal) >= 19, [t for t, same in zip(texts, equal) if not same]
    for body in ({"q": texts[:4], "source": "en", "target": "de"},
                 {"q": texts[0], "source": "auto", "target": "de", "alternatives": 2},
                 {"q": texts[2], "source": "en", "target": "de", "format": "html", "alternatives": 1}):
        assert post(libretranslate, body) == aiayn_server.post("/translate", json=body).json(), body
    get = json.loads(urllib.request.urlopen(libretranslate + "/languages").read())
    assert get == aiayn_server.get("/languages").json()
    theirs = json.loads(urllib.request.urlopen(libretranslate + "/frontend/settings").read())
    ours = aiayn_server.get("/frontend/settings").json()
    differ = {k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k)}
    assert differ <= {"filesTranslation", "supportedFilesFormat"}, differ  # aiayn has no /translate_file


def test_libretranslatepy_gets_the_same_from_both(libretranslate, learned_run):
    lt_mod = pytest.importorskip("libretranslatepy")
    from benchmarks import serve_load

    proc, url, _ = serve_load.start_server(learned_run, *ARGOS_FLAGS.split())
    try:
        theirs, ours = lt_mod.LibreTranslateAPI(libretranslate + "/"), lt_mod.LibreTranslateAPI(url + "/")
        for text in paragraphs()[:10]:
            assert theirs.translate(text, "en", "de") == ours.translate(text, "en", "de"), text
        assert theirs.languages() == ours.languages()
    finally:
        serve_load.stop_server(proc, timeout=30)


def test_serve_load_measures_the_real_libretranslate_server_as_its_peer(learned_run, tmp_path):
    from benchmarks import serve_load

    md, out = tmp_path / "B.md", tmp_path / "serve_load.json"
    result = serve_load.main(["--run", str(learned_run), "--smoke", "--md", str(md), "--out-json", str(out)])
    peer = result["peer"]
    assert peer["name"] == "LibreTranslate" and peer["versions"]["libretranslate"]
    assert peer["exit_status"] in (0, -15)  # LibreTranslate (waitress) does not catch SIGTERM: it dies of it
    assert [p["clients"] for p in peer["phases"]] == [p["clients"] for p in result["phases"]] == [1, 4]
    for p in result["phases"] + peer["phases"]:
        assert p["ok"] > 0 and p["errors"] == {}, p
    text = md.read_text(encoding="utf-8")
    assert "| LibreTranslate | 4 |" in text and "x LibreTranslate's" in text
