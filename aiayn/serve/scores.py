"""Log-probabilities through OpenAI's protocol: a completion with ``echo`` and/or ``logprobs`` (what
lm-evaluation-harness's ``local-completions`` sends for its loglikelihood tasks), and the tokenizer endpoints
that its ``tokenizer_backend=remote`` (and vLLM's clients) call.

The ``logprobs`` object is OpenAI's legacy one, per choice::

    {"tokens": [text of each token], "token_logprobs": [None, float, ...], "top_logprobs": [None, {text: float}, ...],
     "text_offset": [where each token starts in the choice's text]}

covering the prompt's tokens and then the completion's with ``echo`` (the first token has None: nothing
predicts it), the completion's only without. The numbers are the model's log-softmax at temperature 1, nothing
filtered (:func:`aiayn.decode.logprobs.score_many`), whatever the request's sampling; ``top_logprobs`` holds the
``logprobs`` most likely tokens of each position. A token's text is what it adds to the text decoded so far (a
special token, or a byte of an unfinished character, is named by its piece and adds nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiayn.decode.generate import lm_context, prompt_ids
from aiayn.decode.logprobs import TokenScores, continue_ids, score_many, token_texts
from aiayn.errors import ConfigError
from aiayn.run.directory import Run

MAX_LOGPROBS = 20  # top log-probabilities per token at most (vLLM's default cap; OpenAI's is 5)


def check_scored(run: Run, prompt: str | list[int], max_tokens: int) -> list[int]:
    """The prompt's ids, refused (one line) when they and ``max_tokens`` new ones do not fit the model's context:
    scores are conditioned on every token before, which a sliding window would break."""
    ids = prompt_ids(run.cfg, run.tokenizers.src, prompt)
    ctx = lm_context(run.cfg)
    if len(ids) + max_tokens > ctx:
        raise ConfigError(f"the prompt is {len(ids)} tokens and max_tokens {max_tokens}: with echo or logprobs they "
                          f"must fit the model's context of {ctx} tokens (lm-evaluation-harness: max_length={ctx})")
    return ids


def _candidate_text(run: Run, i: int) -> str:
    """A top-logprobs candidate's text: its piece, SentencePiece's word mark read as the space it stands for."""
    return run.tokenizers.src.id_to_piece(i).replace("\u2581", " ")


def scored_choices(run: Run, items: Sequence[tuple[str | list[int], Any, int, bool, int | None]]
                   ) -> list[dict[str, Any]]:
    """Echo / logprobs completion choices (worker thread), one per ``(prompt, opts, max_tokens, echo, top)``:
    ``max_tokens`` new ids by ``opts``' search, then the log-probabilities of prompt and completion (``top``: how
    many most likely tokens per position; None: no ``logprobs`` object), teacher-forced in passes shared by all
    the choices (:func:`aiayn.decode.logprobs.score_many`): a batch of lm-evaluation-harness's loglikelihood
    prompts costs a few forward passes, not one per prompt."""
    rows = []
    for prompt, opts, max_tokens, _, _ in items:
        ids = check_scored(run, prompt, max_tokens)
        rows.append((ids, continue_ids(run, ids, opts, max_tokens)))
    wanted = [k for k, item in enumerate(items) if item[4] is not None]
    most = max((items[k][4] or 0 for k in wanted), default=0)
    scores = dict(zip(wanted, score_many(run, [rows[k][0] + rows[k][1] for k in wanted], most)))
    eos = run.tokenizers.specials.eos
    results = []
    for k, ((prompt, _, _, echo, top), (ids, new)) in enumerate(zip(items, rows)):
        texts, offsets, whole = token_texts(run, ids + new)
        prompt_text = token_texts(run, ids)[2]
        # An empty prompt is the empty string: the start the model reads it from (prompt_ids) is no token the
        # client sent, so it is neither echoed nor counted; the completion is scored after it.
        echo = echo and prompt != ""
        result = {"text": whole if echo else whole[len(prompt_text):],
                  "finish_reason": "stop" if new and new[-1] == eos else "length",
                  "prompt_tokens": len(ids) if prompt != "" else 0, "completion_tokens": len(new), "logprobs": None}
        if top is not None:
            first, shift = (0, 0) if echo else (len(ids), len(prompt_text))
            result["logprobs"] = _logprobs_object(run, scores[k], texts[first:], offsets[first:], first, shift, top)
        results.append(result)
    return results


def _logprobs_object(run: Run, s: TokenScores, texts: list[str], offsets: list[int], first: int, shift: int,
                     top: int) -> dict[str, Any]:
    """OpenAI's legacy ``logprobs`` object of ``s``'s positions from ``first`` on (``texts`` and ``offsets``
    already cut there; offsets moved back by ``shift``): each position's ``top`` most likely of the pass's (sorted,
    best first), the chosen token under its text in context (so its key matches its entry of ``tokens``), the
    others by their pieces."""
    tops: list[dict[str, float] | None] = []
    for t, text in zip(range(first, len(s.ids)), texts):
        tops.append(None if s.top[t] is None else
                    {(text if i == s.ids[t] else _candidate_text(run, i)): v for i, v in s.top[t][:top]})
    return {"tokens": texts, "token_logprobs": s.logprobs[first:], "top_logprobs": tops,
            "text_offset": [o - shift for o in offsets]}


def tokenizer_info(run: Run, model_id: str, chat_template: str | None = None) -> dict[str, Any]:
    """``GET /tokenizer_info`` as lm-evaluation-harness's remote tokenizer reads it (vLLM's fields): the special
    tokens by their text (``/tokenize`` maps each back to its id), the context length, the run's own chat template
    (``RUN/chat_template.jinja``'s text; None: the run has none, and chat uses the server's default)."""
    tok, sp = run.tokenizers.src, run.tokenizers.specials
    return {"tokenizer_class": f"aiayn-{tok.kind}", "model": model_id, "eos_token": tok.id_to_piece(sp.eos),
            "bos_token": tok.id_to_piece(sp.bos), "pad_token": tok.id_to_piece(sp.pad),
            "unk_token": tok.id_to_piece(sp.unk), "model_max_length": lm_context(run.cfg),
            "chat_template": chat_template, "vocab_size": tok.vocab_size}


def encode_with_specials(run: Run, text: str) -> list[int]:
    """``text``'s ids, a special token's name in it (``</s>``) read as that token, as Hugging Face tokenizers do
    (lm-evaluation-harness finds the EOS id by tokenizing ``eos_token``)."""
    tok, sp = run.tokenizers.src, run.tokenizers.specials
    names = {tok.id_to_piece(i): i for i in (sp.bos, sp.eos, sp.pad, sp.unk)}
    ids: list[int] = []
    start = 0
    while start <= len(text):
        hits = [(text.find(n, start), n) for n in names if text.find(n, start) >= 0]
        if not hits:
            break
        at, name = min(hits, key=lambda h: (h[0], -len(h[1])))
        ids += (tok.encode(text[start:at]) if at > start else []) + [names[name]]
        start = at + len(name)
    return ids + (tok.encode(text[start:]) if start < len(text) else [])
