"""Typed configuration: model, data, training and decoding sections, YAML presets, ``--set`` overrides.

Unknown keys are an error (a typo in a recipe must not be silently ignored), and impossible model
shapes are rejected when the config is built, not deep inside a forward pass. A config is resolved once
and read-only after (frozen dataclasses): what training learns later (the model fitted to the tokenizer's
vocabulary, a run to start from) comes back as a new config (``dataclasses.replace``), never a mutation.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from aiayn.errors import ConfigError, first_line

# data.pretokenize's values; here, not in aiayn.data.tokenizer, so that reading a config does not import
# SentencePiece. The tokenizer imports this tuple.
PRETOKENIZERS = ("none", "moses")

# train.compile_mode's values (torch.compile's modes).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# train.log_to's values: metrics.jsonl (always) and the trackers (aiayn.train.metrics), each the name of its package.
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")

# Presets ship inside the package (a wheel install has them); the repository's configs/ links here.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# The largest value of every size and count, one table for the recipes, the command line (--set, the decoding
# flags) and the server (whose requests go through DecodeOptions): past these a value is a typo or an attack,
# not a model. The lower bounds sit beside each field's check; a model whose weights would not fit in this
# machine's memory is refused where it is built (check_fits_in_memory), not here: a config is the same everywhere.
# docs/configuration.md lists them (a test keeps it true).
COUNT = 2**62  # updates, steps, epochs, checkpoints: far beyond any real run, and within a 64-bit integer
SEED = 2**64 - 1  # torch.manual_seed takes 0 .. 2**64 - 1
MIN_TEMPERATURE = 1e-6  # logits / a smaller temperature can overflow fp32 (1e-320 gives inf); 0 means greedy
LIMITS: dict[str, float] = {
    "model.vocab_size": 2**24, "model.tgt_vocab_size": 2**24, "model.d_model": 65536, "model.n_heads": 4096,
    "model.d_k": 65536, "model.d_v": 65536,
    "model.d_ff": 2**20, "model.n_encoder_layers": 1024, "model.n_decoder_layers": 1024, "model.max_positions": 2**20,
    "model.pad_id": 2**24, "data.vocab_size": 2**24, "data.tokenizer_sample": 2**40, "data.max_tokens": 2**31,
    "data.update_tokens": 2**40,
    "data.max_len": 2**20, "data.block_size": 2**20, "data.batch_size": 2**20, "data.pad_to_multiple": 4096,
    "train.max_updates": COUNT, "train.max_epochs": COUNT, "train.max_minutes": 1e9, "train.warmup": COUNT,
    "train.accum_steps": 2**20, "train.seed": SEED, "train.log_every": COUNT, "train.eval_every": COUNT,
    "train.save_every": COUNT, "train.keep_last": COUNT, "train.patience": COUNT, "train.average_last": 2**20,
    "train.threads": 4096, "train.useful_updates": COUNT, "train.lr": 1e3, "train.lr_scale": 1e6,
    "train.clip_norm": 1e12, "train.weight_decay": 1e3,
    "decode.beam": 1024, "decode.nbest": 1024, "decode.alpha": 1e3, "decode.max_len_a": 1e3, "decode.max_len_b": 2**20,
    "decode.min_len": 2**20, "decode.no_repeat_ngram": 2**20, "decode.temperature": 1e4, "decode.top_k": 2**24,
    "decode.seed": SEED, "decode.max_new_tokens": 2**20, "decode.max_tokens": 2**31,
}


def _check_limits(section: str, obj: Any) -> None:
    """Every field of ``section`` that has a ceiling in :data:`LIMITS` is within it (a one-line ConfigError)."""
    for key, ceiling in LIMITS.items():
        sec, _, name = key.partition(".")
        value = getattr(obj, name) if sec == section else None
        if isinstance(value, float) and not math.isfinite(value):
            _finite(key, value)  # inf / nan: said as such, not as "over the ceiling"
        if value is not None and not isinstance(value, bool) and abs(value) > ceiling:
            digits = str(value) if isinstance(value, int) else ""
            shown = f"{value:.3g}" if isinstance(value, float) else (
                f"{digits[:12]}... ({len(digits)} digits)" if len(digits) > 24 else digits)
            raise ConfigError(f"{key}={shown}: must be at most {ceiling:g}" if isinstance(ceiling, float)
                              else f"{key}={shown}: must be at most {ceiling:,}")


def physical_memory() -> int | None:
    """Bytes of memory this machine has (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def check_fits_in_memory(cfg: ModelConfig) -> None:
    """Refuse, in one line, a model whose fp32 weights and position tables alone exceed this machine's memory.
    A check of the machine, not of the config (a config is the same on every machine): commands call it before
    they build a model (:func:`aiayn.model.build_model`, ``aiayn train`` before any work)."""
    need, have = cfg.memory_bytes(), physical_memory()
    if have is not None and need > have:
        raise ConfigError(f"model: its weights and position tables alone need about {need / 2**30:,.1f} GiB in "
                          f"fp32 (d_model={cfg.d_model}, max_positions={cfg.max_positions}, vocabulary "
                          f"{cfg.vocab_size}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers), more "
                          f"than this machine's {have / 2**30:,.1f} GiB")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the Transformer (paper section 3). Defaults are paper-base (Table 3)."""

    vocab_size: int = 37000  # source vocabulary (or the shared one)
    tgt_vocab_size: int | None = None  # None: same vocabulary as the source
    d_model: int = 512
    n_heads: int = 8
    d_k: int | None = None  # query/key width per head; None: d_model / n_heads (Table 3 row B varies it)
    d_v: int | None = None  # value width per head; None: d_model / n_heads
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1  # P_drop: sub-layer outputs and embedding+position sums
    attention_dropout: float = 0.0  # on attention probabilities (not in the paper)
    activation_dropout: float = 0.0  # after the FFN activation (not in the paper)
    activation: str = "relu"  # relu (paper) | gelu | swish
    norm_first: bool = False  # False: post-LN as the paper; True: pre-LN + final LayerNorm
    layer_norm_eps: float = 1e-5
    positional: str = "sinusoidal"  # sinusoidal (paper) | learned (Table 3 row E)
    positional_layout: str = "interleaved"  # interleaved (section 3.5) | concat (sin half | cos half)
    max_positions: int = 1024
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model) (section 3.4)
    share_embeddings: bool = True  # one matrix for source and target embeddings
    tie_output: bool = True  # target embedding shared with the pre-softmax projection
    output_bias: bool = False  # a bias on the logits (Marian's final_logits_bias)
    pad_id: int = 0

    def __post_init__(self) -> None:
        _check_limits("model", self)
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_positions"):
            _at_least(f"model.{name}", getattr(self, name), 1)
        for name in ("tgt_vocab_size", "d_k", "d_v"):
            if getattr(self, name) is not None:
                _at_least(f"model.{name}", getattr(self, name), 1)
        _at_least("model.n_encoder_layers", self.n_encoder_layers, 0, "(0: no encoder)")
        _at_least("model.n_decoder_layers", self.n_decoder_layers, 1)
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            _fraction(f"model.{name}", getattr(self, name))
        _positive("model.layer_norm_eps", self.layer_norm_eps)
        if (self.d_k is None or self.d_v is None) and self.d_model % self.n_heads:
            raise ConfigError(
                f"model: d_model={self.d_model} is not divisible by n_heads={self.n_heads} "
                "(set model.d_k and model.d_v to choose the head widths)"
            )
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"model: sinusoidal positions need an even d_model, got {self.d_model}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError(f"model: pad_id={self.pad_id} outside the vocabulary")
        _choice("model.activation", self.activation, ("relu", "gelu", "swish"))
        _choice("model.positional", self.positional, ("sinusoidal", "learned"))
        _choice("model.positional_layout", self.positional_layout, ("interleaved", "concat"))
        if self.share_embeddings and self.tgt_vocab_size not in (None, self.vocab_size):
            raise ConfigError(
                "model: share_embeddings needs one vocabulary "
                f"(vocab_size={self.vocab_size}, tgt_vocab_size={self.tgt_vocab_size})"
            )

    def memory_bytes(self) -> int:
        """fp32 bytes of the model's parameters and position tables (an estimate made before building it)."""
        D, F, P, H = self.d_model, self.d_ff, self.max_positions, self.n_heads
        Vt, QK, V = self.target_vocab_size, self.n_heads * self.key_width, self.n_heads * self.value_width
        embed = self.vocab_size * D + (0 if self.share_embeddings else Vt * D) + (0 if self.tie_output else Vt * D)
        attention = (2 * QK + V) * (D + 1) + V * D + D  # in_proj (Q | K | V) and out_proj, with biases
        ffn = 2 * D * F + F + D
        layers = self.n_encoder_layers * (attention + ffn) + self.n_decoder_layers * (2 * attention + ffn)
        positions = 2 * P * D  # one table (or learned matrix) each for the encoder and the decoder
        return 4 * (embed + layers + positions + H)

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size if self.tgt_vocab_size is not None else self.vocab_size

    @property
    def key_width(self) -> int:
        """d_k: the width of each head's queries and keys."""
        return self.d_k if self.d_k is not None else self.d_model // self.n_heads

    @property
    def value_width(self) -> int:
        """d_v: the width of each head's values."""
        return self.d_v if self.d_v is not None else self.d_model // self.n_heads

    @property
    def default_head_widths(self) -> bool:
        """True when d_k = d_v = d_model / n_heads, the only widths the HF Marian and CTranslate2 formats hold."""
        return self.d_model % self.n_heads == 0 and self.key_width == self.value_width == self.d_model // self.n_heads


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it becomes batches."""

    dataset: str | None = None  # multi30k | wmt14 | tinyshakespeare | xsum | reverse | None (files below)
    src_lang: str = "en"
    tgt_lang: str = "de"
    train_src: str | None = None
    train_tgt: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    format: str = "text"  # text (parallel files, optionally .gz) | tsv | jsonl
    src_field: str = "src"  # jsonl / tsv column names
    tgt_field: str = "tgt"
    tokenizer: str = "bpe"  # bpe (SentencePiece) | char
    vocab_size: int = 8000
    shared_vocab: bool = True
    byte_fallback: bool = True
    # BPE only: the tokenizer lowercases all text it encodes (training data, sources at translate time),
    # so the model reads and writes lowercase, as the Multi30k literature trains. Off by default.
    lowercase: bool = False
    # none | moses: Moses punctuation normalization + tokenization (sacremoses, in src_lang / tgt_lang)
    # in front of the tokenizer, as the Multi30k literature prepares text before its BPE; decode
    # detokenizes. Translation only. Off by default: the paper's BPE reads raw text.
    pretokenize: str = "none"
    tokenizer_sample: int = 2_000_000  # sentences SentencePiece trains on at most
    max_tokens: int = 4096  # token budget of one batch (source or target, the larger) of one process
    # The paper's batch size: the token budget of one update over all processes and accumulation steps (translation
    # and summarization). When set, each batch gets update_tokens // (processes x train.accum_steps) and max_tokens
    # is not used, so 8 GPUs train with the same batch as 1 GPU with accum_steps 8.
    update_tokens: int | None = None
    # A directory holding the corpus tokenized once into flat token-id files (aiayn prepare CONFIG --out DIR;
    # translation). Training then reads batches from it lazily, by position: memory independent of the corpus
    # size. When it holds nothing yet, or a store of other inputs or settings, the training prepares it first.
    prepared: str | None = None
    max_len: int | None = None  # drop longer pairs; None: the model's max_positions
    block_size: int = 256  # language modelling: tokens per training block
    batch_size: int = 32  # language modelling: blocks per batch
    separator: str = " <sep> "  # summarization as language modelling: document <sep> summary
    valid_fraction: float = 0.1  # language modelling: last part held out (nanoGPT splits 90/10)
    # Bounded batch shapes (translation; aiayn.data.batching): S and T of every batch rounded up to a
    # multiple (8 on GPUs: tensor-core sizes, few distinct shapes; 1: no extra padding, CPU default) ...
    pad_to_multiple: int = 1
    # ... and, when set (increasing lengths, e.g. [16, 32, 48, 64, 96, 128]), fixed shapes: a batch
    # whose longest side fits bucket L becomes (max_tokens // L) x L on both sides, one shape per bucket
    # (train.compile then compiles one static graph per bucket; CUDA graphs need this).
    length_buckets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_limits("data", self)
        _choice("data.format", self.format, ("text", "tsv", "jsonl"))
        _choice("data.tokenizer", self.tokenizer, ("bpe", "char"))
        if self.lowercase and self.tokenizer != "bpe":
            raise ConfigError("data.lowercase needs data.tokenizer: bpe (a char tokenizer does not lowercase)")
        _choice("data.pretokenize", self.pretokenize, PRETOKENIZERS)
        if self.dataset == "wmt14" and self.prepared is None:
            raise ConfigError("data.dataset: wmt14 (4.5M pairs) trains from a prepared store: set data.prepared "
                              "to a directory (the training prepares it on its first start)")
        for name in ("vocab_size", "tokenizer_sample", "max_tokens", "block_size", "batch_size"):
            _at_least(f"data.{name}", getattr(self, name), 1)
        if self.max_len is not None:
            _at_least("data.max_len", self.max_len, 2, "(a token and the EOS / BOS)")
        if self.update_tokens is not None:
            _at_least("data.update_tokens", self.update_tokens, 1)
        _finite("data.valid_fraction", self.valid_fraction)
        if not 0.0 < self.valid_fraction < 1.0:
            raise ConfigError(f"data.valid_fraction={self.valid_fraction}: expected a number in (0, 1)")
        self._check_shape_keys()

    def _check_shape_keys(self) -> None:
        if self.pad_to_multiple < 1:
            raise ConfigError("data.pad_to_multiple must be >= 1 (1: no extra padding)")
        buckets = self.length_buckets
        if (not isinstance(buckets, (list, tuple))
                or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)
                or list(buckets) != sorted(set(buckets))):
            raise ConfigError(f"data.length_buckets={buckets!r}: expected a list of increasing positive integers")
        object.__setattr__(self, "length_buckets", list(buckets))  # frozen: set once, while building


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation (paper section 5.3-5.4) and the loop around it."""

    max_updates: int = 100_000
    max_epochs: int | None = None
    max_minutes: float | None = None  # wall-clock budget of the training loop (time-to-quality recipes)
    schedule: str = "noam"  # noam (paper) | inverse_sqrt (peak lr) | constant
    lr_scale: float = 1.0  # noam: lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    lr: float = 5e-4  # inverse_sqrt / constant: the peak learning rate
    warmup: int = 4000
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    accum_steps: int = 1  # micro-batches per update
    clip_norm: float | None = None
    precision: str = "auto"  # auto (bf16 on CUDA where supported, else fp32) | fp32 | tf32 | bf16 | fp16
    compile: bool = False
    seed: int = 1
    log_every: int = 50
    eval_every: int = 1000
    eval_bleu: bool = False  # also decode the validation set with greedy search and report BLEU
    save_every: int = 1000
    keep_last: int = 5
    patience: int | None = None  # evaluations without improvement before stopping early
    inference_weights: str = "last"  # which weights model.safetensors holds: last | best | average
    average_last: int = 5  # checkpoints averaged when inference_weights is 'average'
    device: str = "auto"
    # Seconds a collective of a multi-process training may wait (torch.distributed's process-group timeout), and
    # seconds the other processes wait while rank 0 prepares the data (tokenizer, store, caches; on a group of its own).
    dist_timeout_s: float = 1800.0
    setup_timeout_s: float = 86400.0
    # metrics.jsonl (always) plus optional trackers: tensorboard (RUN/tensorboard), wandb (RUN/wandb, offline
    # unless WANDB_MODE says otherwise). A tracker whose package is missing is an error, not silence.
    log_to: list[str] = field(default_factory=lambda: ["jsonl"])
    # torch.compile mode when compile is on: default | reduce-overhead (CUDA graphs: for small,
    # launch-bound models, with data.length_buckets so shapes repeat) | max-autotune (longer compile)
    compile_mode: str = "default"
    # CPU threads of the training process (None: chosen for the machine and the model, aiayn.engine.cpu_threads)
    threads: int | None = None
    # What the recipe's updates gave, measured (docs/results.md): (updates, validation BLEU) points, for the
    # estimate a run prints once its speed is known; and the updates below which its model is not useful
    # (train, translate and evaluate say so). Neither changes the training.
    reference_bleu: list[tuple[int, float]] = field(default_factory=list)
    useful_updates: int | None = None

    def __post_init__(self) -> None:
        _check_limits("train", self)
        _choice("train.schedule", self.schedule, ("noam", "inverse_sqrt", "constant"))
        for name in self.log_to:
            _choice("train.log_to", name, LOG_BACKENDS)
        if "jsonl" not in self.log_to or len(set(self.log_to)) != len(self.log_to):
            raise ConfigError(f"train.log_to={self.log_to}: must list jsonl (report, curves and resume read "
                              "metrics.jsonl) and each tracker once")
        _choice("train.precision", self.precision, ("auto", "fp32", "tf32", "bf16", "fp16"))
        _choice("train.inference_weights", self.inference_weights, ("last", "best", "average"))
        for name in ("max_updates", "accum_steps", "log_every", "eval_every", "save_every", "average_last"):
            _at_least(f"train.{name}", getattr(self, name), 1)
        for name in ("max_epochs", "patience"):
            if getattr(self, name) is not None:
                _at_least(f"train.{name}", getattr(self, name), 1)
        for name in ("max_minutes", "clip_norm", "dist_timeout_s", "setup_timeout_s"):
            if getattr(self, name) is not None:
                _positive(f"train.{name}", getattr(self, name))
        # 0 is a real learning rate: it freezes the weights (the early-stopping test trains with lr 0).
        _at_least("train.lr", self.lr, 0)
        _at_least("train.lr_scale", self.lr_scale, 0)
        # noam divides by warmup^1.5; inverse_sqrt treats 0 as "no warm-up"; constant ignores it
        _at_least("train.warmup", self.warmup, 1 if self.schedule == "noam" else 0,
                  "(schedule noam divides by it)" if self.schedule == "noam" else "")
        object.__setattr__(self, "adam_betas", tuple(self.adam_betas))  # YAML gives a list
        for i, beta in enumerate(self.adam_betas):
            _fraction(f"train.adam_betas[{i}]", beta)
        _positive("train.adam_eps", self.adam_eps)
        _at_least("train.weight_decay", self.weight_decay, 0)
        _fraction("train.label_smoothing", self.label_smoothing)
        _at_least("train.seed", self.seed, 0)
        _choice("train.compile_mode", self.compile_mode, COMPILE_MODES)
        for name in ("threads", "useful_updates"):
            if getattr(self, name) is not None:
                _at_least(f"train.{name}", getattr(self, name), 1)
        if [u for u, _ in self.reference_bleu] != sorted({u for u, _ in self.reference_bleu}):
            raise ConfigError("train.reference_bleu: expected [updates, BLEU] pairs with increasing updates")
        _at_least("train.keep_last", self.keep_last, 0, "(0: keep every checkpoint)")


# Token budget of one decoding batch (source tokens x beam) when neither the options nor the run set one:
# on a GPU a large batch is what makes decoding fast; on a CPU larger batches stop paying off early.
DEFAULT_DECODE_TOKENS = {"cpu": 4096, "cuda": 32768, "mps": 8192}


LENGTH_PENALTIES = ("gnmt", "power", "none")  # gnmt (paper) | power (fairseq, HF, CTranslate2) | none
STOP_RULES = ("exact", "hf")  # beam search's stopping rule


@dataclass(frozen=True)
class Flag:
    """A decoding option's command-line flag: its help, whether only searching commands take it (translate,
    evaluate, summarize; not generate), its choices and metavar."""

    help: str
    search: bool = False
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def flag(help: str, search: bool = False, choices: tuple[str, ...] | None = None,
         metavar: str | None = None) -> dict[str, Flag]:
    """The field metadata that makes a :class:`DecodeOptions` field a command-line option."""
    return {"flag": Flag(help, search, choices, metavar)}


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode, in one object: the run's ``decode`` section, then per-call overrides from the CLI,
    the Python API and the server (:meth:`replace`). Defaults are the paper's (section 6.1: beam 4,
    alpha 0.6, maximum output length input + 50). The searches read it inside one
    :class:`aiayn.search.SearchSpec`; adding a decoding option means a field here (with a ``flag`` for the
    command line, which aiayn.cli builds from it) and its step in :mod:`aiayn.search.processing`.

    Search: ``sample`` draws each token (``temperature``, then ``top_k``, then ``top_p`` filtering; a
    generator seeded by ``seed``; temperature 0 is greedy); otherwise ``beam`` 1 is greedy search and
    ``beam`` > 1 beam search with ``length_penalty`` (gnmt = paper, power = fairseq/HF/CTranslate2)
    and the ``stop`` rule (exact: never stops before the best hypothesis is certain; hf: Hugging Face's
    heuristic). ``nbest`` hypotheses per input (beam search: at most ``beam``; sampling: that many draws).
    ``ban_pad``: the pad id's logit is -inf before every softmax (Hugging Face's ``bad_words_ids=[[pad]]``
    with ``renormalize_logits``, which Marian / OPUS-MT generation configs set; runs imported from them).
    """

    # Each field with a ``flag`` is also a command-line option (--name-with-dashes; aiayn.cli builds them from here).
    beam: int = field(default=4, metadata=flag("beam size; 1 = greedy (default: the run's, paper: 4)", search=True))
    alpha: float = field(default=0.6, metadata=flag("length penalty alpha (paper: 0.6)", search=True))
    length_penalty: str = field(default="gnmt", metadata=flag(
        "gnmt: score/((5+|Y|)/6)^alpha (paper); power: score/|Y|^alpha (fairseq, HF, CTranslate2)", search=True,
        choices=LENGTH_PENALTIES))
    # at most int(max_len_a * source length + max_len_b) decoding steps (EOS included)
    max_len_a: float = field(default=1.0, metadata=flag("at most a * source length + b decoding steps (paper: 1)",
                                                        search=True))
    max_len_b: int = field(default=50, metadata=flag("(paper: 50)", search=True))
    min_len: int = field(default=0, metadata=flag("no EOS before this many tokens", search=True))
    nbest: int = field(default=1, metadata=flag("hypotheses per input (at most the beam; sampling: draws)",
                                                search=True))
    stop: str = field(default="exact", metadata=flag("beam stopping rule (exact: never early; hf: HF's)",
                                                     search=True, choices=STOP_RULES))
    # n > 0: no output repeats one of its own n-grams (not in the paper; summaries)
    no_repeat_ngram: int = field(default=0, metadata=flag("never repeat an n-gram of the output (0: off)",
                                                          metavar="N"))
    ban_pad: bool = False  # never produce the pad id (Marian runs: generate's bad_words_ids [[pad]], renormalized)
    sample: bool = field(default=False, metadata=flag(
        "draw tokens (--temperature, --top-k, --top-p, --seed) instead of searching", search=True))
    temperature: float = field(default=1.0, metadata=flag("sampling temperature (0: greedy)"))
    top_k: int | None = field(default=None, metadata=flag("sample among the k most probable tokens"))
    top_p: float | None = field(default=None, metadata=flag("sample from the smallest set with probability mass "
                                                            ">= p"))
    seed: int | None = field(default=None, metadata=flag("seed of the draws (repeatable sampling)"))
    # language models and summaries: tokens to generate (None: the command's; each command has its own option)
    max_new_tokens: int | None = None
    # token budget of one decoding batch; None: by device (DEFAULT_DECODE_TOKENS)
    max_tokens: int | None = field(default=None, metadata=flag("token budget of one decoding batch (default: by "
                                                               "device)", search=True))

    def __post_init__(self) -> None:
        _check_limits("decode", self)
        _choice("decode.length_penalty", self.length_penalty, LENGTH_PENALTIES)
        _choice("decode.stop", self.stop, STOP_RULES)
        _at_least("decode.beam", self.beam, 1)
        _finite("decode.alpha", self.alpha)
        _at_least("decode.max_len_a", self.max_len_a, 0)
        _at_least("decode.max_len_b", self.max_len_b, 0)
        _at_least("decode.min_len", self.min_len, 0)
        _at_least("decode.no_repeat_ngram", self.no_repeat_ngram, 0, "(0: off)")
        _at_least("decode.nbest", self.nbest, 1)
        if not self.sample and self.nbest > self.beam:
            raise ConfigError(f"decode.nbest={self.nbest}: at most the beam size ({self.beam}) hypotheses exist")
        _at_least("decode.temperature", self.temperature, 0, "(0: greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"decode.temperature={self.temperature:g}: 0 (greedy) or at least {MIN_TEMPERATURE:g} "
                              "(a smaller one overflows the logits)")
        if self.top_k is not None:
            _at_least("decode.top_k", self.top_k, 1)
        if self.seed is not None:
            _at_least("decode.seed", self.seed, 0)
        if self.top_p is not None and not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"decode.top_p={self.top_p}: expected a number in (0, 1]")
        if self.max_new_tokens is not None:
            _at_least("decode.max_new_tokens", self.max_new_tokens, 0)
        if self.max_tokens is not None:
            _at_least("decode.max_tokens", self.max_tokens, 1)

    def replace(self, **overrides: Any) -> DecodeOptions:
        """A validated copy with the given options replacing these; None means "keep this one"."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown decoding option {unknown[0]} (known: {', '.join(sorted(known))})")
        values = {k: _coerce(v, DECODE_HINTS[k], f"decode.{k}") for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **values)

    def batch_tokens(self, device_type: str) -> int:
        """The token budget of one decoding batch: ``max_tokens``, or the device's default."""
        return self.max_tokens or DEFAULT_DECODE_TOKENS.get(device_type, DEFAULT_DECODE_TOKENS["cpu"])


DecodeConfig = DecodeOptions  # the config section's name (``decode:`` in a recipe)


@dataclass(frozen=True)
class Config:
    """The whole recipe: ``task`` picks encoder-decoder translation or a decoder-only LM."""

    task: str = "translation"  # translation | lm | summarization
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeOptions = field(default_factory=DecodeOptions)

    def __post_init__(self) -> None:
        _choice("task", self.task, ("translation", "lm", "summarization"))
        if self.data.pretokenize != "none" and self.task != "translation":
            raise ConfigError(f"data.pretokenize={self.data.pretokenize!r} is for translation, not task {self.task}")
        if not self.data.shared_vocab and self.model.share_embeddings and self.task != "lm":
            raise ConfigError("data.shared_vocab=false needs model.share_embeddings=false (two vocabularies)")

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts and lists (YAML and JSON have no tuples)."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{name}={value}: expected a finite number")


def _at_least(name: str, value: float, low: float, note: str = "") -> None:
    _finite(name, value)
    if value < low:
        raise ConfigError(f"{name}={value}: must be >= {low}" + (f" {note}" if note else ""))


def _positive(name: str, value: float) -> None:
    _finite(name, value)
    if value <= 0:
        raise ConfigError(f"{name}={value}: must be > 0")


def _fraction(name: str, value: float) -> None:
    """A probability-like value in [0, 1): dropout, label smoothing, Adam's betas."""
    _finite(name, value)
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{name}={value}: expected a number in [0, 1)")


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(map(str, allowed))}")


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from a dict, recursing into nested sections; reject unknown keys."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]} (known: {', '.join(sorted(known))})"
        )
    kwargs = {}
    for key, value in values.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{where}.{key}" if where else key)
        else:
            kwargs[key] = _coerce(value, hint, f"{where}.{key}" if where else key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - defensive, fields are checked above
        raise ConfigError(str(e)) from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check (and mildly coerce: int -> float, str -> number from --set) a value against its hint."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{where}: may not be null")
    if args and type(None) in args:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            value = [value]  # --set train.log_to=tensorboard: one item
        return [_coerce(v, args[0], where) for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


DECODE_HINTS = typing.get_type_hints(DecodeOptions)


def config_from_dict(values: dict[str, Any]) -> Config:
    """Build a validated :class:`Config` from nested dicts (as read from YAML)."""
    return _build(Config, values or {}, "")


def model_config(preset_or_values: str | dict[str, Any] | None = None, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a preset name in ``configs/`` (e.g. ``"paper-base"``) or a dict.

    >>> cfg = model_config("tiny", vocab_size=100)
    """
    values: dict[str, Any] = {}
    if isinstance(preset_or_values, str):
        values = dict(load_yaml(resolve_config_path(preset_or_values)).get("model", {}))
    elif isinstance(preset_or_values, dict):
        values = dict(preset_or_values)
    values.update(overrides)
    return _build(ModelConfig, values, "model")


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path as given, or a preset name looked up in ``configs/`` (``paper-base`` -> configs/paper-base.yaml)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    for candidate in (CONFIG_DIR / f"{name_or_path}.yaml", CONFIG_DIR / str(name_or_path)):
        if candidate.exists():
            return candidate
    presets = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))) if CONFIG_DIR.exists() else ""
    raise ConfigError(f"config {name_or_path}: no such file or preset (presets: {presets})")


def preset_summary(path: str | Path) -> str:
    """A recipe's one-line summary: the first line of the comment at the top of its YAML file."""
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if line.strip("# "):
            return line.lstrip("# ").rstrip()
    return ""


def list_presets() -> list[tuple[str, str]]:
    """(name, one-line summary) of every recipe in ``configs/``, by name."""
    return [(p.stem, preset_summary(p)) for p in sorted(CONFIG_DIR.glob("*.yaml"))]


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping naming one key twice is an error: PyYAML keeps the last
    value silently, so a recipe edited by hand could train with a setting its reader does not see."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: the key {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, where: str) -> Any:
    """YAML text as Python values; what PyYAML cannot read, what it reads into a crash (nesting deeper than the
    interpreter's stack, an integer longer than Python converts), and a key given twice in one mapping, is one
    ConfigError naming ``where``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion", ...
        why = "an integer too long to be a setting" if "digits" in str(e) else first_line(e)
        raise ConfigError(f"{where}: holds {why}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file; a directory, a binary file, bad UTF-8 or bad YAML is a one-line ConfigError."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a YAML file")
    raw = p.read_bytes()  # a missing or unreadable file: OSError naming it, one line at the command line
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        bad = raw[e.start]
        raise ConfigError(f"{path}: not a YAML file (line {line}: byte 0x{bad:02x} is not valid UTF-8)") from None
    data = _parse_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=v`` strings; ``v`` is parsed as YAML (so 0.1, true, [0.9, 0.98] work)."""
    out = dict(values)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = _parse_yaml(raw, f"--set {key}")
        except ConfigError as e:
            if "not valid YAML" not in str(e):
                raise
            value = raw
        node: dict[str, Any] = {}
        cur = node
        parts = key.strip().split(".")
        for p in parts[:-1]:
            cur[p] = {}
            cur = cur[p]
        cur[parts[-1]] = value
        out = _merge(out, node)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML recipe (which may name a ``base:`` preset to extend) and apply ``--set`` overrides."""
    values = load_yaml(resolve_config_path(path))
    base = values.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected the name or path of a config to extend, got {base!r:.60}")
    if base is not None:
        base_values = load_yaml(resolve_config_path(base))
        base_values.pop("base", None)
        values = _merge(base_values, values)
    values = apply_overrides(values, overrides or [])
    return config_from_dict(values)


def read_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> Config:
    """RUN/config.yaml (with ``overrides``) as a validated config; a file that is not UTF-8, not YAML or not a
    valid config is a one-line CheckpointError naming it."""
    from aiayn.errors import CheckpointError

    cfg_path = Path(run_dir) / "config.yaml"
    try:
        return load_config(cfg_path, overrides)
    except ConfigError as e:
        msg = str(e)
        raise CheckpointError(msg if msg.startswith(str(cfg_path)) else f"{cfg_path}: {msg}") from None


def save_config(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as YAML to ``path`` atomically (a run reads its config.yaml back: never half-written)."""
    from aiayn.files import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
