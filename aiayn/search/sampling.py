"""Sampling: independent draws per source sentence for an encoder-decoder (:func:`sample_search`), and the
token stream of a language model (:func:`sample`).

Shapes: B batch, R = B * nbest rows (draw j of sentence i is row i * nbest + j), S source length, t tokens
produced, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from aiayn.config import DecodeOptions
from aiayn.device import model_device
from aiayn.search.common import new_cache, penalized_score
from aiayn.search.processing import LogitsProcessor
from aiayn.search.spec import SearchSpec, max_lengths
from aiayn.search.strategy import Hypothesis, Strategy


def _draw(process: LogitsProcessor, logits: Tensor, temperature: float, gen: torch.Generator | None) -> Tensor:
    """Token ids (R,) from logits (R, V): argmax at temperature 0, else a draw after the filters."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(process.filtered(logits).softmax(dim=-1), 1, generator=gen).squeeze(1)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """One generator for the whole call, seeded (None: torch's global RNG)."""
    return torch.Generator(device=device).manual_seed(seed) if seed is not None else None


class _Draws:
    """The ended draws of :func:`sample_search`, on the device until the one transfer at the end: tokens (R, steps),
    their lengths without EOS and |Y| with it (R,), and summed log-probabilities (R,)."""

    def __init__(self, R: int, steps: int, device: torch.device) -> None:
        self.tokens = torch.zeros(R, steps, dtype=torch.long, device=device)
        self.length = torch.zeros(R, dtype=torch.long, device=device)
        self.steps = torch.zeros(R, dtype=torch.long, device=device)
        self.logprob = torch.zeros(R, device=device)

    def record(self, live: Tensor, tokens: Tensor, ended: Tensor, logprob: Tensor) -> None:
        """Record every live row (original rows ``live`` (R',)): tokens (R', t + 1) produced, ``ended`` (R',) bool
        (the last is EOS), logprob (R',). The ended ones are final; the others are overwritten later."""
        produced = tokens.size(1)
        self.tokens[:, :produced].index_copy_(0, live, tokens)
        self.length.index_copy_(0, live, produced - ended.long())
        self.steps.index_copy_(0, live, torch.full_like(live, produced))
        self.logprob.index_copy_(0, live, logprob)

    def hypotheses(self, o: DecodeOptions) -> list[list[Hypothesis]]:
        """Each source's ``nbest`` draws (source i: rows i * nbest onwards), length-penalized, best score first."""
        draws = [Hypothesis(seq[:n], penalized_score(lp, y, o.alpha, o.length_penalty), lp)
                 for seq, n, y, lp in zip(*(x.tolist() for x in (self.tokens, self.length, self.steps, self.logprob)))]
        # best score first; a stable sort keeps the draw order of equal scores
        return [sorted(draws[i:i + o.nbest], key=lambda h: -h.score) for i in range(0, len(draws), o.nbest)]


@torch.no_grad()
def sample_search(model: nn.Module, src: Tensor, src_mask: Tensor | None = None,
                  spec: SearchSpec = SearchSpec()) -> list[list[Hypothesis]]:
    """Sampling for an encoder-decoder: ``nbest`` independent draws per sentence, best score first.

    src (B, S) ids, src_mask (B, S) bool. Each step draws from softmax(logits / temperature) after top-k then
    top-p filtering (temperature 0: argmax, so nbest draws are equal); EOS is forbidden before ``min_len``
    tokens and n-grams are blocked as in greedy search. One ``torch.Generator`` seeded by ``seed`` serves the
    whole call (None: torch's global RNG), so the same inputs in the same batch give the same draws.
    ``logprob`` sums the model's own log-probabilities (temperature 1, no filtering) of the drawn tokens, EOS
    included, and ``score`` is it length-penalized as in beam search. As greedy search, each step waits for
    the device once (which rows ended); the draws come back in one transfer at the end.
    """
    o = spec.options
    if o.temperature < 0 or o.nbest < 1:
        raise ValueError(f"need temperature >= 0 and nbest >= 1 (got {o.temperature}, {o.nbest})")
    if src_mask is None:
        src_mask = src != spec.pad
    device = src.device
    process = LogitsProcessor(spec, device)
    limits = max_lengths(model, src_mask, spec)
    rows = torch.arange(src.size(0), device=device).repeat_interleave(o.nbest)
    mem_mask = src_mask.index_select(0, rows)
    memory = model.encode(src, src_mask).index_select(0, rows)  # (R, S, D)
    gen = _generator(o.seed, device)
    R, steps = rows.numel(), max(limits)
    live = torch.arange(R, device=device)  # original row of each live row
    limit = torch.tensor(limits, device=device).repeat_interleave(o.nbest)  # (R',) step limit of each live row
    tokens = torch.full((R, 1), spec.bos, dtype=torch.long, device=device)  # (R', 1 + t)
    logprob = torch.zeros(R, device=device)  # (R',) summed log-probabilities of the live rows
    cache = new_cache(model, steps)
    draws = _Draws(R, steps, device)
    t = 0
    while True:
        spec.check_stop()
        logits = process.ban(model.decode(tokens[:, -1:], memory, mem_mask, cache)[:, -1]).float()  # (R', V)
        process.constrain(logits, tokens[:, 1:], t)
        lprobs = torch.log_softmax(logits, dim=-1)
        nxt = _draw(process, logits, o.temperature, gen)  # (R',)
        logprob = logprob + lprobs.gather(1, nxt[:, None]).squeeze(1)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        ended = nxt == spec.eos
        keep = (~(ended | (limit <= t + 1))).nonzero().squeeze(1)  # the step's one wait for the device
        if keep.numel() < live.numel():
            draws.record(live, tokens[:, 1:], ended, logprob)
            if keep.numel() == 0:
                break
            tokens, memory, mem_mask, logprob = tokens[keep], memory[keep], mem_mask[keep], logprob[keep]
            live, limit = live[keep], limit[keep]
            cache.reorder(keep)
        t += 1
    return draws.hypotheses(o)


@torch.no_grad()
def sample(model: nn.Module, prompt: Sequence[int] | Tensor, spec: SearchSpec, max_new_tokens: int,
           context_limit: int | None = None, use_cache: bool = True) -> Iterator[int]:
    """Stream up to ``max_new_tokens`` ids from a language model, one at a time, after ``prompt`` (a list of
    ids, a (T,) or a (1, T) tensor; not empty: start it with BOS if the model expects one).

    The spec's ``temperature`` (0 unless ``options.sample``: greedy), then top-k, then top-p filtering, then a
    draw with a ``torch.Generator`` seeded by ``seed`` (None: torch's global RNG). Generation stops after the
    spec's EOS, which is not yielded. The prompt is prefilled in one call, then one token per step with the
    cache. The model sees at most ``context_limit`` tokens (default: its ``cfg.max_positions``); once the text
    is longer, each step re-decodes the last ``context_limit`` tokens without a cache (absolute positions
    cannot slide inside a cache), as nanoGPT does. ``no_repeat_ngram`` n > 0 forbids repeating an n-gram of
    the generated tokens (the prompt may be copied from freely); ``min_len`` forbids EOS before that many.
    """
    device = model_device(model)
    process = LogitsProcessor(spec, device)
    tokens = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(1, -1)  # (1, T)
    if tokens.size(1) == 0:
        raise ValueError("sample needs a non-empty prompt (e.g. [bos_id])")
    if context_limit is None:
        context_limit = getattr(getattr(model, "cfg", None), "max_positions", None)
    gen = _generator(spec.options.seed, device)
    steps = tokens.size(1) + max_new_tokens
    cache = new_cache(model, min(steps, context_limit or steps)) if use_cache else None
    pending = tokens  # (1, t): tokens the cache has not seen yet
    cached = 0
    produced: list[int] = []
    for _ in range(max_new_tokens):
        if cache is not None and context_limit is not None and cached + pending.size(1) > context_limit:
            cache = None  # past the position table: from here on, slide a window
        if cache is not None:
            logits = model.decode(pending, None, None, cache)[:, -1]  # (1, V)
            cached += pending.size(1)
        else:
            window = tokens if context_limit is None else tokens[:, -context_limit:]
            logits = model.decode(window, None, None, None)[:, -1]
        logits = process.constrain(process.ban(logits).float(), torch.tensor([produced], dtype=torch.long),
                                   len(produced))
        tok = int(_draw(process, logits, spec.temperature, gen))
        if tok == spec.eos:
            return
        yield tok
        produced.append(tok)
        pending = torch.tensor([[tok]], dtype=torch.long, device=device)
        tokens = torch.cat([tokens, pending], dim=1)


@torch.no_grad()
def sample_rows(model: nn.Module, prompts: Sequence[Sequence[int]], spec: SearchSpec,
                max_new_tokens: Sequence[int], seeds: Sequence[int | None]) -> Iterator[list[int | None]]:
    """:func:`sample` for several prompts in one batch: per step, each row's new id (None once the row has
    ended, by EOS, which is not given, or after its ``max_new_tokens[r]`` ids).

    The prompts (lists of ids, not empty) are left-padded so that they end together, each row at its own
    positions (``model.decode(..., left_pad=)``), prefilled in one call, then decoded one step at a time with
    one cache. Row r draws with its own generator seeded by ``seeds[r]`` (None: torch's global RNG), so its ids
    are those :func:`sample` gives it alone, up to the float rounding of batched matmuls. The spec's options
    (temperature, top-k/p, min_len, no_repeat_ngram) apply to every row. Every prompt plus its new ids must fit
    the model's positions: no sliding window here (:func:`sample` has one).
    """
    device = model_device(model)
    process = LogitsProcessor(spec, device)
    B = len(prompts)
    if B == 0 or len(max_new_tokens) != B or len(seeds) != B or any(len(p) == 0 for p in prompts):
        raise ValueError("sample_rows: one non-empty prompt, token limit and seed per row")
    longest = max(len(p) for p in prompts)
    limit = getattr(getattr(model, "cfg", None), "max_positions", None)
    if limit is not None and any(len(p) + n > limit for p, n in zip(prompts, max_new_tokens)):
        raise ValueError(f"sample_rows: a prompt and its new tokens exceed the model's {limit} positions")
    left = [longest - len(p) for p in prompts]
    tokens = torch.full((B, longest), spec.pad, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, left[r]:] = torch.as_tensor(list(p), dtype=torch.long)
    tokens, left_pad = tokens.to(device), torch.tensor(left, dtype=torch.long, device=device)
    gens = [_generator(seed, device) for seed in seeds]
    steps = max(max_new_tokens)
    cache = new_cache(model, longest + steps)
    produced = torch.zeros(B, 0, dtype=torch.long)
    live = [n > 0 for n in max_new_tokens]
    pending = tokens
    for t in range(steps):
        if not any(live):
            return
        logits = model.decode(pending, None, None, cache, left_pad=left_pad)[:, -1]  # (B, V)
        logits = process.constrain(process.ban(logits).float(), produced, t)
        drawn = [int(_draw(process, logits[r:r + 1], spec.temperature, gens[r])) if live[r] else spec.pad
                 for r in range(B)]
        out: list[int | None] = []
        for r, tok in enumerate(drawn):
            if live[r] and tok == spec.eos:
                live[r] = False
            out.append(tok if live[r] else None)
            if live[r] and t + 1 >= max_new_tokens[r]:
                live[r] = False
        yield out
        pending = torch.tensor(drawn, dtype=torch.long, device=device)[:, None]
        produced = torch.cat([produced, pending.cpu()], dim=1)


def sample_list(model: nn.Module, prompt: Sequence[int] | Tensor, spec: SearchSpec, max_new_tokens: int,
                **kwargs) -> list[int]:
    """:func:`sample` collected into a list (same arguments)."""
    return list(sample(model, prompt, spec, max_new_tokens, **kwargs))


class SampledStream:
    """A language model's stream, the same for every strategy: :func:`sample` / :func:`sample_rows` draw at the
    options' temperature, and temperature 0 (greedy, beam: a stream has no beams) is the argmax."""

    def stream(self, model: nn.Module, prompt: Sequence[int], spec: SearchSpec, max_new_tokens: int,
               context_limit: int | None) -> Iterator[int]:
        return sample(model, prompt, spec, max_new_tokens, context_limit=context_limit)

    def stream_rows(self, model: nn.Module, prompts: Sequence[Sequence[int]], spec: SearchSpec,
                    max_new_tokens: Sequence[int], seeds: Sequence[int | None]) -> Iterator[list[int | None]]:
        return sample_rows(model, prompts, spec, max_new_tokens, seeds)


class Sampling(SampledStream, Strategy):
    """``sample``: ``nbest`` independent draws per source (:func:`sample_search`); a language model's tokens
    drawn one at a time (:func:`sample`)."""

    name = "sample"

    def chosen(self, options: DecodeOptions) -> bool:
        return options.sample

    def rows(self, options: DecodeOptions) -> int:
        return options.nbest

    def search(self, model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec, scores: bool
               ) -> list[list[Hypothesis]]:
        return sample_search(model, src, src_mask, spec)
