"""``aiayn serve`` answers as a real LibreTranslate server does (issue 71): the same run, exported as an Argos
package and served by LibreTranslate (offline, float32 as exported), and served by ``aiayn serve`` with Argos'
search, give the same answers to 20 paragraphs of 2-4 sentences (some lower case, some html, some of two lines),
to a list, to alternatives and to ``/languages``, through HTTP and through libretranslatepy.

LibreTranslate is not one of aiayn's dependencies (it pins Flask, numpy and packaging versions of its own), so it
runs from a separate environment: ``AIAYN_LIBRETRANSLATE`` names its ``libretranslate`` executable, e.g.

    python -m venv /tmp/lt && echo "$(python -c 'import site; print(site.getsitepackages()[0])')" \\
        > /tmp/lt/lib/python3.11/site-packages/aiayn_venv.pth && /tmp/lt/bin/pip install libretranslate==1.9.6
    AIAYN_LIBRETRANSLATE=/tmp/lt/bin/libretranslate pytest tests/test_libretranslate_server.py

(about 2 minutes to install; the test then runs offline). Without it the test is skipped, saying so."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette")
LIBRETRANSLATE = os.environ.get("AIAYN_LIBRETRANSLATE", "")
pytestmark = pytest.mark.skipif(
    not (LIBRETRANSLATE and Path(LIBRETRANSLATE).is_file()),
    reason="needs a LibreTranslate server: set AIAYN_LIBRETRANSLATE to the libretranslate executable of a separate "
           "environment (pip install libretranslate==1.9.6; see this file's docstring)")

from conftest import PAIRS  # noqa: E402  (tests/ is on sys.path under pytest)
from starlette.testclient import TestClient  # noqa: E402

import aiayn  # noqa: E402
from aiayn.interop.argos import ARGOS_FLAGS, ARGOS_SEARCH, export_argos  # noqa: E402
from aiayn.serve.app import create_app  # noqa: E402
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
    root = tmp_path_factory.mktemp("libretranslate")
    package = export_argos(learned_run, root / "en_de.argosmodel")
    (root / "index").mkdir()
    (root / "index" / "index.json").write_text("[]")
    home = root / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARGOS_", "XDG_", "PYTHONPATH"))}
    env.update(HOME=str(home), XDG_DATA_HOME=str(home / "data"), XDG_CACHE_HOME=str(home / "cache"),
               XDG_CONFIG_HOME=str(home / "config"), ARGOS_DEVICE_TYPE="cpu", ARGOS_COMPUTE_TYPE="float32",
               ARGOS_PACKAGE_INDEX=f"file://{root}/index/", ARGOS_INTRA_THREADS="1")
    python = Path(LIBRETRANSLATE).with_name("python")
    subprocess.run([str(python), "-c", f"from argostranslate.package import install_from_path; "
                                       f"install_from_path({str(package)!r})"], env=env, check=True, timeout=300)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "libretranslate.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([LIBRETRANSLATE, "--host", "127.0.0.1", "--port", str(port), "--load-only", "en,de",
                             "--disable-web-ui"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail("LibreTranslate stopped: " + (root / "libretranslate.log").read_text()[-2000:])
            try:
                urllib.request.urlopen(url + "/languages", timeout=2).read()
                break
            except OSError:
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def aiayn_server(learned_run):
    model = aiayn.load(learned_run, device="cpu")
    with TestClient(create_app(model, max_wait_ms=1.0, choices=Choices(decode=dict(ARGOS_SEARCH))),
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
