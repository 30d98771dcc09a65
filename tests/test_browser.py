"""The attention explorer page in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
driven through Selenium: type a sentence, wait for the translation, read the heatmap cells (their
data-row / data-col / data-weight), change the head, hover and use the keyboard. ``make test-browser``
installs what it needs and runs this file; without chromium, chromedriver or selenium it is skipped.

Environment: ``AIAYN_BROWSER_RUN`` serves that run instead of the tiny test run; ``AIAYN_SCREENSHOT``
is where the screenshot goes (default: the test's temporary folder). docs/images/serve.png is made with
``AIAYN_BROWSER_RUN=runs/multi30k_en_de_quick AIAYN_SCREENSHOT=docs/images/serve.png make test-browser``.
"""

from __future__ import annotations

import os
import shutil
from contextlib import closing
from pathlib import Path

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SENTENCE = "A little girl is playing with a dog in the park."

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                       reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                              "make test-browser installs them"),
]
selenium = pytest.importorskip("selenium", reason="needs selenium: make test-browser installs it")
pytest.importorskip("uvicorn", reason="needs the serve extra")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from benchmarks import serve_load  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_run):
    run = os.environ.get("AIAYN_BROWSER_RUN") or tiny_run
    proc, url, log = serve_load.start_server(run)
    yield url
    assert serve_load.stop_server(proc) == 0, "\n".join(log)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never try to download a driver
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1400",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def lm_server(lm_run):
    proc, url, log = serve_load.start_server(lm_run)
    yield url
    assert serve_load.stop_server(proc) == 0, "\n".join(log)


def _cells(driver, kind: str) -> dict[tuple[int, int], float]:
    """{(row, col): weight} of one heatmap, read from the cells' data attributes in one script call."""
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll(`svg[data-kind='${arguments[0]}'] rect.cell`))"
        ".map(r => [Number(r.dataset.row), Number(r.dataset.col), Number(r.dataset.weight)]);", kind)
    return {(r, c): w for r, c, w in rows}


def _api(url: str, path: str, body: dict) -> dict:
    with closing(serve_load.connect(url)) as conn:
        status, out = serve_load.request(conn, "POST", path, body)
    assert status == 200, out
    return out


def test_type_translate_see_heatmaps_change_head(server, browser, tmp_path):
    wait = WebDriverWait(browser, 60)
    browser.get(server + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    # Accessible form: the text box and the selects have labels.
    for control in ("src", "beam", "layer", "head"):
        assert browser.find_element(By.CSS_SELECTOR, f"label[for='{control}']").text

    box = browser.find_element(By.ID, "src")
    box.clear()
    box.send_keys(SENTENCE)
    browser.find_element(By.ID, "submit").click()
    wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-state") in ("done", "error"))
    assert browser.find_element(By.ID, "error").get_attribute("hidden"), browser.find_element(By.ID, "error").text
    shown = browser.find_element(By.ID, "output").text

    # The page shows what the API answers for the same request (beam 4, the page's default).
    api = _api(server, "/v1/translate", {"text": [SENTENCE], "beam": 4, "nbest": 1})["translations"][0]
    # Compared with whitespace folded: the toy run may answer with pieces that decode to spaces only, which
    # the page keeps (white-space: pre-wrap) and the API returns as they are.
    assert " ".join(shown.split()) == " ".join(api["text"].split())
    maps = _api(server, "/v1/attention", {"text": SENTENCE, "target": api["text"]})["attention"]

    for kind in ("encoder", "decoder_self", "cross"):
        assert browser.find_element(By.CSS_SELECTOR, f"svg[data-kind='{kind}']").get_attribute("aria-label")
    cross = _cells(browser, "cross")
    n_rows, n_cols = len(maps["cross"]["queries"]), len(maps["cross"]["keys"])
    assert n_rows == len(api["tokens"]) + 1  # <s> + the target pieces
    assert set(cross) == {(r, c) for r in range(n_rows) for c in range(n_cols)}  # target x source
    for r in range(n_rows):
        assert sum(cross[r, c] for c in range(n_cols)) == pytest.approx(1.0, abs=1e-3)
    layer = int(Select(browser.find_element(By.ID, "layer")).first_selected_option.get_attribute("value"))
    assert cross[0, 0] == pytest.approx(maps["cross"]["weights"][layer][0][0][0])

    # Another head: new cells, the API's numbers for that head.
    Select(browser.find_element(By.ID, "head")).select_by_value("1")
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "svg[data-kind='cross'][data-head='1']")))
    head1 = _cells(browser, "cross")
    assert head1 != cross and set(head1) == set(cross)
    want = maps["cross"]["weights"][layer][1]
    assert all(head1[r, c] == pytest.approx(want[r][c]) for r, c in head1)
    # The head average: rows still sum to 1.
    Select(browser.find_element(By.ID, "head")).select_by_value("avg")
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "svg[data-kind='cross'][data-head='avg']")))
    avg = _cells(browser, "cross")
    heads = maps["cross"]["weights"][layer]
    assert avg[0, 0] == pytest.approx(sum(h[0][0] for h in heads) / len(heads), abs=1e-6)
    assert sum(avg[0, c] for c in range(n_cols)) == pytest.approx(1.0, abs=1e-3)

    # Hover shows the weight; the arrow keys move through the cells of a focused map.
    cell = browser.find_element(By.CSS_SELECTOR, "svg[data-kind='cross'] rect[data-row='0'][data-col='1']")
    ActionChains(browser).move_to_element(cell).perform()
    tip = browser.find_element(By.ID, "tooltip")
    wait.until(lambda d: tip.is_displayed())
    assert f"{avg[0, 1]:.4f}" in tip.text
    svg = browser.find_element(By.CSS_SELECTOR, "svg[data-kind='cross']")
    browser.execute_script("arguments[0].focus()", svg)
    ActionChains(browser).send_keys(Keys.ARROW_DOWN).perform()
    info = browser.find_element(By.ID, "cell-info").text
    assert "(row 1)" in info and "(column 1)" in info and f"{avg[1, 1]:.4f}" in info

    # Back to one head for the picture; the screenshot shows the page as a user sees it.
    Select(browser.find_element(By.ID, "head")).select_by_value("0")
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "svg[data-kind='cross'][data-head='0']")))
    out = Path(os.environ.get("AIAYN_SCREENSHOT") or tmp_path / "serve.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, min(max(900, height + 40), 2400))
    png = tmp_path / "page.png"
    assert browser.save_screenshot(str(png)) and png.stat().st_size > 10_000
    shutil.copyfile(png, out)


def test_errors_show_on_the_page(server, browser):
    wait = WebDriverWait(browser, 30)
    browser.get(server + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    # A sentence over the server's 2,000 characters: the server's one-line message shows in the alert.
    browser.execute_script("arguments[0].value = 'a '.repeat(1001)", browser.find_element(By.ID, "src"))
    browser.find_element(By.ID, "submit").click()
    wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-state") == "error")
    err = browser.find_element(By.ID, "error")
    assert err.get_attribute("role") == "alert" and err.is_displayed()
    assert err.text == "line_too_long: text[0]: 2002 characters, the limit is 2000"


def test_the_page_explains_itself_and_shows_every_head(server, browser):
    """The labels say what a row is (decoder: input -> the token it predicts), the legend says what the marks
    mean, the model view holds one small map per layer and head (a click shows it large), and an error clears
    the previous sentence's maps."""
    wait = WebDriverWait(browser, 60)
    browser.get(server + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    legend = browser.find_element(By.ID, "token-legend").text
    assert "\u2581" in legend and "predict" in legend and "\u21b5" in legend
    assert "/" not in browser.find_element(By.ID, "model-info").text  # the run's name, no path of the server
    box = browser.find_element(By.ID, "src")
    box.clear()
    box.send_keys(SENTENCE)
    browser.find_element(By.ID, "submit").click()
    wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-state") == "done")
    maps = _api(server, "/v1/attention", {"text": SENTENCE,
                                          "target": _api(server, "/v1/translate", {"text": [SENTENCE], "beam": 4})
                                          ["translations"][0]["text"]})["attention"]
    cross = maps["cross"]
    assert cross["predicts"] == cross["queries"][1:] + ["</s>"] and maps["encoder"]["predicts"] is None
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll(\"svg[data-kind='cross'] > text[text-anchor='end']\"))"
        ".map(t => t.textContent);")
    assert len(rows) == len(cross["queries"]) and all(" \u2192 " in r for r in rows)
    assert rows[0].startswith("<s> \u2192 ") and rows[-1].endswith("\u2192 </s>")

    # The model view: layers x heads thumbnails per kind; a click shows that layer and head large.
    L, H = cross["layers"], cross["heads"]
    thumbs = browser.find_elements(By.CSS_SELECTOR, "button.thumb[data-kind='cross']")
    assert len(thumbs) == L * H
    target = browser.find_element(By.CSS_SELECTOR,
                                  f"button.thumb[data-kind='cross'][data-layer='0'][data-head='{H - 1}']")
    browser.execute_script("arguments[0].click()", target)
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, f"svg[data-kind='cross'][data-head='{H - 1}']")))
    big = browser.find_element(By.CSS_SELECTOR, "svg[data-kind='cross']")
    assert big.get_attribute("data-layer") == "0"
    assert _cells(browser, "cross")[0, 0] == pytest.approx(cross["weights"][0][H - 1][0][0])
    pressed = browser.find_element(By.CSS_SELECTOR, "button.thumb[data-kind='cross'][aria-pressed='true']")
    assert (pressed.get_attribute("data-layer"), pressed.get_attribute("data-head")) == ("0", str(H - 1))

    # An error: the old maps are gone with it.
    browser.execute_script("arguments[0].value = 'a '.repeat(1001)", browser.find_element(By.ID, "src"))
    browser.find_element(By.ID, "submit").click()
    wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-state") == "error")
    assert browser.find_elements(By.CSS_SELECTOR, "#maps svg, #model-view button.thumb") == []


def test_a_language_model_page_continues_a_prompt(lm_server, browser):
    """The page reads what the run offers from /v1/model (its route, architecture and words), not its task's name:
    a language model's page asks for a prompt, takes new tokens rather than a beam, continues the prompt through
    /v1/generate and labels its one map's axes as tokens."""
    wait = WebDriverWait(browser, 60)
    browser.get(lm_server + "/")
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    assert browser.find_element(By.ID, "src-label").text == "Prompt"
    assert browser.find_element(By.ID, "submit").text == "Continue"
    assert not browser.find_element(By.ID, "beam-field").is_displayed()
    assert browser.find_element(By.ID, "new-tokens-field").is_displayed()
    box = browser.find_element(By.ID, "src")
    box.clear()
    box.send_keys("the cat")
    browser.find_element(By.ID, "submit").click()
    wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-state") in ("done", "error"))
    assert browser.find_element(By.ID, "error").get_attribute("hidden"), browser.find_element(By.ID, "error").text
    assert browser.find_element(By.ID, "output").text.startswith("the cat")
    note = browser.find_element(By.CSS_SELECTOR, "#map-decoder_self .axis-note").text
    assert note == "rows: token \u2192 the token it predicts (queries), columns: token (keys)"
    assert not browser.find_elements(By.CSS_SELECTOR, "svg[data-kind='cross']")
