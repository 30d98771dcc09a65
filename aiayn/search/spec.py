"""One search specification per call: the decoding options and the special ids the model reserves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from aiayn.config import DecodeOptions
from aiayn.data.tokenizer import SpecialIds


class SearchStopped(Exception):
    """A search ended early because its caller asked it to (:attr:`SearchSpec.stop`): no hypotheses."""


@dataclass(frozen=True)
class SearchSpec:
    """What a search reads: ``options`` (beam, length penalty, lengths, n-gram blocking, sampling, ...) and
    ``ids`` (pad, EOS and the decoder's start token of the run's tokenizer). Built once per call, from the
    run's ``decode`` section with the call's overrides; every search takes it whole."""

    options: DecodeOptions = field(default_factory=DecodeOptions)
    ids: SpecialIds = field(default_factory=SpecialIds)
    # Asked once per decoding step: True ends the search with SearchStopped (a server whose clients all went away).
    stop: Callable[[], bool] | None = field(default=None, compare=False)

    def check_stop(self) -> None:
        """Raise :class:`SearchStopped` when :attr:`stop` says so (every search calls this once per step)."""
        if self.stop is not None and self.stop():
            raise SearchStopped("the search was stopped by its caller")

    @classmethod
    def of(cls, specials: SpecialIds | None = None, **options: Any) -> SearchSpec:
        """A spec from keyword options (validated as :class:`DecodeOptions`) and the special ids (aiayn's by
        default): ``SearchSpec.of(beam=5, alpha=1.0)``."""
        return cls(DecodeOptions(**options), specials or SpecialIds())

    @property
    def bos(self) -> int:
        """The decoder's first input."""
        return self.ids.decoder_start

    @property
    def eos(self) -> int:
        return self.ids.eos

    @property
    def pad(self) -> int:
        return self.ids.pad

    @property
    def banned(self) -> tuple[int, ...]:
        """Ids never produced: the pad id with ``ban_pad`` (Marian checkpoints ban it in generation)."""
        return (self.ids.pad,) if self.options.ban_pad else ()

    @property
    def temperature(self) -> float:
        """The sampling temperature; 0 (greedy) unless ``options.sample``."""
        return self.options.temperature if self.options.sample else 0.0


def max_lengths(model: nn.Module, src_mask: Tensor, spec: SearchSpec, lengths: list[int] | None = None) -> list[int]:
    """Per-sentence decoding-step limits int(a * src_len_i + b) from src_mask (B, S) bool, at least 1 and at
    most the model's ``cfg.max_positions`` when it has one; ``lengths``: the sources' lengths (src_mask's row
    sums) where the caller has read them already."""
    a, b = spec.options.max_len_a, spec.options.max_len_b
    cap = getattr(getattr(model, "cfg", None), "max_positions", None)
    out = []
    for n in src_mask.sum(dim=1).tolist() if lengths is None else lengths:
        m = int(a * n + b)
        if cap is not None:
            m = min(m, int(cap))
        out.append(max(1, m))
    return out
