"""The dataset registry: each named ``data.dataset``, and the config's own files, as one entry with its behaviour.

:func:`lookup` is the one place that reads the name; the pipeline, the stores, summarization and evaluation ask
the entry it returns: its kind (the task it is a corpus of), its pairs of a split, its train and valid streams and
what identifies them (a store's key), its text (a language model's) and its test splits. A new dataset is one
entry of :data:`REGISTRY`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

from aiayn.config import Config, ConfigError, DataConfig
from aiayn.data.corpus import DataError, check_file, iter_pairs, read_pairs, split_files
from aiayn.data.datasets import (
    DATASETS,
    MULTI30K_SPLITS,
    dataset_path,
    multi30k_split,
    sha256_known,
    wmt14_split,
    wmt14_train_pairs,
    xsum_sha256,
)
from aiayn.data.store import PairSource
from aiayn.data.summarization import XSUM_SPLITS, xsum_pairs
from aiayn.data.synthetic import SPLITS as REVERSE_SPLITS
from aiayn.data.synthetic import reverse_split
from aiayn.task import TASKS, Task

Pair = tuple[str, str]
Sources = tuple[dict[str, PairSource], dict[str, str]]  # the train and valid streams, and what they are read from
TRAIN_VALID = ("train", "valid")


class Dataset:
    """The config's own files (no ``data.dataset``), and what every named dataset answers.

    ``kind``: the task it is a corpus of (None: any, as the config's task reads its files). ``test_splits``: the
    splits a sweep tests on when none are named. ``lead_1``: a summary evaluation scores the lead-1 baseline
    beside it. ``shared_store``: Table 3 prepares one store per seed for all its rows (else each row trains the
    same tokenizer again). ``lm_summaries``: a language model of it trains on "document <sep> summary" rows."""

    name: str | None = None
    kind: Task | None = None
    test_splits: tuple[str, ...] = ()
    lead_1 = False
    shared_store = True
    lm_summaries = False

    def serves(self, task: Task) -> bool:
        """Whether a config of ``task`` can read it."""
        return self.kind is None or self.kind is task

    def offered_to(self, task: Task) -> bool:
        """Whether a message naming the datasets ``task`` reads names this one: those of its kind, and (document,
        summary) data that the task reads as a corpus of its own (a language model's "document <sep> summary" rows,
        not its running text: :meth:`aiayn.task.Task.corpus`)."""
        return self.kind is task or (self.lm_summaries and task.corpus(lambda: True) != task.corpus(lambda: False))

    def summaries(self, data: DataConfig) -> bool:
        """Whether a language model of it trains on "document <sep> summary" rows (JSONL files: (document,
        summary) pairs) rather than one text stream."""
        return self.lm_summaries or (self.name is None and data.format == "jsonl")

    def pairs(self, data: DataConfig, task: Task, split: str) -> list[Pair]:
        """The (source, target) texts of ``split``; a summary's texts on one line each."""
        if split not in TRAIN_VALID:
            raise DataError(task.split_error(split))
        src, tgt = split_files(data, split)
        return list(task.texts(read_pairs(data.format, src, tgt, data.src_field, data.tgt_field)))

    def sources(self, data: DataConfig, task: Task) -> Sources:
        """The train and valid pairs as streams (files read line by line, never whole; a summary's texts on one
        line), and what they are read from: each file's sha256 (a known dataset's: its published identity)."""

        def stream(src: str, tgt: str | None) -> Iterator[Pair]:
            return iter(task.texts(iter_pairs(data.format, src, tgt, data.src_field, data.tgt_field)))

        sources, inputs = {}, {}
        for split in TRAIN_VALID:
            src, tgt = split_files(data, split)
            sources[split] = (lambda s=src, t=tgt: stream(s, t))
            for path in (src, tgt):
                if path is not None:
                    inputs[str(path)] = sha256_known(check_file(path))
        return sources, inputs

    def text(self, data: DataConfig) -> tuple[Path, dict[str, str]]:
        """A language model's text file and what it is for the store's key (its sha256)."""
        if data.train_src is None:
            raise ConfigError("task lm needs data.dataset: tinyshakespeare or data.train_src: a text file")
        path = check_file(data.train_src)
        return path, {str(path): sha256_known(path)}


class Named(Dataset):
    """A known dataset: its files come with it (read whole: the small ones are), each split by name."""

    def split_pairs(self, data: DataConfig, split: str) -> list[Pair]:
        raise DataError(f"dataset {self.name!r} has no pairs")

    def pairs(self, data: DataConfig, task: Task, split: str) -> list[Pair]:
        return self.split_pairs(data, split)

    def text(self, data: DataConfig) -> tuple[Path, dict[str, str]]:
        raise DataError(f"dataset {self.name!r} is not one text")

    def identity(self, data: DataConfig, task: Task) -> dict[str, str]:
        langs = f"{data.src_lang}-{data.tgt_lang}"
        return {f"{self.name}/{s}/{langs}": "published" for s in TRAIN_VALID}

    def sources(self, data: DataConfig, task: Task) -> Sources:
        return ({s: (lambda s=s: iter(self.split_pairs(data, s))) for s in TRAIN_VALID}, self.identity(data, task))


class Reverse(Named):
    """The synthetic reversal task (:mod:`aiayn.data.synthetic`), for any encoder-decoder."""

    name, kind, test_splits, shared_store = "reverse", TASKS["translation"], ("test",), False

    def serves(self, task: Task) -> bool:  # any task that reads (source, target) pairs
        return task.refusal("pairs") is None

    def split_pairs(self, data: DataConfig, split: str) -> list[Pair]:
        return reverse_split(split)

    def identity(self, data: DataConfig, task: Task) -> dict[str, str]:
        return {f"reverse/{s}": "synthetic:{}:{}".format(*REVERSE_SPLITS[s]) for s in TRAIN_VALID}


class Multi30k(Named):
    """Multi30k (valid = its val split; the test sets by their names)."""

    name, kind = "multi30k", TASKS["translation"]
    test_splits = tuple(s for s in MULTI30K_SPLITS if s.startswith("test"))

    def split_pairs(self, data: DataConfig, split: str) -> list[Pair]:
        return multi30k_split("val" if split == "valid" else split, data.src_lang, data.tgt_lang)


class WMT14(Named):
    """WMT14 En-De: 4.5M training pairs streamed from their files; valid and test through sacreBLEU."""

    name, kind, test_splits, shared_store = "wmt14", TASKS["translation"], ("test",), False

    def split_pairs(self, data: DataConfig, split: str) -> list[Pair]:
        if split == "train":
            raise DataError("wmt14's 4.5M training pairs are streamed into a token store, never held in a list")
        return wmt14_split(split, data.src_lang, data.tgt_lang)

    def sources(self, data: DataConfig, task: Task) -> Sources:
        langs = f"{data.src_lang}-{data.tgt_lang}"
        return ({"train": lambda: wmt14_train_pairs(data.src_lang, data.tgt_lang),
                 "valid": lambda: iter(self.split_pairs(data, "valid"))},
                {**{f"wmt14/{name}/{langs}": f.sha256 for name, f in DATASETS["wmt14"].files.items()},
                 f"sacrebleu/wmt13/{langs}": "published"})


class XSum(Named):
    """The 1,000-row XSum sample: (document, summary) pairs for an encoder-decoder or a language model."""

    name, kind, lead_1, shared_store, lm_summaries = "xsum", TASKS["summarization"], True, False, True
    # Two spellings of the same pairs, by the corpus a task reads of them (:meth:`aiayn.task.Task.corpus`): the
    # stores prepared under each keep their keys; a language model's "document <sep> summary" rows name the file.
    KEYS = MappingProxyType({"rows": "xsum/xsum-1000.jsonl/{split}{rows}"})

    def serves(self, task: Task) -> bool:
        return True

    def split_pairs(self, data: DataConfig, split: str) -> list[Pair]:
        return xsum_pairs(split)

    def identity(self, data: DataConfig, task: Task) -> dict[str, str]:
        sha, key = xsum_sha256(), self.KEYS.get(task.corpus(lambda: self.summaries(data)), "xsum/{split}")
        return {key.format(split=s, rows=XSUM_SPLITS[s]): sha for s in TRAIN_VALID}


class TinyShakespeare(Named):
    """tinyshakespeare: one text, a language model's."""

    name, kind, shared_store = "tinyshakespeare", TASKS["lm"], False

    def text(self, data: DataConfig) -> tuple[Path, dict[str, str]]:
        return (dataset_path("tinyshakespeare", "input.txt"),
                {"tinyshakespeare/input.txt": DATASETS["tinyshakespeare"].files["input.txt"].sha256})


FILES = Dataset()
REGISTRY: Mapping[str, Dataset] = MappingProxyType({d.name: d for d in (
    Multi30k(), WMT14(), Reverse(), XSum(), TinyShakespeare())})


def lookup(name: str | None, task: Task) -> Dataset:
    """The entry of ``data.dataset`` = ``name`` (None: the config's files) for a config of ``task``; a one-line
    error naming the datasets ``task`` can read when it cannot read this one."""
    entry = FILES if name is None else REGISTRY.get(name)
    if entry is not None and entry.serves(task):
        return entry
    raise task.dataset_error(name, sorted(n for n, d in REGISTRY.items() if d.offered_to(task)))


def dataset_of(cfg: Config) -> Dataset:
    """The entry a config reads (:func:`lookup`)."""
    return lookup(cfg.data.dataset, cfg.kind)


def pairs(cfg: Config, split: str) -> list[Pair]:
    """(source, reference) pairs of a split of the config's dataset: a translation's, or (document, summary)
    pairs on one line each."""
    return dataset_of(cfg).pairs(cfg.data, cfg.kind, split)


def config_pairs(data: DataConfig, split: str) -> list[Pair]:
    """Sentence pairs of a translation :class:`~aiayn.config.DataConfig`'s dataset or files and ``split``."""
    return lookup(data.dataset, TASKS["translation"]).pairs(data, TASKS["translation"], split)
