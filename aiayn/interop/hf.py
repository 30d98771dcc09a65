"""Hugging Face Marian model directories in and out: ``aiayn export hf RUN OUT`` and ``aiayn import hf MODEL RUN``
(MODEL: a directory, or a Hub id such as ``Helsinki-NLP/opus-mt-en-de`` fetched through huggingface_hub's cache).

A Marian directory (what ``MarianMTModel.from_pretrained`` / ``MarianTokenizer.from_pretrained`` read, e.g.
an OPUS-MT download) holds ``config.json``, ``generation_config.json``, the weights (``model.safetensors``,
or ``pytorch_model.bin``), ``source.spm`` / ``target.spm`` (SentencePiece models), ``vocab.json`` (piece ->
id, one id space for both sides) and ``tokenizer_config.json``. The weights convert exactly both ways
(:mod:`aiayn.interop.marian`); the tokenizer is carried as files (:mod:`aiayn.data.marian_tokenizer`), with
Marian's own special ids (eos 0, unk 1, pad last, decoding starts from pad) kept in the run.

* Import: the run's ``decode`` section is what ``generate()`` does with the directory's generation config
  (beam, power length penalty, Hugging Face's stopping heuristic, ``max_length``, the pad ban), so
  ``aiayn translate RUN`` gives ``generate()``'s output; what aiayn's search does not reproduce is logged.
  A ``.bin`` file is read with ``torch.load(weights_only=True)`` only: anything that needs more (pickled
  code) is refused.
* Export: a run trained by aiayn (SentencePiece BPE, no Moses pretokenization) or imported; a model with
  the paper's interleaved sinusoids is re-laid out (:func:`~aiayn.interop.marian.concat_layout_copy`).
  ``generate()`` with the exported generation config equals
  ``aiayn translate RUN --length-penalty power --stop hf`` given the same per-sentence length limit
  (:func:`hf_generate` shows how). Hugging Face has no GNMT penalty and no per-sentence ``max_len_a``.

``transformers`` is imported inside the functions, so aiayn works without it.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aiayn.config import Config, DataConfig, DecodeOptions, save_config
from aiayn.data.marian_tokenizer import (
    SOURCE_SPM,
    TARGET_SPM,
    TARGET_VOCAB,
    VOCAB,
    MarianPieces,
    MarianRules,
    MarianVocab,
    save_marian_pair,
)
from aiayn.data.tokenizer import SentencePieceTokenizer, SpecialIds, TokenizerPair
from aiayn.device import check_fits_in_memory
from aiayn.errors import CheckpointError, ConfigError, DataError, first_line, require
from aiayn.files import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_output_dir,
    locked,
    os_errors_named,
    staged_directory,
)
from aiayn.interop import registry
from aiayn.interop.card import run_facts
from aiayn.interop.marian import concat_layout_copy, from_hf_marian, model_config_from_marian, to_hf_marian
from aiayn.run.weights import save_weights

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import GenerationConfig, MarianMTModel

log = logging.getLogger("aiayn.interop")

TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP = "tokenizer_config.json", "special_tokens_map.json"
HF_TOKENIZER_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
EXPORT_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "README.md", SOURCE_SPM,
                          TARGET_SPM, VOCAB, TARGET_VOCAB, *HF_TOKENIZER_FILES})
EXPORT_TAG = "aiayn-export"  # in the model card's front matter: marks a directory an export may overwrite
# Generation settings aiayn's search has no counterpart for (reported at import when set).
# aiayn's beam stopping rules as generate()'s early_stopping, one for one (aiayn.search.beam says each).
EARLY_STOPPING: dict[str, bool | str] = {"exact": "never", "hf": False, "first": True}
_UNSUPPORTED = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
                "forced_bos_token_id": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                "num_beam_groups": 1, "diversity_penalty": 0.0, "exponential_decay_length_penalty": None,
                "sequence_bias": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                "min_p": None, "constraints": None, "force_words_ids": None}


# Reading a Hugging Face directory -------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable JSON file ({first_line(e)})") from None


def _marian_config_json(hf_dir: Path) -> dict[str, Any]:
    if not hf_dir.is_dir():
        raise DataError(f"{hf_dir}: no such directory")
    if not (hf_dir / "config.json").is_file():
        raise DataError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    raw = _read_json(hf_dir / "config.json")
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind != "marian":
        raise ConfigError(f"{hf_dir}: model_type={kind!r}, not a Marian model (only MarianMTModel directories import)")
    _check_types(raw, _CONFIG_TYPES, hf_dir / "config.json")
    return raw


# The config.json and generation_config.json fields aiayn reads, with the JSON types they must have: a wrong
# type is refused in one line naming the file, before transformers or torch see it.
_INT, _NUM, _BOOL = (int,), (int, float), (bool,)
_CONFIG_TYPES = {
    **dict.fromkeys(("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                     "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings",
                     "pad_token_id", "eos_token_id", "decoder_start_token_id", "decoder_vocab_size", "bos_token_id"),
                    _INT),
    **dict.fromkeys(("dropout", "attention_dropout", "activation_dropout", "init_std"), _NUM),
    **dict.fromkeys(("scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings"), _BOOL),
    "activation_function": (str,),
}
_GENERATION_TYPES = {
    **dict.fromkeys(("num_beams", "max_length", "max_new_tokens", "min_length", "min_new_tokens", "top_k",
                     "no_repeat_ngram_size", "num_return_sequences", "decoder_start_token_id", "pad_token_id",
                     "bos_token_id", "forced_eos_token_id"), _INT),
    **dict.fromkeys(("length_penalty", "temperature", "top_p"), _NUM),
    **dict.fromkeys(("do_sample", "renormalize_logits"), _BOOL),
    "early_stopping": (bool, str),
    "bad_words_ids": (list,),
    "eos_token_id": (int, list),
}


def _check_types(data: Any, types: dict[str, tuple[type, ...]], where: Path) -> None:
    """Each field of ``types`` that ``data`` holds (and is not null) has one of its JSON types."""
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for key, allowed in types.items():
        value = data.get(key)
        if value is None:
            continue
        is_bool = isinstance(value, bool)
        if not isinstance(value, allowed) or (is_bool and bool not in allowed):
            names = " or ".join({int: "an integer", float: "a number", bool: "true/false", str: "a string",
                                 list: "a list"}[t] for t in allowed)
            raise ConfigError(f"{where}: {key}={value!r:.40}: expected {names}")


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin, through torch.load(weights_only=True) and nothing else: a file that is not a PyTorch
    zip archive (a raw pickle) is refused before torch sees it, and torch's warnings never reach the terminal."""
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            raise CheckpointError(f"{path}: refused: not a PyTorch zip archive (a raw pickle may run code); "
                                  "convert it to safetensors with a tool you trust")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - untrusted input: every failure is the same refusal
        raise CheckpointError(f"{path}: refused: torch.load(weights_only=True) cannot read it ({first_line(e)}); "
                              "a file that needs more may run code - convert it to safetensors with a tool you "
                              "trust") from None
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return obj


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(e)})") from None


def read_hf_weights(hf_dir: str | Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The state dict of a Hugging Face directory and the file it came from: model.safetensors (or its
    shards) when present, else pytorch_model.bin (or its shards) read with ``torch.load(weights_only=True)``."""
    d = Path(hf_dir)
    for name, read in (("model.safetensors", _read_safetensors), ("pytorch_model.bin", _read_bin)):
        if (d / name).is_file():
            return read(d / name), d / name
        index = d / f"{name}.index.json"
        if index.is_file():
            data = _read_json(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: expected an object with a 'weight_map' of tensor names to shard "
                                      "file names")
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                if Path(shard).name != shard:
                    raise CheckpointError(f"{index}: shard {shard!r} is not a file of {d}")
                state.update(read(d / shard))
            return state, index
    raise CheckpointError(f"{d}: no model.safetensors or pytorch_model.bin")


@torch.no_grad()
def load_hf_marian(hf_dir: str | Path, raw: dict[str, Any] | None = None) -> MarianMTModel:
    """A ``MarianMTModel`` (eval mode) built from ``hf_dir``'s config.json (``raw``, when already read) and
    weights, never running code from the directory. Tied tensors missing from the file are filled by the tie;
    the sinusoid tables are recomputed when absent; any other missing or unexpected tensor is refused."""
    from transformers import MarianConfig, MarianMTModel

    d = Path(hf_dir)
    raw = _marian_config_json(d) if raw is None else raw
    try:  # aiayn's limits (sizes, this machine's memory) before anything is allocated
        check_fits_in_memory(model_config_from_marian(MarianConfig.from_dict(raw)))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{d / 'config.json'}: {first_line(e)}") from None
    state, where = read_hf_weights(d)
    try:
        hf = MarianMTModel(MarianConfig.from_dict(raw)).eval()
        result = hf.load_state_dict(state, strict=False)
    except (ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{where}: does not fit config.json ({first_line(e)})") from None
    current = hf.state_dict()
    loaded = {current[k].data_ptr() for k in state if k in current}
    missing = [k for k in result.missing_keys
               if not k.endswith("embed_positions.weight") and current[k].data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        what = f"missing {missing[0]}" if missing else f"unexpected {result.unexpected_keys[0]}"
        raise CheckpointError(f"{where}: does not fit config.json ({what})")
    return hf


def generation_config_of(hf_dir: str | Path, raw: dict[str, Any] | None = None) -> GenerationConfig:
    """What ``from_pretrained`` gives ``generate()``: generation_config.json, else the generation keys of
    config.json (``raw``, when already read; older directories keep num_beams, bad_words_ids, max_length there)."""
    from transformers import GenerationConfig

    d = Path(hf_dir)
    path = d / "generation_config.json"
    if path.is_file():
        data = _read_json(path)
        _check_types(data, _GENERATION_TYPES, path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return GenerationConfig.from_dict(data)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{path}: not a valid generation config ({first_line(e)})") from None
    return GenerationConfig.from_model_config(_read_json(d / "config.json") if raw is None else raw)


def decode_options_from(g: GenerationConfig, pad_id: int) -> tuple[DecodeOptions, list[str]]:
    """aiayn's decoding options for what ``generate()`` does with ``g``, and a line for each setting aiayn's
    search does not reproduce (outputs may then differ)."""
    notes = []
    early = getattr(g, "early_stopping", False)
    max_new = getattr(g, "max_new_tokens", None)
    steps = int(max_new) if max_new is not None else int(getattr(g, "max_length", None) or 20) - 1
    min_new = getattr(g, "min_new_tokens", None)
    min_len = int(min_new) if min_new else max(0, int(getattr(g, "min_length", 0) or 0) - 1)
    bad = getattr(g, "bad_words_ids", None) or []
    ban_pad = [pad_id] in bad
    if ban_pad and not getattr(g, "renormalize_logits", False):
        notes.append("bad_words_ids bans pad without renormalize_logits; aiayn renormalizes (beam scores may differ)")
    if [w for w in bad if w != [pad_id]]:
        notes.append(f"bad_words_ids {[w for w in bad if w != [pad_id]]} (other than the pad id) are not applied")
    if getattr(g, "forced_eos_token_id", None) is not None:
        notes.append("forced_eos_token_id: generate() forces EOS at max_length, aiayn cuts there (only outputs that "
                     "reach max_length differ)")
    no_repeat = int(getattr(g, "no_repeat_ngram_size", 0) or 0)
    if getattr(g, "renormalize_logits", False) and (min_len or no_repeat):
        notes.append("renormalize_logits with min_length / no_repeat_ngram_size: aiayn bans without renormalizing")
    for key, neutral in _UNSUPPORTED.items():
        value = getattr(g, key, neutral)
        if value not in (neutral, None, [], 0):
            notes.append(f"{key}={value!r} is not reproduced by aiayn's search")
    sample = bool(getattr(g, "do_sample", False))
    if sample and (getattr(g, "num_beams", 1) or 1) > 1:
        notes.append("beam sampling (do_sample with num_beams > 1) is not reproduced: aiayn samples token by token")
    top_p = getattr(g, "top_p", None)
    opts = DecodeOptions(
        beam=1 if sample else int(getattr(g, "num_beams", 1) or 1),
        alpha=float(g.length_penalty if getattr(g, "length_penalty", None) is not None else 1.0),
        length_penalty="power", stop=next((s for s, e in EARLY_STOPPING.items() if e == early), "hf"), max_len_a=0.0,
        max_len_b=max(1, steps),
        min_len=min_len, no_repeat_ngram=no_repeat, ban_pad=ban_pad, sample=sample,
        temperature=float(getattr(g, "temperature", 1.0) or 1.0),
        top_k=(getattr(g, "top_k", None) or None) if sample else None,
        top_p=top_p if sample and top_p is not None and top_p < 1.0 else None,
    )
    return opts, notes


def _marian_tokenizer_pair(hf_dir: Path, sizes: tuple[int, int]) -> tuple[MarianPieces, MarianPieces, Any]:
    """The two sides of ``hf_dir``'s MarianTokenizer with its rules, as transformers loads them; and that
    tokenizer (for its special ids)."""
    from transformers import MarianTokenizer

    for name in (SOURCE_SPM, TARGET_SPM, VOCAB):
        if not (hf_dir / name).is_file():
            raise DataError(f"{hf_dir}: no {name} (a Marian directory has source.spm, target.spm and vocab.json)")
    try:
        mt = MarianTokenizer.from_pretrained(str(hf_dir))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise DataError(f"{hf_dir}: MarianTokenizer cannot load it ({first_line(e)})") from None
    for t in mt._added_tokens_decoder.values():  # transformers' own record of the tokens cut out of the text
        if t.lstrip or t.rstrip or t.single_word:
            raise DataError(f"{hf_dir}: added token {t.content!r} strips spaces or matches single words; not supported")
    separate = bool(mt.separate_vocabs)
    files = {n: _read_json(hf_dir / n) for n in HF_TOKENIZER_FILES if (hf_dir / n).is_file()}
    rules = MarianRules({t.content: int(i) for i, t in mt._added_tokens_decoder.items()},
                        frozenset(int(i) for i in mt.all_special_ids), str(mt.unk_token),
                        bool(mt.split_special_tokens), bool(mt.clean_up_tokenization_spaces),
                        decode_with_source=not separate, hf_files=files)
    src_proto, tgt_proto = (hf_dir / SOURCE_SPM).read_bytes(), (hf_dir / TARGET_SPM).read_bytes()
    src_vocab = MarianVocab(dict(mt.encoder), sizes[0])
    tgt_vocab = MarianVocab(dict(mt.target_encoder), sizes[1]) if separate else src_vocab
    decode_proto = None if separate else src_proto
    return (MarianPieces(src_proto, src_vocab, rules, decode_proto, SOURCE_SPM),
            MarianPieces(tgt_proto, tgt_vocab, rules, decode_proto, TARGET_SPM), mt)


# The files of a Marian repository on the Hub that an import reads (not its TensorFlow or Rust weights).
HUB_FILES = ["config.json", "generation_config.json", "model.safetensors", "pytorch_model.bin", SOURCE_SPM, TARGET_SPM,
             VOCAB, TARGET_VOCAB, *HF_TOKENIZER_FILES]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local directory of Hub model ``repo_id`` at ``revision`` (default main): downloaded through
    ``huggingface_hub.snapshot_download`` into its cache (``HF_HOME`` / ``HF_HUB_CACHE``), or the cached copy
    alone when ``HF_HUB_OFFLINE=1`` or the Hub cannot be reached. Only the files an import reads come down."""
    require("huggingface_hub", "hf", "aiayn import hf with a Hub id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        try:
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
        except OfflineModeIsEnabled:  # huggingface_hub 1.x asks the Hub for a pinned commit's file list even
            # offline (2.x reads it from the cache): the cache alone, as HF_HUB_OFFLINE means
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES,
                                          local_files_only=True))
    except GatedRepoError:
        raise DataError(f"{at}: a gated model on the Hugging Face Hub (accept its terms, then `hf auth login`)") \
            from None
    except RepositoryNotFoundError:
        raise DataError(f"{repo_id}: no such local directory, and no such model on the Hugging Face Hub (or a "
                        "private one: `hf auth login`)") from None
    except RevisionNotFoundError:
        raise DataError(f"{at}: the model has no such revision (branch, tag or commit)") from None
    except LocalEntryNotFoundError:
        raise DataError(f"{at}: not in the Hugging Face cache, and the Hub was not reachable or HF_HUB_OFFLINE is "
                        "set (download it once online)") from None
    except HFValidationError as e:
        raise DataError(f"{repo_id}: not a Hub model id ({first_line(e)})") from None


def resolve_hf_source(source: str | Path, revision: str | None = None) -> tuple[Path, str]:
    """A Marian directory for ``source`` and the name to record as the run's origin: an existing local
    directory as it is, else a Hub id (``owner/name``) through :func:`hub_snapshot` (``name@commit``)."""
    p = Path(source)
    if p.exists():
        if revision is not None:
            raise ConfigError(f"--revision is for a Hub id; {source} is a local directory")
        return p, p.resolve().name
    if not _HUB_ID.fullmatch(str(source)):
        raise DataError(f"{source}: no such directory (and not a Hub id like Helsinki-NLP/opus-mt-en-de)")
    snap = hub_snapshot(str(source), revision)
    return snap, f"{source}@{snap.name}"  # the snapshot folder is named after the commit


def import_hf(hf_dir: str | Path, run_dir: str | Path, force: bool = False, revision: str | None = None) -> Path:
    """``aiayn import hf MODEL RUN_DIR``: a run directory (config.yaml, tokenizer/, model.safetensors) from a
    Hugging Face Marian directory, or a Hub id (``Helsinki-NLP/opus-mt-en-de``, at ``revision``) fetched through
    the Hugging Face cache; ``aiayn translate RUN_DIR`` then gives ``generate()``'s output and
    ``aiayn train CONFIG --init-from RUN_DIR`` fine-tunes it. ``RUN_DIR`` must be new or empty unless ``force``.
    Built beside RUN_DIR and renamed into place, so a failure leaves nothing behind."""
    from aiayn.run.directory import load_run

    require("transformers", "hf", "aiayn import hf")
    out = Path(run_dir)
    check_output_dir(out, [hf_dir] if Path(hf_dir).exists() else [], force)  # before any download
    src_dir, origin = resolve_hf_source(hf_dir, revision)
    raw = _marian_config_json(src_dir)
    try:
        model = from_hf_marian(load_hf_marian(src_dir, raw)).eval()
    except ValueError as e:
        raise ConfigError(f"{src_dir}: cannot convert to aiayn: {first_line(e)}") from None
    cfg_m = model.cfg
    src_tok, tgt_tok, mt = _marian_tokenizer_pair(src_dir, (cfg_m.vocab_size, cfg_m.target_vocab_size))
    eos, pad = raw.get("eos_token_id"), raw.get("pad_token_id")
    start = raw.get("decoder_start_token_id", pad)
    if (mt.eos_token_id, mt.pad_token_id) != (eos, pad):
        raise DataError(f"{src_dir}: the tokenizer's eos/pad ids ({mt.eos_token_id}, {mt.pad_token_id}) are not "
                        f"config.json's ({eos}, {pad})")
    specials = SpecialIds(pad=int(pad), unk=int(mt.unk_token_id), bos=int(start), eos=int(eos),
                          decoder_start=int(start))
    opts, notes = decode_options_from(generation_config_of(src_dir, raw), specials.pad)
    for line in notes:
        log.warning("%s: %s", src_dir, line)
    langs = (mt.source_lang or "src", mt.target_lang or "tgt")
    data = DataConfig(src_lang=langs[0], tgt_lang=langs[1], vocab_size=len(src_tok.vocab.ids),
                      shared_vocab=src_tok.same_ids(tgt_tok))
    cfg = Config(task="translation", model=cfg_m, data=data, decode=opts)
    with locked(out), staged_directory(out) as stage:  # a training that starts meanwhile is refused
        save_config(cfg, stage / "config.yaml")
        TokenizerPair(src_tok, tgt_tok, specials).save(stage / "tokenizer")
        save_weights(model, stage / "model.safetensors", {"source": f"imported from {origin}"})
        load_run(stage, "cpu")  # what was written loads back as a run
    log.info("imported %s into %s (%s, vocabulary %d, eos %d, pad %d, decoder start %d)", src_dir, out,
             f"{cfg_m.n_encoder_layers}+{cfg_m.n_decoder_layers} layers, d_model {cfg_m.d_model}",
             cfg_m.vocab_size, specials.eos, specials.pad, specials.decoder_start)
    return out


# Writing a Hugging Face directory ---------------------------------------------------------------------------


def generation_config_for(opts: DecodeOptions, specials: SpecialIds, max_positions: int) -> GenerationConfig:
    """The generation config under which ``generate()`` decodes as aiayn does with ``opts`` (length penalty
    'power'; a per-sentence ``max_len_a`` becomes the model's position limit: pass ``max_length`` per call)."""
    from transformers import GenerationConfig

    steps = max_positions if opts.max_len_a > 0 else min(int(opts.max_len_b), max_positions)
    kw: dict[str, Any] = dict(
        decoder_start_token_id=specials.decoder_start, eos_token_id=specials.eos, pad_token_id=specials.pad,
        forced_eos_token_id=None,  # aiayn cuts a sentence at its limit without forcing EOS
        num_beams=1 if opts.sample else opts.beam, length_penalty=0.0 if opts.length_penalty == "none" else opts.alpha,
        early_stopping=EARLY_STOPPING[opts.stop], max_length=steps + 1,
        min_length=opts.min_len + 1 if opts.min_len else 0, no_repeat_ngram_size=opts.no_repeat_ngram,
        do_sample=opts.sample,
    )
    if kw["num_beams"] == 1:  # beam-only flags: transformers 5 refuses to save them beside num_beams=1
        del kw["length_penalty"], kw["early_stopping"]
    if opts.ban_pad:
        kw.update(bad_words_ids=[[specials.pad]], renormalize_logits=True)
    if opts.sample:
        kw.update(temperature=opts.temperature, top_k=opts.top_k or 0, top_p=opts.top_p or 1.0)
    return GenerationConfig(**kw)


def _tokenizer_config(tok: TokenizerPair, cfg: Config) -> dict[str, Any]:
    """tokenizer_config.json for a run's tokenizer: MarianTokenizer then reads text as aiayn does (no special
    tokens cut out of the text, no clean-up of spaces) unless the run came from Marian with its own rules."""
    piece, sp = tok.src.id_to_piece, tok.specials
    out: dict[str, Any] = {"tokenizer_class": "MarianTokenizer", "source_lang": cfg.data.src_lang,
                           "target_lang": cfg.data.tgt_lang, "unk_token": piece(sp.unk), "eos_token": piece(sp.eos),
                           "pad_token": piece(sp.pad), "separate_vocabs": not tok.shared,
                           "model_max_length": cfg.model.max_positions}
    if isinstance(tok.src, MarianPieces):
        rules = tok.src.rules
        out.update(split_special_tokens=rules.split_special_tokens,
                   clean_up_tokenization_spaces=rules.clean_up_tokenization_spaces)
    else:  # aiayn's BPE: <s> is a special token too (generate's start token; decode drops it)
        out.update(bos_token=piece(sp.bos), split_special_tokens=True, clean_up_tokenization_spaces=False)
    return out


def _write_tokenizer(tok: TokenizerPair, cfg: Config, out: Path) -> None:
    if isinstance(tok.src, MarianPieces):
        save_marian_pair(tok.src, tok.tgt, out)
        files = dict(tok.src.rules.hf_files)
    else:
        src, tgt = tok.src, tok.tgt
        atomic_write_bytes(out / SOURCE_SPM, src.model_proto)
        atomic_write_bytes(out / TARGET_SPM, tgt.model_proto)
        atomic_write_json(out / VOCAB, {src.id_to_piece(i): i for i in range(src.vocab_size)}, indent=2)
        if not tok.shared:
            atomic_write_json(out / TARGET_VOCAB, {tgt.id_to_piece(i): i for i in range(tgt.vocab_size)}, indent=2)
        files = {}
    files.setdefault(TOKENIZER_CONFIG, _tokenizer_config(tok, cfg))
    for name, content in files.items():
        atomic_write_json(out / name, content, indent=2)


_CARD = """\
---
library_name: transformers
pipeline_tag: translation
tags:
- translation
- marian
- {tag}
language:
- {src}
- {tgt}
license: other
---

# {name}

A Transformer exported by aiayn from the run `{run}` ({layers} layers, d_model {d_model}, vocabulary {vocab}).

{facts}

```python
from transformers import MarianMTModel, MarianTokenizer
tok = MarianTokenizer.from_pretrained("{name}")
model = MarianMTModel.from_pretrained("{name}")
batch = tok(["{example}"], return_tensors="pt", padding=True)
print(tok.batch_decode(model.generate(**batch), skip_special_tokens=True))
```

`generate()` with this generation config (beam {beam}, length penalty |Y|^{alpha}) gives the tokens of
`aiayn translate RUN --beam {beam} --length-penalty power --stop hf` when it is given aiayn's length limit per
sentence, `max_length = int({a} * (source tokens + 1) + {b}) + 1` (the config holds the model's limit).
Use `generate()` as above: transformers 5 has no `pipeline("translation")` (transformers 4's translation
pipeline runs this same `generate()`).
"""


def is_earlier_export(path: str | Path) -> bool:
    """Whether ``path`` holds only what :func:`export_hf` writes, with its model card."""
    d = Path(path)
    files = {p.name for p in d.iterdir()} if d.is_dir() else set()
    card = d / "README.md"
    return bool(files) and files <= EXPORT_FILES and card.is_file() and f"- {EXPORT_TAG}\n" in card.read_text(
        encoding="utf-8", errors="replace")


def export_hf(run_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """``aiayn export hf RUN OUT_DIR``: a Marian directory that ``MarianMTModel.from_pretrained`` and
    ``MarianTokenizer.from_pretrained`` load (config.json, generation_config.json, model.safetensors,
    source.spm, target.spm, vocab.json, tokenizer_config.json, README.md). OUT_DIR must be new, empty or an
    earlier export unless ``force``; it is built beside OUT_DIR and renamed into place."""
    from aiayn.run.directory import load_run

    require("transformers", "hf", "aiayn export hf")
    registry.check("hf", run_dir)  # a direct call refuses what aiayn export refuses
    out = Path(out_dir)
    check_output_dir(out, [run_dir], force or is_earlier_export(out))
    run = load_run(run_dir, "cpu", precision="fp32")
    tok, sp = run.tokenizers, run.tokenizers.specials
    if tok.pretokenize != "none":
        raise ConfigError(f"{run_dir}: its tokenizer runs Moses pretokenization (data.pretokenize=moses), which "
                          "MarianTokenizer cannot; export it to CTranslate2 instead")
    if not isinstance(tok.src, (SentencePieceTokenizer, MarianPieces)):
        raise ConfigError(f"{run_dir}: a {tok.src.kind} tokenizer has no SentencePiece model for MarianTokenizer")
    try:
        model = concat_layout_copy(run.model) if run.cfg.model.positional == "sinusoidal" else run.model
        hf = to_hf_marian(model, bos_id=sp.decoder_start, eos_id=sp.eos)
    except ValueError as e:
        raise ConfigError(f"cannot export {run_dir} as a Marian model: {first_line(e)}") from None
    dec = run.cfg.decode
    if dec.length_penalty == "gnmt":
        log.warning("%s decodes with the GNMT length penalty, which Hugging Face lacks: generate() ranks with "
                    "|Y|^%s, as `aiayn translate --length-penalty power --stop hf`", run_dir, dec.alpha)
    hf.generation_config = generation_config_for(dec, sp, run.cfg.model.max_positions)
    with locked(out), staged_directory(out) as stage:
        with os_errors_named(out):  # a full disk: one line naming OUT_DIR, not safetensors' error
            hf.save_pretrained(str(stage))
        _write_tokenizer(tok, run.cfg, stage)
        card = _CARD.format(tag=EXPORT_TAG, name=out.name, run=Path(run_dir).resolve().name,
                            layers=f"{model.cfg.n_encoder_layers}+{model.cfg.n_decoder_layers}",
                            d_model=model.cfg.d_model, vocab=model.cfg.vocab_size, example="A dog runs on the beach.",
                            beam=dec.beam, alpha=dec.alpha, a=dec.max_len_a, b=dec.max_len_b,
                            src=run.cfg.data.src_lang, tgt=run.cfg.data.tgt_lang,
                            facts="\n".join(run_facts(run_dir, run.cfg)))
        atomic_write_text(stage / "README.md", card)
        unexpected = sorted(p.name for p in stage.iterdir() if p.name not in EXPORT_FILES)
        if unexpected:  # pragma: no cover - a transformers version that writes more files
            raise CheckpointError(f"save_pretrained wrote files aiayn does not know: {unexpected}")
    return out


# Comparing with generate() ----------------------------------------------------------------------------------


@torch.no_grad()
def hf_generate(hf: MarianMTModel, tokenizer: Any, texts: Sequence[str], opts: DecodeOptions, max_positions: int,
                batch_size: int = 32) -> list[list[int]]:
    """Token ids (no start token, no EOS) that ``hf.generate()`` gives each of ``texts``, under aiayn's rules:
    ``tokenizer`` (a MarianTokenizer) encodes (EOS appended), every sentence gets aiayn's step limit
    ``min(int(a * (source tokens + 1) + b), max_positions)`` (``max_length`` is that + 1: it counts the start
    token), the beam, power length penalty and stopping rule of ``opts``; empty texts give []. Sentences with
    the same limit are batched ``batch_size`` at a time."""
    eos, pad = hf.generation_config.eos_token_id, hf.generation_config.pad_token_id
    gen = generation_config_for(opts, SpecialIds(pad=pad, unk=0, bos=hf.generation_config.decoder_start_token_id,
                                                 eos=eos, decoder_start=hf.generation_config.decoder_start_token_id),
                                max_positions)
    encoded = [tokenizer(t)["input_ids"] if t.strip() else None for t in texts]
    limits = {i: min(int(opts.max_len_a * len(ids) + opts.max_len_b), max_positions)
              for i, ids in enumerate(encoded) if ids is not None}
    out: list[list[int]] = [[] for _ in texts]
    groups: dict[int, list[int]] = {}
    for i, lim in limits.items():
        groups.setdefault(max(1, lim), []).append(i)
    for lim, members in sorted(groups.items()):
        for k in range(0, len(members), batch_size):
            idx = members[k : k + batch_size]
            batch = tokenizer.pad({"input_ids": [encoded[i] for i in idx]}, return_tensors="pt")
            gen.max_length = lim + 1
            seqs = hf.generate(**batch, generation_config=gen).tolist()
            for i, seq in zip(idx, seqs):
                toks = seq[1:]
                out[i] = toks[: toks.index(eos)] if eos in toks else toks
    return out
