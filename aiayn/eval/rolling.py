"""The rolling log-likelihood of a text, in lm-evaluation-harness's windows: what its ``loglikelihood_rolling``
requests (the perplexity tasks: wikitext and the like) score through ``local-completions`` against ``aiayn serve``,
so that ``aiayn evaluate RUN --rolling`` and lm-eval give one number for one text.

lm-eval (0.4.x, ``TemplateAPI.loglikelihood_rolling``) keeps one position of its ``max_length`` for a generated
token and cuts a document's tokens into windows that each predict up to ``max_length - 2`` of them: the first
after its prefix token (the server's BOS, ``<s>``), every later one after the token before it (its context), the
last one after as many tokens before it as fill the window (``utils.get_rolling_token_windows`` with
``context_len=1``, then ``make_disjoint_window``). Each token is scored once; the sum over the windows is the
document's log-likelihood. aiayn's own ``evaluate`` of an LM scores its training blocks instead (no BOS: a model
of running text never saw one), a different number.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from aiayn.device import model_device
from aiayn.engine import kernels
from aiayn.errors import ConfigError
from aiayn.run.directory import Run

# logits held at once while scoring (windows x tokens x vocabulary floats): 2^26 floats, 256 MiB
LOGIT_BUDGET = 1 << 26


def rolling_windows(ids: Sequence[int], prefix: int, max_length: int) -> list[tuple[list[int], int]]:
    """lm-eval's windows of ``ids`` at its ``max_length``: (the tokens sent, how many of the last are scored);
    the tokens sent are the context then the scored tokens, as lm-eval's echo request holds them."""
    span = max_length - 2  # lm-eval: max_length - 1 (one position for a generated token), less the context token
    if span < 1:
        raise ConfigError(f"--max-length {max_length}: lm-evaluation-harness's rolling windows need at least 3")
    ids = [int(i) for i in ids]
    if not ids:
        return []
    first = min(span, len(ids))
    windows = [([prefix] + ids[:first], first)]
    done = first
    while done < len(ids):
        n = min(len(ids) - done, span)
        end = done + n
        windows.append((ids[end - span - 1:end], n))  # the context, then the n new tokens: span + 1 tokens
        done = end
    return windows


@torch.no_grad()
def score_windows(run: Run, windows: list[tuple[list[int], int]]) -> float:
    """The sum of the model's log-probabilities (log-softmax at temperature 1) of each window's scored tokens given
    the tokens before them in the window; windows of one length run together, within :data:`LOGIT_BUDGET`."""
    device = model_device(run.model)
    by_length: dict[int, list[tuple[list[int], int]]] = {}
    for w in windows:
        by_length.setdefault(len(w[0]), []).append(w)
    total = 0.0
    for length, group in by_length.items():
        rows = max(1, LOGIT_BUDGET // (length * run.tokenizers.src.vocab_size))
        for start in range(0, len(group), rows):
            chunk = group[start:start + rows]
            ids = torch.tensor([seq for seq, _ in chunk], device=device)
            with kernels(device, run.precision):
                logits = run.model(ids[:, :-1])  # (B, T-1, V): row t predicts ids[:, t + 1]
            logp = logits.float().log_softmax(dim=-1).gather(2, ids[:, 1:, None])[..., 0].cpu()
            total += sum(float(row[-n:].sum()) for row, (_, n) in zip(logp, chunk))
    return total


def text_counts(text: str) -> tuple[int, int]:
    """(words, UTF-8 bytes) of a document as lm-eval counts them for ``word_perplexity`` and ``byte_perplexity``
    / ``bits_per_byte`` (``Task.count_words``: pieces between runs of white space)."""
    return len(re.split(r"\s+", text)), len(text.encode("utf-8"))
