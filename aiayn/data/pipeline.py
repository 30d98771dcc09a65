"""From a config to training data: read the corpus, train or load the tokenizer, encode, filter, batch.

Translation: token-budget batches of (source, target) pairs. Language modelling: windows of one token stream
read from its store (:mod:`aiayn.data.stream_store`), or "document <sep> summary" rows built from a store of
(document, summary) pairs; the store a training prepares itself lives in ``$AIAYN_CACHE_DIR/stores/<key>``.
Every drop (empty line, too long) is counted in the log, never silent.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import Config, ConfigError
from aiayn.data.batching import (
    Batch,
    LMData,
    batch_shape,
    collate_flat,
    pair_costs,
    plan_batches,
    token_batches,
)
from aiayn.data.corpus import DataError, describe_clean_stats
from aiayn.data.registry import dataset_of
from aiayn.data.store import PairSource, Recipe, Side, cached_store_dir, read_manifest
from aiayn.data.stream_store import stream_recipe
from aiayn.data.summarization import (
    SummaryLMData,
    rows_prompt,
    separator_ids,
    summary_lm_recipe,
)
from aiayn.data.tokenizer import BOS_ID, UNK_ID, SpecialIds, Tokenizer, TokenizerPair

log = logging.getLogger("aiayn.data")


def tokenizer_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "tokenizer"


# The model keys fit_model_to_vocab sets from the tokenizer, whatever a recipe says (not part of the recipe).
FITTED_KEYS = ("vocab_size", "tgt_vocab_size", "pad_id")


def fit_model_to_vocab(cfg: Config, tok: TokenizerPair) -> Config:
    """``cfg`` with the model's vocabulary sizes and pad id taken from the tokenizer (the recipe's numbers are
    only requests): the keys :data:`FITTED_KEYS`. A new config; ``cfg`` is not changed."""
    if not tok.shared and cfg.model.share_embeddings:
        raise ConfigError("data.shared_vocab=false needs model.share_embeddings=false (two vocabularies)")
    model = dataclasses.replace(cfg.model, vocab_size=tok.src.vocab_size,
                                tgt_vocab_size=None if tok.shared else tok.tgt.vocab_size, pad_id=tok.specials.pad)
    return dataclasses.replace(cfg, model=model)


@dataclass(kw_only=True)
class TranslationData:
    """Encoded training/validation pairs, the sides of a token store read by position (only their offsets in
    memory); batches by token budget, reshuffled per epoch. Pickles as file names (:class:`~aiayn.data.store.Side`),
    so DataLoader workers collate from the files themselves."""

    src: Side
    tgt: Side
    valid_src: Side
    valid_tgt: Side
    max_tokens: int
    seed: int
    specials: SpecialIds = SpecialIds()  # pad / eos / decoder start of the run's tokenizer
    pad_to_multiple: int = 1  # data.pad_to_multiple
    buckets: tuple[int, ...] = ()  # data.length_buckets

    def __post_init__(self) -> None:
        self._padded = self.pad_to_multiple > 1 or bool(self.buckets)
        self._src_lens = self._lengths(self.src)
        self._tgt_lens = self._lengths(self.tgt)
        self._valid: list[Batch] | None = None

    def _lengths(self, seqs: Side) -> np.ndarray:
        # token_batches adds the EOS / BOS itself, and unpadded batching counts it once more (+1 here): a batch
        # slightly under its budget. Kept because the plan decides which batches a seed gives, and so the recorded
        # results; padded batches cost exactly what collate builds.
        return seqs.lengths() + (0 if self._padded else 1)

    def _batches(self, src: Side, tgt: Side, lens: tuple[np.ndarray, np.ndarray], epoch: int, shuffle: bool
                 ) -> list[Batch]:
        idx = token_batches(*lens, self.max_tokens, self.seed, epoch, shuffle=shuffle,
                            pad_to_multiple=self.pad_to_multiple, buckets=self.buckets)
        return [self._collate(src, tgt, b) for b in idx]

    def epoch_plan(self, epoch: int) -> list[np.ndarray]:
        """The epoch's training batches as arrays of example indices, in training order (the batches of
        :func:`~aiayn.data.batching.token_batches`): planned from the lengths alone, so an epoch starts in
        seconds whatever the corpus; a process collates only the batches it trains on (:meth:`collate_plan`),
        when it needs them."""
        return plan_batches(self._src_lens, self._tgt_lens, self.max_tokens, self.seed, epoch, shuffle=True,
                            pad_to_multiple=self.pad_to_multiple, buckets=self.buckets)

    def pair_costs(self) -> np.ndarray:
        """(pairs,) what each training pair alone costs of a batch's budget, as the plan counts it (a pair over the
        budget forms a batch of its own)."""
        return pair_costs(self._src_lens, self._tgt_lens, self.pad_to_multiple, self.buckets)

    def plan_tokens(self, indices: np.ndarray) -> int:
        """The target tokens (each target and its EOS) of a planned batch: its ``Batch.ntokens``, uncollated."""
        # tgt_out's non-pad tokens are y and EOS: the planning length, which counts the EOS when unpadded
        return int(self._tgt_lens[indices].sum()) + (len(indices) if self._padded else 0)

    def collate_plan(self, indices: np.ndarray) -> Batch:
        """The batch of a planned index array."""
        return self._collate(self.src, self.tgt, np.asarray(indices).tolist())

    def epoch_batches(self, epoch: int) -> list[Batch]:
        """Every batch of an epoch, collated (the plan's order)."""
        return [self.collate_plan(b) for b in self.epoch_plan(epoch)]

    @property
    def valid_batches(self) -> list[Batch]:
        if self._valid is None:
            lens = (self._lengths(self.valid_src), self._lengths(self.valid_tgt))
            self._valid = self._batches(self.valid_src, self.valid_tgt, lens, 0, shuffle=False)
        return self._valid

    def _collate(self, src: Side, tgt: Side, indices: list[int]) -> Batch:
        # a batch's ids read flat (one read per run of adjacent pairs) and padded with numpy
        sp, idx = self.specials, np.asarray(indices, dtype=np.int64)
        s_flat, t_flat = src.gather(idx), tgt.gather(idx)
        shape = None
        if self._padded:  # tensor widths: + EOS on the source, + BOS / EOS on the target
            shape = batch_shape((s_flat[1] + 1).tolist(), (t_flat[1] + 1).tolist(), self.max_tokens,
                                self.pad_to_multiple, self.buckets)
        return collate_flat(s_flat, t_flat, indices, sp.pad, sp.decoder_start, sp.eos, shape=shape)


def batch_budget(cfg: Config, world: int = 1) -> int:
    """The token budget of one batch of one process: ``data.update_tokens`` shared out over the ``world``
    processes and ``train.accum_steps`` accumulation steps of an update, else ``data.max_tokens``."""
    d, k = cfg.data, cfg.train.accum_steps
    if d.update_tokens is None:
        return d.max_tokens
    budget = d.update_tokens // (world * k)
    if budget < 1:
        raise ConfigError(f"data.update_tokens={d.update_tokens} is fewer than one token per batch for {world} "
                          f"process(es) x {k} accumulation step(s)")
    return budget


def pair_sources(cfg: Config) -> tuple[dict[str, PairSource], dict[str, str]]:
    """The train and valid pairs of a translation or summarization config as streams (a function giving a fresh
    iterator each call: corpus files are read line by line, never whole), and what they are read from: each
    file's sha256, or a known dataset's name, split and languages (its download is checked against its published
    sha256)."""
    cfg.kind.check_does("pairs", cfg.data.dataset or "data")
    return dataset_of(cfg).sources(cfg.data, cfg.kind)


def corpus_recipe(cfg: Config, workers: int | None = None) -> Recipe:
    """The store a config trains from, its tokenizer trained by the store: its :class:`Corpus`'s recipe."""
    return corpus_of(cfg).recipe(cfg, None, workers)


def prepare_corpus(cfg: Config, out: str | Path, workers: int | None = None, rebuild: bool = True):
    """``aiayn prepare CONFIG --out DIR``: tokenize the config's train and valid pairs (a language model's text
    or (document, summary) pairs: :func:`corpus_recipe`) into the store ``out`` (:func:`aiayn.data.store.prepare_store`;
    reused as it is when its inputs and settings are unchanged and its files check out, else rebuilt; with
    ``rebuild=False`` a store that is there is only read), waiting at most ``train.setup_timeout_s`` for another
    process that prepares it."""
    from aiayn.data.store import prepare_store

    return prepare_store(out, corpus_recipe(cfg, workers), rebuild, cfg.train.setup_timeout_s)


def verify_store(directory: str | Path, wait_s: float | None = None) -> list[str]:
    """``aiayn prepare --verify DIR``: every problem of the store in ``directory``, one line each (none: sound).
    Every file is read: its checksum (written when it was prepared) and the store's shape and ids, whatever the memo
    of earlier openings says; nothing is written. Under the store's shared lock (never while a builder replaces its
    files), waited for at most ``wait_s`` seconds (``train.setup_timeout_s``'s default)."""
    from aiayn.config import TrainConfig
    from aiayn.data.store import open_locked

    path = Path(directory)
    return open_locked(path, _verify, TrainConfig().setup_timeout_s if wait_s is None else wait_s)


def _verify(path: Path) -> list[str]:
    from aiayn.data.integrity import Memo, check_files
    from aiayn.data.store import open_kind, opened_manifest

    try:
        manifest = opened_manifest(path)
    except DataError as e:
        return [str(e)]
    memo = Memo(path, enabled=False)  # the one place that reads every file, whatever earlier openings found
    try:
        open_kind(path, memo=memo)  # of the kind its manifest names
        return []
    except DataError as e:
        problems = [str(e)]
    files = manifest.get("files")
    if isinstance(files, dict):  # every changed file, not only the first the opening stopped at
        for problem in check_files(path, files, memo, skip=set(memo.entries)):  # entries: found good above
            if not any(problem.split(":")[0] in p for p in problems):
                problems.append(f"{path}/{problem}")
    return problems


def check_data_sources(cfg: Config) -> None:
    """Before a new training starts: a named ``data.dataset`` brings its own files, so files given beside it would
    be ignored without a word (and the run would train on the dataset); one DataError naming both instead."""
    d = cfg.data
    files = [f"data.{k}" for k in ("train_src", "train_tgt", "valid_src", "valid_tgt") if getattr(d, k)]
    if d.dataset is not None and files:
        raise DataError(f"data.dataset={d.dataset} and {', '.join(files)} are both set: a named dataset brings its "
                        "own files (add --set data.dataset=null to read yours)")


def check_prepared(cfg: Config) -> None:
    """Before a training makes its run directory: a store that ``data.prepared`` names, when it is there, is only
    read (:func:`aiayn.data.store.open_only`): one DataError naming the store and the ``aiayn prepare`` command
    if it is damaged or was prepared for other settings or inputs. A named directory that is new or empty is
    prepared later, under its lock; a store in the cache (no ``data.prepared``) is rebuilt when damaged."""
    from aiayn.data.integrity import MANIFEST
    from aiayn.data.store import open_locked, open_only

    if cfg.data.prepared is None or not (Path(cfg.data.prepared) / MANIFEST).exists():
        return
    recipe = corpus_recipe(cfg)
    open_locked(Path(cfg.data.prepared), lambda path: open_only(path, recipe), cfg.train.setup_timeout_s)


def build_translation_data(cfg: Config, run_dir: Path, is_main: bool = True, barrier=lambda: None, world: int = 1
                           ) -> tuple[TranslationData, TokenizerPair]:
    """Translation (or summarization) pairs read lazily from a token store (:func:`run_store`: every process
    asks, one builds it under the store's lock and the others wait on the lock, outside any collective), batched
    by :func:`batch_budget` for ``world`` processes. The store's tokenizer becomes the run's. A damaged
    ``data.prepared`` store is refused (one line: ``aiayn prepare`` rebuilds it), never trained on."""
    budget = batch_budget(cfg, world)  # refused before any reading
    sources, inputs = pair_sources(cfg)
    recipe = corpus_of(cfg).recipe  # a translation's pairs, or a summarizer's documents (cut to the model)
    store, tok = run_store(cfg, run_dir, lambda t: recipe(cfg, t, None, (sources, inputs)), is_main, barrier)
    tdir = tokenizer_dir(run_dir)
    if tok.pretokenize != cfg.data.pretokenize:
        raise ConfigError(f"{tdir}: the run's tokenizer has pretokenize={tok.pretokenize!r} but the config "
                          f"says data.pretokenize={cfg.data.pretokenize!r}")
    fit_model_to_vocab(cfg, tok)  # refuses a tokenizer the model cannot take
    train, valid = store.splits["train"], store.splits["valid"]
    data = TranslationData(src=train.src, tgt=train.tgt, valid_src=valid.src, valid_tgt=valid.tgt,
                           max_tokens=budget, seed=cfg.train.seed, specials=tok.specials,
                           pad_to_multiple=cfg.data.pad_to_multiple, buckets=tuple(cfg.data.length_buckets))
    costs = check_budget(cfg, data, world)
    if is_main:
        max_len = cfg.data.max_len or cfg.model.max_positions
        for name, info in store.manifest["splits"].items():
            log.info("%s: %s; %s source + %s target tokens, from the store %s", name,
                     describe_clean_stats(info["stats"], max_len), f"{info['src_tokens']:,}",
                     f"{info['tgt_tokens']:,}", store.path)
        _log_budget(cfg, budget, world, costs)
    return data, tok


def _budget_setting(cfg: Config, world: int) -> tuple[str, int]:
    """The setting that makes a batch's budget, and the least value of it that gives each batch ``1`` token."""
    if cfg.data.update_tokens is None:
        return f"data.max_tokens={cfg.data.max_tokens}", 1
    return f"data.update_tokens={cfg.data.update_tokens}", world * cfg.train.accum_steps


def check_budget(cfg: Config, data: TranslationData, world: int) -> np.ndarray:
    """The training pairs' costs against a batch's budget (:func:`~aiayn.data.batching.pair_costs`): a budget below
    the cheapest pair would train every pair alone, over the budget, and is refused in one line; returns the costs
    (the log says how many pairs are over it)."""
    costs = data.pair_costs()
    least = int(costs.min()) if len(costs) else 0
    if least > data.max_tokens:
        setting, per_token = _budget_setting(cfg, world)
        raise ConfigError(f"{setting} gives each batch {data.max_tokens:,} token(s), fewer than the shortest training "
                          f"pair needs ({least} with its end-of-sequence token): every batch would be one pair over "
                          f"the budget; raise it to at least {least * per_token:,}")
    return costs


def _log_budget(cfg: Config, budget: int, world: int, costs: np.ndarray) -> None:
    """The batches as they are: their budget, an update's, the rounding of data.update_tokens, and the pairs that
    train alone because they cost more than the budget."""
    k, update = cfg.train.accum_steps, cfg.data.update_tokens
    why = ""
    if update is not None:
        why = " (data.update_tokens)" if budget * world * k == update else (
            f" (data.update_tokens={update:,} rounded down to {budget * world * k:,}: shared out in whole tokens "
            f"over {world} process(es) x {k} batch(es))")
    log.info("batches of at most %s tokens; an update: %d process(es) x %d batch(es) = at most %s tokens%s",
             f"{budget:,}", world, k, f"{budget * world * k:,}", why)
    over = int((costs > budget).sum())
    if over:
        log.info("%s of %s training pairs need more than %s tokens (up to %s): each of them trains in a batch of its "
                 "own, over the budget", f"{over:,}", f"{len(costs):,}", f"{budget:,}", f"{int(costs.max()):,}")


def _pair_recipe(cfg: Config, tokenizer: Path | None = None, workers: int | None = None,
                 read: tuple[dict[str, PairSource], dict[str, str]] | None = None, cut_sources: bool = False
                 ) -> Recipe:
    """The store of (source, target) pairs (:class:`~aiayn.data.store.PairRecipe`); ``read``: the pairs' sources
    and inputs when already known (:func:`pair_sources`); ``cut_sources``: a source too long is cut to fit, not
    dropped (a summarizer's documents)."""
    from aiayn.data.store import PairRecipe

    sources, inputs = read or pair_sources(cfg)
    return PairRecipe(cfg=cfg, sources=sources, inputs=inputs, tokenizer=tokenizer, workers=workers,
                      cut_sources=cut_sources)


def _document_recipe(cfg: Config, tokenizer: Path | None = None, workers: int | None = None,
                     read: tuple[dict[str, PairSource], dict[str, str]] | None = None) -> Recipe:
    """The store of (document, summary) pairs of an encoder-decoder: pairs whose documents are cut to the
    model's positions."""
    return _pair_recipe(cfg, tokenizer, workers, read, cut_sources=True)


def _rows_recipe(cfg: Config, tokenizer: Path | None = None, workers: int | None = None) -> Recipe:
    """The store of the (document, summary) pairs of summarization as language modelling
    (:func:`~aiayn.data.summarization.summary_lm_recipe`); ``tokenizer``: the run's, else the store trains one."""
    sources, inputs = dataset_of(cfg).sources(cfg.data, cfg.kind)
    return summary_lm_recipe(cfg, sources, inputs, tokenizer, workers)


def _store_dir(cfg: Config, recipe: Recipe) -> Path:
    """``data.prepared``, else the cache's store of this recipe's key (shared by every run of the same data)."""
    return Path(cfg.data.prepared) if cfg.data.prepared is not None else cached_store_dir(recipe.key)


def _trained_with(out: Path, key: str, tdir: Path) -> bool:
    """Whether ``out`` holds the store of ``key`` whose own tokenizer is the one in ``tdir``, byte for byte."""
    from aiayn.data.store import tokenizer_digest

    manifest = read_manifest(out)
    return (manifest is not None and manifest.get("key") == key and (out / "tokenizer").is_dir()
            and tokenizer_digest(tdir) == tokenizer_digest(out / "tokenizer"))


def run_store(cfg: Config, run_dir: Path, recipe_of: Callable[[Path | None], Recipe], is_main: bool = True,
              barrier=lambda: None) -> tuple[Any, TokenizerPair]:
    """The store a run trains from, prepared when missing (every process asks; one builds under the store's lock),
    and the run's tokenizer. ``recipe_of(tokenizer)``: the config's store, its tokenizer given or (None) trained.
    The store is ``data.prepared`` when set, else the cache's (:func:`~aiayn.data.store.cached_store_dir`). A new
    run takes the store's tokenizer. A run that has one (``--resume``, ``--init-from``) keeps it: a cached store of
    its own training when that store's tokenizer is the same, else a store prepared with it (its key includes the
    tokenizer's files); a named store must have been prepared with it (never rebuilt for another tokenizer)."""
    from aiayn.data.store import prepare_store, tokenizer_digest

    barrier()  # the main process writes nothing before this: every process sees whether the run has a tokenizer
    tdir = tokenizer_dir(run_dir)
    has, named = (tdir / "tokenizer.json").exists(), cfg.data.prepared is not None
    recipe = recipe_of(None)
    out = _store_dir(cfg, recipe)
    if has and not named and not _trained_with(out, recipe.key, tdir):
        recipe = recipe_of(tdir)
        out = cached_store_dir(recipe.key)
    # a store the user named is only read (damage or other settings: one line; aiayn prepare rebuilds it); the
    # cache's is rebuilt
    store = prepare_store(out, recipe, rebuild=not named, wait_s=cfg.train.setup_timeout_s)
    if has and named and tokenizer_digest(tdir) != tokenizer_digest(store.tokenizer_dir):
        raise ConfigError(f"{tdir}: the run's tokenizer is not the one {out} was prepared with")
    if is_main and not has:
        shutil.copytree(store.tokenizer_dir, tdir, dirs_exist_ok=True)
    barrier()
    return store, TokenizerPair.load(tdir)


def _check_block(cfg: Config) -> None:
    if cfg.data.block_size > cfg.model.max_positions:
        raise ConfigError(f"data.block_size={cfg.data.block_size} exceeds model.max_positions="
                          f"{cfg.model.max_positions}")


def build_summary_lm_data(cfg: Config, run_dir: Path, is_main: bool = True, barrier=lambda: None, world: int = 1
                          ) -> tuple[SummaryLMData, TokenizerPair]:
    """"document <sep> summary" rows, one per article, read from the store of the (document, summary) pairs
    (:func:`run_store`; the tokenizer holds the separator as one piece); every one of ``world`` processes reads
    them all."""
    _check_block(cfg)
    store, tok = run_store(cfg, run_dir, lambda t: _rows_recipe(cfg, t), is_main, barrier)
    sep_ids = separator_ids(tok.src, cfg.data.separator)
    data = SummaryLMData(store.splits["train"], store.splits["valid"], sep_ids, cfg.data.block_size,
                         cfg.data.batch_size, cfg.train.seed)
    if is_main:
        for name, rows in data.rows.items():
            log.info("%s: %d document<sep>summary sequences (%d documents cut to fit %d tokens, %d articles "
                     "dropped: empty, or the summary alone too long)", name, len(rows), rows.cut,
                     cfg.data.block_size + 1, rows.dropped + store.manifest["splits"][name]["stats"]["empty"])
    return data, tok


def build_lm_data(cfg: Config, run_dir: Path, is_main: bool = True, barrier=lambda: None
                  ) -> tuple[LMData | SummaryLMData, TokenizerPair]:
    """A language model's data: windows of the store's token stream (:class:`~aiayn.data.batching.LMData`),
    or "document <sep> summary" rows (:func:`build_summary_lm_data`): its :class:`Corpus`'s."""
    return corpus_of(cfg).build(cfg, run_dir, is_main, barrier, 1)


def build_stream_data(cfg: Config, run_dir: Path, is_main: bool = True, barrier=lambda: None, world: int = 1
                      ) -> tuple[LMData, TokenizerPair]:
    """Windows of the store's token stream (:class:`~aiayn.data.batching.LMData`)."""
    _check_block(cfg)
    store, tok = run_store(cfg, run_dir, lambda t: stream_recipe(cfg, t), is_main, barrier)
    train, valid = store.splits["train"], store.splits["valid"]
    if is_main:
        log.info("lm: %d train tokens, %d valid tokens (%s tokenizer, vocab %d; store %s)", len(train), len(valid),
                 tok.src.kind, tok.src.vocab_size, store.path)
    return LMData(train, valid, cfg.data.block_size, cfg.data.batch_size, cfg.train.seed), tok


def build_data(cfg: Config, run_dir: Path, is_main: bool = True, barrier=lambda: None, world: int = 1):
    """(TrainData, TokenizerPair) for one of ``world`` processes: the config's :class:`Corpus` builds them."""
    return corpus_of(cfg).build(cfg, run_dir, is_main, barrier, world)


def stream_prompt(tok: Tokenizer, prompt: str) -> list[int]:
    """The ids a model of one token stream continues ``prompt`` from: it never saw BOS, so an empty prompt starts
    from a new line when the tokenizer knows one."""
    if prompt:
        return tok.encode(prompt)
    newline = tok.encode("\n")
    return newline if newline and UNK_ID not in newline else [BOS_ID]


def no_check(cfg: Config) -> None:
    """A corpus whose batches need no check against the model before a training."""


@dataclass(frozen=True)
class Corpus:
    """What a run trains on, as the pipeline reads and batches it, resolved once per config (:func:`corpus_of`):
    its store's recipe (``recipe(cfg, tokenizer, workers)``), its training data (``build(cfg, run_dir, is_main,
    barrier, world)``), whether its batches have fixed shapes (``fixed_shapes(cfg)``: compiled with a static
    graph per shape), what it checks before a training (``check(cfg)``: batches the model's positions can hold)
    and the ids a model trained on it continues a text prompt from (``prompt(tok, text)``). The pipeline, the
    training and generation call it instead of asking the task."""

    name: str
    recipe: Callable[..., Recipe]
    build: Callable[..., tuple[Any, TokenizerPair]]
    fixed_shapes: Callable[[Config], bool]
    check: Callable[[Config], None] = no_check
    prompt: Callable[[Tokenizer, str], list[int]] = stream_prompt


PAIRS = Corpus("pairs", _pair_recipe, build_translation_data, lambda cfg: bool(cfg.data.length_buckets),
               Config.check_pair_widths)
DOCUMENTS = dataclasses.replace(PAIRS, name="documents", recipe=_document_recipe)
STREAM = Corpus("stream", lambda cfg, tokenizer=None, workers=None: stream_recipe(cfg, tokenizer, workers),
                build_stream_data, lambda cfg: True)
ROWS = Corpus("rows", _rows_recipe, build_summary_lm_data, lambda cfg: False, prompt=rows_prompt)
# Each by the name a task gives it (:meth:`aiayn.task.Task.corpus`).
CORPORA: dict[str, Corpus] = {c.name: c for c in (PAIRS, DOCUMENTS, STREAM, ROWS)}


def corpus_of(cfg: Config) -> Corpus:
    """A config's :class:`Corpus`, the one its task names (:meth:`aiayn.task.Task.corpus`): a translation's
    (source, target) pairs, a summarizer's documents, a language model's token stream or, when its dataset is
    (document, summary) pairs, its "document <sep> summary" rows."""
    return CORPORA[cfg.kind.corpus(lambda: dataset_of(cfg).summaries(cfg.data))]
