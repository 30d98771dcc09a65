"""What a decoding strategy is: the :class:`Strategy` protocol each search implements (greedy, beam, sampling; found by
name in :data:`aiayn.search.sources.STRATEGIES`) and the :class:`Hypothesis` record its search returns. The
utilities the searches share are :mod:`aiayn.search.common`'s."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor, nn

from aiayn.config import DecodeOptions
from aiayn.search.spec import SearchSpec


@dataclass
class Hypothesis:
    """One finished output: ``tokens`` without BOS/EOS, ``score`` the length-penalized score used for ranking,
    ``logprob`` the sum of the token log-probabilities (EOS included)."""

    tokens: list[int]
    score: float
    logprob: float


class Strategy(Protocol):
    """One decoding strategy, found by name in the table of :mod:`aiayn.search.sources` (as OpenNMT's
    ``DecodeStrategy`` and fairseq's ``Search``): whether a call's options choose it, the rows it decodes per
    source (a source costs a batch its ids and EOS once per row), its search of a padded batch of sources, and
    a language model's stream of new tokens after a prompt."""

    name: str

    def chosen(self, options: DecodeOptions) -> bool:
        """Whether ``options`` decode with this strategy."""
        ...

    def rows(self, options: DecodeOptions) -> int:
        """The rows searched per source (the beam, the draws)."""
        ...

    def search(self, model: nn.Module, src: Tensor, src_mask: Tensor, spec: SearchSpec, scores: bool
               ) -> list[list[Hypothesis]]:
        """The hypotheses of each source, best first: src (B, S) ids (EOS included), src_mask (B, S) bool;
        ``scores=False`` may leave scores NaN where they cost a pass of their own."""
        ...

    def stream(self, model: nn.Module, prompt: Sequence[int], spec: SearchSpec, max_new_tokens: int,
               context_limit: int | None) -> Iterator[int]:
        """A decoder-only model's new ids after ``prompt``, one at a time, at most ``max_new_tokens``, the model
        reading at most ``context_limit`` tokens (:func:`aiayn.search.sampling.sample`)."""
        ...

    def stream_rows(self, model: nn.Module, prompts: Sequence[Sequence[int]], spec: SearchSpec,
                    max_new_tokens: Sequence[int], seeds: Sequence[int | None]) -> Iterator[list[int | None]]:
        """:meth:`stream` for several prompts in one batch: per step, each row's new id (None once it has ended;
        :func:`aiayn.search.sampling.sample_rows`)."""
        ...
