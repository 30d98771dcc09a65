"""The weights inference uses, written at a training's end into ``RUN/model.safetensors``: the last, best or averaged
weights, as ``train.inference_weights`` says, and which in one line. The average of the last checkpoints is used only
where validation finds it at least as good as the last weights (:func:`prefer_average`: validation BLEU for
translation, then NLL; a run cut early averages undertrained checkpoints, which can be much worse).

The choice stands below the training code (it is part of the run package, which inference uses): the validation
scores it compares are handed to it (:class:`Scores`; a training's: :class:`aiayn.train.validation.WeightsScores`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from aiayn.config import Config, DecodeOptions
from aiayn.run.weights import (
    FINAL_WEIGHTS,
    average_weights,
    best_path,
    checkpoint_paths,
    list_checkpoints,
    read_weights,
    save_weights,
)

log = logging.getLogger("aiayn.train")

# Validation BLEU closer than this is a tie (sacreBLEU prints two decimals), which validation NLL decides.
BLEU_TIE = 0.01


def keep_best(model: nn.Module, run_dir: str | Path, step: int, valid_nll: float) -> None:
    """Save ``model`` as the run's best weights (validation NLL ``valid_nll`` at ``step``): kept apart from the
    rotating checkpoints, so that 'best' is always on disk for ``train.inference_weights=best``."""
    save_weights(model, best_path(run_dir), {"source": f"best step {step}", "valid_nll": str(valid_nll)})


class Scores(Protocol):
    """The validation scores of a model's weights that the choice compares: ``valid_nll``, and what the run's task
    weighs beside it (a translation: ``valid_bleu``); every process of the training calls it. ``words``: what they
    are, for the log (``validation NLL and BLEU by the recipe's search``)."""

    @property
    def words(self) -> str: ...

    def __call__(self, model: nn.Module) -> dict[str, float]: ...


class WeightsChoice:
    """Chooses and writes a run's inference weights; ``main``: whether this process writes (rank 0)."""

    def __init__(self, cfg: Config, run_dir: Path, main: bool, scores: Scores) -> None:
        self.cfg, self.run_dir, self.main, self.scores = cfg, run_dir, main, scores

    def write(self, model: nn.Module, step: int, best_step: int | None) -> Path:
        """model.safetensors from ``model`` (the last weights, at ``step``), the best (at ``best_step``) or the
        averaged weights. Rank 0 writes; every process takes part in the validation."""
        tc, out = self.cfg.train, self.run_dir / FINAL_WEIGHTS
        steps = list_checkpoints(self.run_dir)
        chosen: Any = model
        if tc.inference_weights == "average" and steps:
            averaged = steps[-tc.average_last :]
            avg = average_weights([checkpoint_paths(self.run_dir, s)[0] for s in averaged])
            chosen, why = self._better_of_average(model, step, avg, averaged)
        elif tc.inference_weights == "best" and best_path(self.run_dir).exists():
            chosen = read_weights(best_path(self.run_dir))
            why = f"best step {best_step} (train.inference_weights=best)"
        else:
            why = f"last step {step}"
        if self.main:
            save_weights(chosen, out, {"source": why})
            log.info("inference weights (%s): %s", out.name, why)
        return out

    def _better_of_average(self, model: nn.Module, last: int, avg: dict[str, torch.Tensor],
                           steps: list[int]) -> tuple[Any, str]:
        """The average of checkpoints ``steps`` or the last weights (``model``, at step ``last``), whichever scores
        better on validation (:func:`prefer_average`: BLEU for a translation run, NLL breaking a tie), and why."""
        if len(steps) == 1 and steps[0] == last:
            return model, f"last step {last} (the only checkpoint to average)"
        own = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if self.main:  # the choice takes two validations (with BLEU: two decodings): say so before they run
            log.info("choosing the inference weights: the last ones (step %d) or the average of steps %s, by %s "
                     "(1 of 2: the last weights); if stopped now, aiayn train --resume %s finishes this choice "
                     "without training more", last, steps, self.scores.words, self.run_dir)
        last_scores = self.scores(model)
        if self.main:
            log.info("choosing the inference weights (2 of 2: the average of steps %s)", steps)
        model.load_state_dict({k: v.to(own[k].device, own[k].dtype) for k, v in avg.items()}, strict=False)
        avg_scores = self.scores(model)
        model.load_state_dict(own)
        said = describe_choice(avg_scores, last_scores, last, search_words(self.cfg.decode))
        if prefer_average(avg_scores, last_scores):
            return avg, f"average of steps {steps} (train.inference_weights=average; {said})"
        return model, f"last step {last}: the average of steps {steps} is worse on validation ({said}), so it " \
                      "is not used"


def prefer_average(avg: dict[str, float], last: dict[str, float]) -> bool:
    """Whether the averaged weights beat the last ones: on validation BLEU when both have it and it differs by
    ``BLEU_TIE`` or more (a run cut early can average undertrained checkpoints; a longer one gains from it, on
    BLEU even where NLL says otherwise), else on validation NLL, the average winning a tie."""
    if "valid_bleu" in avg and "valid_bleu" in last and abs(avg["valid_bleu"] - last["valid_bleu"]) >= BLEU_TIE:
        return avg["valid_bleu"] > last["valid_bleu"]
    return avg["valid_nll"] <= last["valid_nll"]


def describe_choice(avg: dict[str, float], last: dict[str, float], last_step: int, search: str = "greedy") -> str:
    """The scores behind :func:`prefer_average`'s choice, in words (``search``: how the BLEU was decoded)."""
    nll = f"NLL {avg['valid_nll']:.4f} against {last['valid_nll']:.4f}"
    if "valid_bleu" not in avg:
        return f"validation {nll} for the last step {last_step}"
    tie = " (a tie: NLL decides)" if abs(avg["valid_bleu"] - last["valid_bleu"]) < BLEU_TIE else ""
    return (f"validation BLEU ({search}) {avg['valid_bleu']:.2f} against {last['valid_bleu']:.2f} for the last "
            f"step {last_step}{tie}; {nll}")


def search_words(o: DecodeOptions) -> str:
    """How a validation BLEU was decoded, in words: the recipe's beam and length penalty, or greedy."""
    if o.sample or o.beam == 1:
        return "greedy"
    return f"the recipe's beam {o.beam}, {o.length_penalty} alpha {o.alpha:g}"
