"""``aiayn train`` and ``aiayn average`` as library functions."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from aiayn.config import SPEED_KEYS, Config, load_config, read_run_config, save_config
from aiayn.data.pipeline import (
    FITTED_KEYS,
    build_data,
    check_data_sources,
    check_prepared,
    corpus_of,
    fit_model_to_vocab,
)
from aiayn.device import Precision, check_fits_in_memory, choose_precision
from aiayn.engine import cpu_threads, set_cpu_threads
from aiayn.errors import CheckpointError, ConfigError, StoppedError, lost_worker
from aiayn.files import check_writable, guard_output, guard_output_dir, locked
from aiayn.launched import agent_stop_message, stopped_by_agent
from aiayn.model import build_model, count_parameters
from aiayn.run.ownership import flatten, own_run_dir, same_torchrun_job
from aiayn.run.weights import (
    FINAL_WEIGHTS,
    average_weights,
    checkpoint_paths,
    list_checkpoints,
    load_weights,
    read_weights,
    save_weights,
)
from aiayn.train.init_from import adopt_init_run, copy_init_tokenizer
from aiayn.train.metrics_log import check_log_backends
from aiayn.train.parallel import Dist, init_distributed
from aiayn.train.resume import CheckpointMeta, TrainState, resume_config
from aiayn.train.trainer import Trainer

log = logging.getLogger("aiayn.train")


def default_run_dir(config_path: str | Path) -> Path:
    return Path("runs") / Path(config_path).stem


def train(cfg: Config, run_dir: str | Path, resume: bool = False, progress: bool = True,
          init_from: str | Path | None = None) -> TrainState:
    """Train ``cfg`` into ``run_dir`` (single process, or one rank of a torchrun job). ``init_from``: a run
    whose weights, tokenizer and model section start the training (fine-tuning; :mod:`aiayn.train.init_from`).

    The device, the run directory (:mod:`aiayn.run.ownership`: new or empty, or ``resume`` of a run whose
    newest checkpoint is sound) and its lock are settled before any work; a start that fails removes what it
    created."""
    check_log_backends(cfg.train.log_to)  # a missing tracker package fails before anything is written
    check_fits_in_memory(cfg.model)  # likewise a model this machine cannot hold
    corpus_of(cfg).check(cfg)  # and batches wider than the model's positions (else the first batch fails)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    own_group = not (dist.is_available() and dist.is_initialized())  # a caller's own group stays the caller's
    d = init_distributed(cfg.train.device, cfg.train.dist_timeout_s, cfg.train.setup_timeout_s)
    threads = torch.get_num_threads()  # restored afterwards: a program that calls train() keeps its own setting
    try:
        # torchrun --max-restarts restarted the job: go on from its newest checkpoint. Agreed by every process: a
        # replacement node's agent counts its restarts from 0 while the others count on (docs/distributed.md).
        restart = d.max_of(restart)
        # A node joined or left a MIN:MAX job: the same agent starts its workers again, the restart count unchanged.
        rejoined = d.max_of(int(same_torchrun_job(run_dir))) if not restart else 0
        if (restart or rejoined) and not resume:
            if d.main:
                why = f"torchrun restart {restart}" if restart else "the job's nodes changed (a new rendezvous round)"
                log.info("%s: resuming %s from its newest checkpoint", why, run_dir)
            resume = True
        state = _train(cfg, Path(run_dir), resume, progress, d, init_from)
    except BaseException as e:
        if d.world > 1 and dist.is_initialized():  # leave the group before exiting: gloo aborts the process else
            dist.destroy_process_group()
        worker = lost_worker(e)  # the machine stopped it (a worker killed), not a bug: say how to go on
        if worker is not None and stopped_by_agent():  # torchrun's agent ended this process and its workers
            raise StoppedError(agent_stop_message()) from e
        if worker is not None:
            raise StoppedError(f"{worker}, so the training stopped; {resume_hint(Path(run_dir), d.world)}") from e
        raise
    finally:
        torch.set_num_threads(threads)
    if d.world > 1 and own_group and dist.is_initialized():  # done: leave the group (torchrun's workers exit)
        dist.destroy_process_group()
    return state


def resume_hint(run_dir: Path, world: int = 1) -> str:
    """What a stopped training's user runs next: its newest checkpoint, and the command that resumes from it."""
    steps = list_checkpoints(run_dir)
    kept = f"{run_dir} keeps its checkpoints (newest: update {steps[-1]})" if steps else \
        f"{run_dir} has no checkpoint yet"
    torchrun = " (under torchrun, --max-restarts N resumes by itself)" if world > 1 else ""
    return f"{kept}: resume with aiayn train --resume {run_dir}{torchrun}"


def _run_threads(cfg: Config, run_dir: Path, resume: bool) -> int:
    """The CPU threads of a training: train.threads; on a resume without it, the count the run's newest
    checkpoint was trained with (float sums depend on it: the same count keeps a resume bit-identical); else
    the machine's free cores (:func:`aiayn.engine.cpu_threads`)."""
    if cfg.train.threads is None and resume:
        try:
            meta = CheckpointMeta.newest(run_dir)
        except CheckpointError:  # the resume itself says what is wrong with it, and what to do
            meta = None
        if meta is not None and meta.cpu_threads is not None:
            return meta.cpu_threads
    return cpu_threads(cfg.train.threads)


def training_precision(asked: str, d: Dist) -> Precision:
    """The precision every process of the training runs in: rank 0's :func:`~aiayn.device.choose_precision`, taken
    by the others (:meth:`Dist.from_main`). ``auto`` on a CPU asks the machine's bf16 probe (:mod:`aiayn.cpu_probe`),
    whose first run times bf16 against fp32: processes probing side by side could answer differently and train one
    model in two precisions. bf16 on a CPU without native bf16 (or whose probe failed) is refused here, on every
    process in rank 0's words, before any work."""
    return d.from_main(lambda: choose_precision(asked, d.device, training=True))


def _train(cfg: Config, run_dir: Path, resume: bool, progress: bool, d: Dist,
           init_from: str | Path | None) -> TrainState:
    device = d.device
    precision = training_precision(cfg.train.precision, d)
    threads = set_cpu_threads(_run_threads(cfg, run_dir, resume)) if device.type == "cpu" else torch.get_num_threads()
    init = None
    if init_from is not None:  # before the config is checked and saved
        cfg, init = adopt_init_run(cfg, init_from)
    if not resume:  # a run that already trained keeps its config
        check_data_sources(cfg)
    check_prepared(cfg)  # a damaged token store is refused before the run directory is touched
    with own_run_dir(cfg, run_dir, resume, d, device, CheckpointMeta.read) as owner:
        existing = resume and bool(list_checkpoints(run_dir))  # what trainer.resume() will load
        if existing:  # checked before any work: what the resume may change, its world size, its time left
            check_resume_changes(cfg, run_dir)
            cfg = resume_config(cfg, run_dir, d.world)
        if init is not None and d.main and not existing:  # build_data then loads this tokenizer, trains none
            copy_init_tokenizer(init, run_dir)
        data, tok = build_data(cfg, run_dir, d.main, d.setup_barrier, d.world)
        cfg = fit_model_to_vocab(cfg, tok)
        if d.main and not existing:  # the vocabulary sizes are now known: record the config the model is built from
            save_config(cfg, run_dir / "config.yaml")
        check_fits_in_memory(cfg.model)  # again with the vocabulary's final size
        torch.manual_seed(cfg.train.seed)  # same initial weights on every process
        model = build_model(cfg.model, cfg.task)
        if init is not None and not existing:
            load_weights(model, init.weights)
        if d.main:
            log.info("model: %s, %.2fM parameters, device %s (%d CPU threads), %d process(es)", type(model).__name__,
                     count_parameters(model) / 1e6, device, threads, d.world)
            log.info("precision: %s (%s)", *precision)
        from aiayn.train.validation import validation_scores

        # what the run's task scores beside the validation NLL (validation BLEU: a translation's, a summarizer's)
        evaluate_extra = validation_scores(cfg, data, tok, cfg.kind.valid_scores if cfg.train.eval_bleu else ())
        trainer = Trainer(cfg, model, data, run_dir, d, precision, progress, evaluate_extra)
        if resume and trainer.resume():
            if d.main:
                # Only now: a resume whose config does not fit the run (tokenizer, model shape) has failed
                # above and left the run's config.yaml as it was, so the run still evaluates.
                save_config(cfg, run_dir / "config.yaml")
                log.info("resumed from step %d (epoch %d, update %d of the epoch)", trainer.state.step,
                         trainer.state.epoch, trainer.state.position)
        if owner is not None:
            owner.started()
        state = trainer.train()
    if d.main:
        log.info("done: %d updates, %.0f s; run directory %s", state.step, state.elapsed_s, run_dir)
    return state


def train_from_config(config: str | Path, run_dir: str | Path | None = None, overrides: list[str] | None = None,
                      resume: bool = False, progress: bool = True, init_from: str | Path | None = None) -> TrainState:
    """``aiayn train CONFIG``: the recipe with its ``overrides``, trained into ``run_dir`` (default runs/<name>),
    which the output guard checks first (:func:`aiayn.files.guard_output_dir`: not inside another run or a store,
    not a file, not the run ``init_from`` names, nor the recipe's own directory on a new training)."""
    run_dir = run_dir or default_run_dir(config)
    inputs = [init_from] if init_from is not None and Path(init_from).exists() else []
    if not resume and Path(config).is_file():  # a preset name, or a directory (refused as a recipe below): not one
        inputs.append(config)
    guard_output_dir(run_dir, inputs, "--run-dir")
    cfg = load_config(config, overrides)
    return train(cfg, run_dir, resume, progress, init_from)


# What a resumed run may change: when and how it stops, what it logs and keeps, where it runs, how it decodes, what
# its recipe is expected to reach.
# Everything else (the model, the data, the optimizer and its schedule) is the run's: changing it would make a
# run that is neither the old one nor a new one.
RESUME_KEYS = ("train.max_updates", "train.max_minutes", "train.max_epochs", "train.patience", "train.log_every",
               "train.eval_every", "train.save_every", "train.keep_last", "train.eval_bleu", "train.log_to",
               "train.inference_weights", "train.average_last", "train.device", "train.precision", "train.threads",
               "train.dist_timeout_s", "train.setup_timeout_s", "train.compile", "train.compile_mode", "decode.",
               "expect.", "data.loader_workers", *SPEED_KEYS)  # workers only collate the planned batches


def check_resume_changes(cfg: Config, run_dir: Path) -> None:
    """A resume of a recipe (``train CONFIG --run-dir RUN --resume``) may change what ``--resume RUN`` may
    (:data:`RESUME_KEYS`) and nothing else of RUN/config.yaml; one line names the first other key that differs.
    The model keys fitted to the tokenizer and the accumulation steps (fitted to the world size) are the run's."""
    try:
        old = flatten(read_run_config(run_dir).to_dict())
    except CheckpointError:  # a run from before config.yaml was complete: the checkpoint checks still hold
        return
    new = flatten(cfg.to_dict())
    fitted = {f"model.{k}" for k in FITTED_KEYS} | {"train.accum_steps"}
    for key in sorted(set(old) | set(new)):
        if key in fitted or may_change_on_resume(key) or old.get(key) == new.get(key):
            continue
        raise ConfigError(f"{key}={new.get(key)!r} but {run_dir}/config.yaml has {old.get(key)!r}: a resumed run keeps "
                          "its model, data and optimizer (aiayn train --help says what a resume may change); train "
                          "into a new --run-dir to change it")


def may_change_on_resume(key: str) -> bool:
    """Whether ``--set KEY=...`` may change ``key`` on a resume (:data:`RESUME_KEYS`)."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_KEYS)


def resume_run(run_dir: str | Path, overrides: list[str] | None = None, progress: bool = True) -> TrainState:
    """``aiayn train --resume RUN``: continue RUN with its own config.yaml; ``overrides`` may change only the
    keys of :data:`RESUME_KEYS` (e.g. more updates or minutes), checked before anything is read or written."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir}: not a run directory (no config.yaml); to resume a run of a recipe: "
                              "aiayn train CONFIG --run-dir RUN --resume")
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        if not may_change_on_resume(key):
            raise ConfigError(f"--set {key}: a resumed run keeps its model, data and optimizer; on --resume RUN only "
                              f"these may change: {', '.join(RESUME_KEYS)}")
    return train(read_run_config(run_dir, overrides), run_dir, resume=True, progress=progress)


AVERAGE_FILE = "average.safetensors"  # where `aiayn average` writes, beside model.safetensors


def _check_same_tensors(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], where: Path) -> None:
    """CheckpointError unless ``new`` holds the tensors of ``old`` (``where``), name for name and shape for shape."""
    if set(new) != set(old) or any(new[k].shape != old[k].shape for k in new):
        raise CheckpointError(f"{where}: the average holds other tensors than these weights (another model's "
                              "checkpoints?); --replace never writes them over it")


def average_run(run_dir: str | Path, last: int = 5, out: str | Path | None = None, replace: bool = False) -> Path:
    """Average the last ``last`` checkpoints into ``out`` (default RUN/average.safetensors, beside the run's
    model.safetensors, which stays as it is), or with ``replace`` into RUN/model.safetensors, atomically.
    Refused, with nothing written, for --last < 1, a run without checkpoints, an ``out`` the output guard refuses
    (:func:`aiayn.files.guard_output`: the run's other files, a checkpoint, an existing file that is not weights),
    a run a training is writing, a directory that cannot be written, a checkpoint holding NaN or an infinity, and,
    with ``replace``, an average that does not hold the tensors of the model.safetensors it would replace."""
    if last < 1:
        raise CheckpointError(f"--last must be at least 1, got {last}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: no such run directory")
    steps = list_checkpoints(run_dir)
    if not steps:
        raise CheckpointError(f"{run_dir}: no checkpoints to average")
    final = run_dir / FINAL_WEIGHTS
    target = final if replace else Path(out) if out is not None else run_dir / AVERAGE_FILE
    chosen = steps[-last:]
    sources = [checkpoint_paths(run_dir, s)[0] for s in chosen]
    if not replace and target.exists() and final.exists() and os.path.samefile(target, final):
        raise CheckpointError(f"--out {out}: that is the run's inference weights; --replace writes them")
    given = target if replace or out is None else out  # as typed: "newdir/" names a directory
    guard_output(given, "weights", [run_dir, *sources], "--replace" if replace else "--out",
                 creates=[run_dir / AVERAGE_FILE, *([final] if replace else [])])
    check_writable(target.parent)
    inside = target.resolve().parent == run_dir.resolve()
    with locked(run_dir) if inside else contextlib.nullcontext():  # a training may be writing the run
        avg = average_weights(sources)
        if replace and final.exists():  # never replaced by weights of another shape
            _check_same_tensors(avg, read_weights(final), final)  # (a damaged one is refused by the guard above)
        save_weights(avg, target, {"source": f"average of steps {chosen}"})
    log.info("averaged %d checkpoints (steps %s) into %s%s", len(chosen), chosen, target, "" if replace else (
        f" (the run's model.safetensors is as it was; score both: aiayn evaluate {run_dir} --split S "
        f"--weights {target})"))
    return target
