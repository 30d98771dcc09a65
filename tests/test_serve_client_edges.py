"""The clients' edges of ``aiayn serve`` (issue 62): LibreTranslate's multipart forms, its keyless ``/languages`` and
its html kept byte for byte; OpenAI's completions without a prompt, with an empty one, past the context (the
error's ``code`` and ``param``, and what a client can do: ``max_tokens``, vLLM's ``truncate_prompt_tokens``), vLLM's
sampling extras (``top_k``, ``min_p``, ``repetition_penalty``, sent by the openai package's ``extra_body``), the
chat route's ``param`` of an unknown field, and LangChain's batch of 80 prompts. Each case failed before."""

from __future__ import annotations

import html

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

import aiayn  # noqa: E402
from aiayn.serve.app import create_app  # noqa: E402
from aiayn.serve.batcher import Batching  # noqa: E402
from aiayn.serve.markup import join_html, split_html  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def translator(tiny_run):
    return aiayn.load(tiny_run, device="cpu")


@pytest.fixture(scope="module")
def client_mt(translator):
    with TestClient(create_app(translator, batching=Batching(max_wait_ms=1.0)), base_url="http://localhost") as c:
        yield c


@pytest.fixture(scope="module")
def lm(lm_run):
    return aiayn.load(lm_run, device="cpu")


@pytest.fixture(scope="module")
def client_lm(lm):
    with TestClient(create_app(lm, batching=Batching(max_wait_ms=1.0)), base_url="http://localhost") as c:
        yield c


def best(translator, texts: list[str]) -> list[str]:
    return [h[0].text for h in translator.search(texts, translator.options(), scores=False)]


# LibreTranslate ------------------------------------------------------------------------------------------------


def test_multipart_forms_are_read_on_every_libretranslate_route(client_mt, translator):
    """``curl -F q=one -F source=en -F target=de``: multipart/form-data, each field a part without a file name."""
    def form(**fields):
        return {name: (None, value) for name, value in fields.items()}  # httpx: a part without a file name, as -F

    r = client_mt.post("/translate", files=form(q="a b c", source="en", target="de"))
    assert r.status_code == 200 and r.json() == {"translatedText": best(translator, ["a b c"])[0]}, r.text
    r = client_mt.post("/detect", files=form(q="a b c"))
    assert r.status_code == 200 and r.json() == [{"confidence": 100.0, "language": "en"}], r.text
    r = client_mt.post("/languages", files=form(api_key="unused"))
    assert r.status_code == 200 and r.json()[0]["targets"] == ["de", "en"], r.text
    r = client_mt.post("/translate", files=form(q="a b", source="en", target="de", format="html"))
    assert r.status_code == 200, r.text
    r = client_mt.post("/translate", files={"q": ("q.txt", b"a b"), "source": (None, "en"), "target": (None, "de")})
    assert r.status_code == 400 and "missing q" in r.json()["error"]  # a file part is not a field, as in Flask
    r = client_mt.post("/translate", content=b"--x\r\nno end", headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 400 and "form" in r.json()["error"]


def test_languages_answers_without_the_key_as_libretranslate_does(translator):
    """LibreTranslate has no key check on ``GET /languages`` (its clients list languages before they have a key);
    the routes that translate still ask for it."""
    app = create_app(translator, batching=Batching(max_wait_ms=1.0), api_key=KEY)
    with TestClient(app, base_url="http://localhost") as c:
        assert c.get("/languages").json() == [{"code": "en", "name": "English", "targets": ["de", "en"]},
                                              {"code": "de", "name": "German", "targets": ["de"]}]
        assert c.post("/languages", json={"api_key": "wrong-key!"}).status_code == 200  # not read
        assert c.post("/translate", json={"q": "a b", "source": "en", "target": "de"}).status_code == 403
        assert c.post("/detect", json={"q": "a b"}).status_code == 403


ODD_MARKUP = [
    "<!-- c --><![CDATA[x]]><?pi?>one",
    "<!DOCTYPE html>\n<HTML><Body CLASS=X>two<BR/>\n</BODY></HTML >",
    "<p>three</p ><![if !IE]>four<![endif]><!x>five</ p>",
    "six </> seven <?xml version=\"1.0\"?>\r\n<x a='1'\n b=\"&amp;\">eight</x>",
    "<style>p { a: b }</style><script>if (a < b) {}</script>nine",
    "ten <b>eleven</b>",
]


@pytest.mark.parametrize("document", ODD_MARKUP)
def test_html_markup_comes_back_byte_for_byte(document):
    """Everything but the text nodes is the document's own bytes (case, spaces, CDATA's ``]]>``, comments,
    declarations, processing instructions, what the parser skips); each text node is replaced whole."""
    parts, texts = split_html(document)
    assert texts and join_html(parts, texts) == document  # these texts hold nothing HTML escapes
    marked = join_html(parts, [f"T{i}" for i in range(len(texts))])
    expected = document
    for i, t in enumerate(texts):
        expected = expected.replace(t, f"T{i}", 1)
    assert marked == expected


def test_html_with_cdata_comment_and_pi_keeps_them(client_mt, translator):
    r = client_mt.post("/translate", json={"q": "<!-- c --><![CDATA[x]]><?pi?>one", "source": "en", "target": "de",
                                           "format": "html"})
    one = html.escape(best(translator, ["one"])[0], quote=False)
    assert r.status_code == 200 and r.json() == {"translatedText": f"<!-- c --><![CDATA[x]]><?pi?>{one}"}


# OpenAI --------------------------------------------------------------------------------------------------------


def test_a_completion_without_a_prompt_is_a_400(client_lm, client_mt):
    for c in (client_lm, client_mt):
        r = c.post("/v1/completions", json={"max_tokens": 4})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and err["code"] == "missing_required_parameter"


def test_an_empty_prompt_is_the_empty_string_never_a_token_the_client_did_not_send(client_lm, lm):
    """Echo + logprobs of ``""``: no prompt text, no prompt token; the completion is scored after the start the
    model reads (as the completion of ``""`` is generated from it)."""
    r = client_lm.post("/v1/completions", json={"prompt": "", "echo": True, "logprobs": 1, "max_tokens": 3,
                                                "temperature": 0})
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert usage["prompt_tokens"] == 0 and usage["completion_tokens"] == 3
    assert choice["text"] == lm.generate("", max_new_tokens=3)  # the completion only: nothing echoed
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 3 and None not in lp["token_logprobs"] and lp["text_offset"][0] == 0
    r = client_lm.post("/v1/completions", json={"prompt": "", "max_tokens": 3, "temperature": 0})
    assert r.json()["usage"]["prompt_tokens"] == 0


def test_a_prompt_past_the_context_names_param_code_and_what_a_client_can_do(client_lm, lm):
    """The LM reads 32 tokens: a longer prompt is 400 ``context_length_exceeded`` naming ``prompt`` (``messages`` on
    chat), telling of truncate_prompt_tokens, never a CLI flag; with echo, a prompt that fits but not with its
    max_tokens names ``max_tokens``. truncate_prompt_tokens then reads the prompt's last tokens, as vLLM."""
    long = "the cat sat on the mat. " * 3  # 72 characters: 72 tokens of the character model
    r = client_lm.post("/v1/completions", json={"prompt": long, "max_tokens": 4, "temperature": 0})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("prompt", "context_length_exceeded"), err
    assert "truncate_prompt_tokens" in err["message"] and "--" not in err["message"]
    r = client_lm.post("/v1/completions", json={"prompt": "the cat", "echo": True, "logprobs": 1, "max_tokens": 30})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded"), err
    assert "max_tokens 25 or less" in err["message"]
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"},
                         {"role": "assistant", "content": "on the mat"}, {"role": "user", "content": "the dog"}],
            "max_tokens": 4, "temperature": 0}
    r = client_lm.post("/v1/chat/completions", json=chat)
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("messages", "context_length_exceeded"), err
    assert "truncate_prompt_tokens" in err["message"] and "--slide" not in err["message"]
    r = client_lm.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 24})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 24, r.text
    ids = lm.tokenizers.src.encode(long)
    r = client_lm.post("/v1/completions", json={"prompt": long, "max_tokens": 4, "temperature": 0,
                                                "truncate_prompt_tokens": 20})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == lm.generate(ids[-20:], max_new_tokens=4)
    for bad in (0, -2, "5", True):
        r = client_lm.post("/v1/completions", json={"prompt": "a", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", bad


def test_truncate_prompt_tokens_minus_one_leaves_room_for_what_is_generated(client_lm, lm):
    """vLLM's -1 (the model's context) on a prompt past it: the prompt is cut to the context less one new token
    (then the completion slides, as a 63-token prompt with 30 new tokens does), or less max_tokens with echo or
    logprobs (every score reads all tokens before it), and answered, never refused for want of room."""
    long = "the cat sat on the mat. " * 3  # 72 tokens of the character model, whose context is 32
    ids = lm.tokenizers.src.encode(long)
    r = client_lm.post("/v1/completions", json={"prompt": long, "max_tokens": 6, "temperature": 0,
                                                "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 31
    assert r.json()["choices"][0]["text"] == lm.generate(ids[-31:], max_new_tokens=6)
    r = client_lm.post("/v1/completions", json={"prompt": long, "max_tokens": 4, "echo": True, "logprobs": 1,
                                                "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 28, r.text
    chat = {"messages": [{"role": "user", "content": long}], "max_tokens": 3, "truncate_prompt_tokens": -1}
    r = client_lm.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 31, r.text


def test_a_translation_runs_too_long_prompt_is_openais_400_naming_the_requests_field(client_mt, translator):
    """OpenAI answers a text past the model's context with 400 ``context_length_exceeded``; chat names
    ``messages`` (the last user message is what a translation run reads), completions ``prompt``."""
    long = "a b " * (translator.max_source_tokens + 5)
    r = client_mt.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("messages", "context_length_exceeded"), err
    assert err["message"].startswith("messages: the last user message: "), err
    r = client_mt.post("/v1/completions", json={"prompt": ["a b", long]})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("prompt", "context_length_exceeded"), err
    assert err["message"].startswith("prompt[1]: "), err
    # more prompts than --max-sentences: 400 out_of_range, as OpenAI refuses a request it will not take
    r = client_mt.post("/v1/completions", json={"prompt": ["a"] * 129})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("prompt", "out_of_range"), err


def test_the_chat_routes_unknown_field_names_its_param(client_lm):
    r = client_lm.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "colour": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == ("colour", "unknown_parameter")
    r = client_lm.post("/v1/chat/completions", json={"messages": "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_vllm_sampling_extras_from_the_openai_client(client_lm, lm):
    """``extra_body={"top_k": ...}`` arrives as a top-level field: top_k filters the draw (top_k 1 is greedy),
    vLLM's -1 turns it off; min_p 0 and repetition_penalty 1 (the values that change nothing) are taken, others
    refused naming the field."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=client_lm, max_retries=0)
    greedy = lm.generate("the cat", max_new_tokens=8)
    done = client.completions.create(model=lm.run.path.name, prompt="the cat", max_tokens=8, temperature=1.0, seed=3,
                                     extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0})
    assert done.choices[0].text == greedy
    chat = client.chat.completions.create(model=lm.run.path.name, messages=[{"role": "user", "content": "the"}],
                                          max_tokens=4, temperature=0.5, seed=1, extra_body={"top_k": -1})
    assert chat.choices[0].finish_reason in ("stop", "length")
    for field, value in (("min_p", 0.1), ("repetition_penalty", 1.2)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=lm.run.path.name, prompt="the", max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field and "not supported" in e.value.body["message"]


def test_langchain_batch_of_80_prompts_is_taken(client_lm):
    """LangChain's OpenAI LLM sends up to batch_size prompts in one request: 80 of them fit the default limit."""
    lc = pytest.importorskip("langchain_openai")
    llm = lc.OpenAI(base_url="http://localhost/v1", api_key="unused", model="run", http_client=client_lm,
                    batch_size=100, max_tokens=1, temperature=0, max_retries=0)
    result = llm.generate([f"the {i}" for i in range(80)])
    assert len(result.generations) == 80


def test_a_request_without_top_k_keeps_the_servers_top_k(lm, client_lm):
    """aiayn serve --top-k 1: a request that sends no top_k samples under it (greedy); vLLM's -1 turns it off (the
    draw of a server without --top-k, the same seed)."""
    from aiayn.serve.service import Choices

    body = {"prompt": "the cat", "max_tokens": 8, "temperature": 1.0, "seed": 3}
    unfiltered = client_lm.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with TestClient(create_app(lm, batching=Batching(max_wait_ms=1.0), choices=Choices(decode={"top_k": 1})),
                    base_url="http://localhost") as c:
        assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == lm.generate("the cat",
                                                                                                max_new_tokens=8)
        assert c.post("/v1/completions", json={**body, "top_k": -1}).json()["choices"][0]["text"] == unfiltered
