"""The config's sections as frozen dataclasses: the model (paper section 3), the data, the training (sections 5.3-5.4
and the loop), the decoding options (section 6.1) and what a recipe is expected to reach (the first-hour messages),
and :class:`Config` holding them. Each section checks its values when it is built (:mod:`aiayn.config.checks`)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from aiayn.config.checks import (
    MIN_TEMPERATURE,
    _at_least,
    _check_limits,
    _choice,
    _coerce,
    _finite,
    _fraction,
    _positive,
)
from aiayn.errors import ConfigError, did_you_mean
from aiayn.task import TASKS, Task

# data.pretokenize's values; here, not in aiayn.data.tokenizer, so that reading a config does not import
# SentencePiece. The tokenizer imports this tuple.
PRETOKENIZERS = ("none", "moses")

# train.compile_mode's values (torch.compile's modes).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# The training's speed levers (aiayn.train.update.Levers): how fast an update runs, not what it computes, so a resume
# may change them and a Table 3 result does not depend on them.
SPEED_KEYS = ("train.cast_weights_once", "train.fused_output_loss", "train.fuse_norms", "train.attention_backends")

# train.attention_backends' values (PyTorch's SDPA backends by aiayn.engine's names; here, so that reading a config
# does not import torch).
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")

# train.log_to's values: metrics.jsonl (always) and the trackers (aiayn.train.metrics_log), each its package's name.
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")


@dataclass(frozen=True, kw_only=True)
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
    positional: str = "sinusoidal"  # sinusoidal (paper) | learned (Table 3 row E) | rotary (RoFormer; not the paper)
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
        if self.positional == "rotary" and self.key_width % 2:
            raise ConfigError(f"model: rotary positions need an even query/key width per head (they turn pairs of "
                              f"dimensions), got d_k={self.key_width}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError(f"model: pad_id={self.pad_id} outside the vocabulary")
        _choice("model.activation", self.activation, ("relu", "gelu", "swish"))
        _choice("model.positional", self.positional, ("sinusoidal", "learned", "rotary"))
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


@dataclass(frozen=True, kw_only=True)
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
    # Where the corpus tokenized once into flat token-id files (a token store) lives. Training always reads its
    # batches from a store, lazily, by position: memory independent of the corpus size. Unset: the training
    # prepares it itself into $AIAYN_CACHE_DIR/stores/<key> (default ~/.cache/aiayn), shared by every run of the
    # same inputs and settings. Set: this directory (aiayn prepare CONFIG --out DIR fills it ahead of training;
    # when it holds nothing yet, or a store of other inputs or settings, the training prepares it first).
    prepared: str | None = None
    # Worker processes that read and collate batches ahead of the step (torch DataLoader), per training process.
    # None: the cores the training leaves free, at least 1, at most 4 (aiayn.data.loader.loader_workers);
    # 0: collate in the training process itself.
    loader_workers: int | None = None
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
        for name in ("vocab_size", "tokenizer_sample", "max_tokens", "block_size", "batch_size"):
            _at_least(f"data.{name}", getattr(self, name), 1)
        if self.max_len is not None:
            _at_least("data.max_len", self.max_len, 2, "(a token and the EOS / BOS)")
        if self.update_tokens is not None:
            _at_least("data.update_tokens", self.update_tokens, 1)
        if self.loader_workers is not None:
            _at_least("data.loader_workers", self.loader_workers, 0)
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


@dataclass(frozen=True, kw_only=True)
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
    # auto (bf16 on CUDA where supported, and on a CPU whose native bf16 passed aiayn.cpu_probe; else fp32) | fp32 |
    # tf32 | bf16 | fp16
    precision: str = "auto"
    # torch.compile of the layers and the loss: true | false | auto (on CUDA for runs of at least
    # aiayn.engine.COMPILE_AUTO_MIN_UPDATES updates and minutes, where the compile time pays off; never on a CPU)
    compile: bool | str = "auto"
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
    # Speed levers (aiayn.train.update.Levers; each computes what the plain update computes, exactly in fp32):
    # bf16 / fp16: the weights cast to that dtype once per micro-batch and the forward run in it (fp32 master weights in
    # the optimizer), instead of autocast's casts of weights and activations at every use
    # (auto: on where the CPU trains in bf16, where it measured faster: BENCHMARKS.md "1b"; off elsewhere)
    cast_weights_once: bool | str = "auto"
    # the output projection and the label-smoothed loss in one pass over row chunks: the batch's (N, V) logits are
    # never materialized (aiayn.train.loss.projected_cross_entropy)
    fused_output_loss: bool | str = "auto"  # (auto: on a CPU)
    # each residual + dropout + layer norm compiled into fused kernels (regions; implied by train.compile)
    fuse_norms: bool = False
    # CUDA attention backends in order of preference (flash, efficient, cudnn, math); empty: aiayn's choice
    # (flash, efficient, math; aiayn.engine.kernels)
    attention_backends: list[str] = field(default_factory=list)

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
        for name in ("compile", "cast_weights_once", "fused_output_loss"):
            value = getattr(self, name)
            value = {"true": True, "false": False}.get(str(value).lower(), value)
            if value not in (True, False, "auto"):
                raise ConfigError(f"train.{name}={getattr(self, name)!r}: expected true, false or auto")
            object.__setattr__(self, name, value)  # frozen: set once, while building
        for name in self.attention_backends:
            _choice("train.attention_backends", name, SDPA_BACKENDS)
        if len(set(self.attention_backends)) != len(self.attention_backends):
            raise ConfigError(f"train.attention_backends={self.attention_backends}: each backend once")
        if self.threads is not None:
            _at_least("train.threads", self.threads, 1)
        _at_least("train.keep_last", self.keep_last, 0, "(0: keep every checkpoint)")


@dataclass(frozen=True)
class ExpectConfig:
    """What the recipe's updates gave when it was measured (docs/results.md), for the messages of a run's first
    hour: ``bleu``, (updates, validation BLEU) points, for the estimate a training prints once its speed is known;
    ``useful_updates``, the updates below which its model is not useful (train, translate, evaluate and a model
    card say so). Neither changes the training or the decoding, so a resume may change them."""

    bleu: list[tuple[int, float]] = field(default_factory=list)
    useful_updates: int | None = None

    def __post_init__(self) -> None:
        _check_limits("expect", self)
        if self.useful_updates is not None:
            _at_least("expect.useful_updates", self.useful_updates, 1)
        if [u for u, _ in self.bleu] != sorted({u for u, _ in self.bleu}):
            raise ConfigError("expect.bleu: expected [updates, BLEU] pairs with increasing updates")


# Token budget of one decoding batch (source tokens x beam) when neither the options nor the run set one:
# on a GPU a large batch is what makes decoding fast; on a CPU larger batches stop paying off early.
DEFAULT_DECODE_TOKENS = {"cpu": 4096, "cuda": 32768, "mps": 8192}


LENGTH_PENALTIES = ("gnmt", "power", "none")  # gnmt (paper) | power (fairseq, HF, CTranslate2) | none
STOP_RULES = ("exact", "hf", "first")  # beam search's stopping rule (aiayn.search.beam says each)


@dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    """How to decode, in one object: the run's ``decode`` section, then per-call overrides from the CLI,
    the Python API and the server (:meth:`replace`). Defaults are the paper's (section 6.1: beam 4,
    alpha 0.6, maximum output length input + 50). The searches read it inside one
    :class:`aiayn.search.SearchSpec`; adding a decoding option means a field here, its step in
    :mod:`aiayn.search.processing`, and its command-line flag (or none) in :data:`aiayn.cli_flags.DECODE_FLAGS`.

    Search: ``sample`` draws each token (``temperature``, then ``top_k``, then ``top_p`` filtering; a
    generator seeded by ``seed``; temperature 0 is greedy); otherwise ``beam`` 1 is greedy search and
    ``beam`` > 1 beam search with ``length_penalty`` (gnmt = paper, power = fairseq/HF/CTranslate2)
    and the ``stop`` rule (exact: never stops before the best hypothesis is certain; hf: Hugging Face's
    heuristic). ``nbest`` hypotheses per input (beam search: at most ``beam``; sampling: that many draws).
    ``ban_pad``: the pad id's logit is -inf before every softmax (Hugging Face's ``bad_words_ids=[[pad]]``
    with ``renormalize_logits``, which Marian / OPUS-MT generation configs set; runs imported from them).
    """

    # The command line's flags of these fields (--name-with-dashes) are aiayn.cli_flags' table, not this section's.
    beam: int = 4
    alpha: float = 0.6
    length_penalty: str = "gnmt"  # one of LENGTH_PENALTIES
    # at most int(max_len_a * source length + max_len_b) decoding steps (EOS included)
    max_len_a: float = 1.0
    max_len_b: int = 50
    min_len: int = 0  # no EOS before this many tokens
    nbest: int = 1
    stop: str = "exact"  # beam search's stopping rule, one of STOP_RULES
    # n > 0: no output repeats one of its own n-grams (not in the paper; summaries)
    no_repeat_ngram: int = 0
    ban_pad: bool = False  # never produce the pad id (Marian runs: generate's bad_words_ids [[pad]], renormalized)
    sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    # language models and summaries: tokens to generate (None: the command's; each command has its own option)
    max_new_tokens: int | None = None
    # beam search at fixed shapes, each step after the first one CUDA graph replayed (aiayn.search.fixed); off CUDA
    # the same fixed-shape steps run without a graph
    cuda_graphs: bool = False
    # token budget of one decoding batch; None: by device (DEFAULT_DECODE_TOKENS)
    max_tokens: int | None = None

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
            raise ConfigError(f"unknown decoding option {unknown[0]}{did_you_mean(unknown[0], known)} "
                              f"(known: {', '.join(sorted(known))})")
        values = {k: _coerce(v, DECODE_HINTS[k], f"decode.{k}") for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **values)

    def batch_tokens(self, device_type: str) -> int:
        """The token budget of one decoding batch: ``max_tokens``, or the device's default."""
        return self.max_tokens or DEFAULT_DECODE_TOKENS.get(device_type, DEFAULT_DECODE_TOKENS["cpu"])


DecodeConfig = DecodeOptions  # the config section's name (``decode:`` in a recipe)


DECODE_HINTS = typing.get_type_hints(DecodeOptions)  # each option's type, for the coercion of overrides


@dataclass(frozen=True)
class Config:
    """The whole recipe: ``task`` picks encoder-decoder translation or a decoder-only LM."""

    task: str = "translation"  # translation | lm | summarization
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    expect: ExpectConfig = field(default_factory=ExpectConfig)

    def __post_init__(self) -> None:
        _choice("task", self.task, tuple(TASKS))
        self.kind.check_config(self.data.pretokenize, self.data.shared_vocab, self.model.share_embeddings)

    def check_pair_widths(self) -> None:
        """Before a training: pairs are kept up to ``data.max_len`` positions and batches padded to a bucket or a
        multiple: none of these may reach past ``model.max_positions`` (the first batch would fail inside the model
        otherwise). Checked when a training starts, not when a config is read: a trained run whose corpus never
        came near the limit still loads for decoding. A check of a corpus of pairs
        (:attr:`aiayn.data.pipeline.Corpus.check`): a language model's windows are cut to its block."""
        d, most = self.data, self.model.max_positions
        if d.max_len is not None and d.max_len > most:
            raise ConfigError(f"data.max_len={d.max_len} exceeds model.max_positions={most}: the pairs it keeps would "
                              "need positions the model does not have")
        over = [b for b in d.length_buckets if b > most]
        if over:
            raise ConfigError(f"data.length_buckets: {over[0]} exceeds model.max_positions={most}")
        longest = d.max_len or most  # the widest kept pair, EOS / BOS included
        if d.length_buckets and d.length_buckets[-1] >= longest:
            return  # every batch takes a bucket's width, never a multiple's
        padded = -(-longest // d.pad_to_multiple) * d.pad_to_multiple
        if padded > most:
            raise ConfigError(f"data.pad_to_multiple={d.pad_to_multiple} pads a pair of {longest} positions to "
                              f"{padded}, more than model.max_positions={most}: set data.max_len to a multiple of "
                              f"{d.pad_to_multiple} of at most {most}, or lower data.pad_to_multiple")

    @property
    def kind(self) -> Task:
        """What the ``task`` named means (:mod:`aiayn.task`): asked, never compared as a string."""
        return TASKS[self.task]

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts and lists (YAML and JSON have no tuples)."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
