"""``aiayn export argos RUN OUT.argosmodel``: an Argos Translate package of a translation run, which
``argostranslate`` (and LibreTranslate on top of it) installs from the file and translates with, offline.

An ``.argosmodel`` file is a zip of one directory:

    <name>/metadata.json        languages, package and Argos versions, type "translate"
    <name>/model/               the CTranslate2 model (aiayn.interop.ctranslate2's spec, weight for weight)
    <name>/sentencepiece.model  the run's shared SentencePiece model: Argos encodes the source and decodes
                                the target with it
    <name>/minisbd/<lang>.onnx  the sentence splitter Argos runs before translating (MiniSBD's format): by
                                default aiayn's rule-based one (aiayn.interop.sentence_splitter), or a trained
                                MiniSBD model given with ``sentence_model``
    <name>/README.md            what the package is and how it decodes

How Argos decodes (argostranslate 1.11, ``apply_packaged_translation``): beam ``ARGOS_BEAM_SIZE`` (default 4),
CTranslate2's length penalty 0.2 (|Y|^0.2, |Y| counting the end token as aiayn's ``power``), its default early
stop (patience 1: a sentence is done once 4 hypotheses have ended, aiayn's ``stop='first'``), no end token at the
first step (``min_decoding_length`` 1), at most 256 tokens (sources cut at 1,024) and ``replace_unknowns``; then
SentencePiece's decode with underscores turned into spaces. :data:`ARGOS_SEARCH` is that search in aiayn's
options (``aiayn translate`` flags: :data:`ARGOS_FLAGS`); tests/test_argos.py checks that the two agree.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiayn.data.languages import language_name
from aiayn.errors import ConfigError, first_line, require
from aiayn.files import LOCK, TMP_SUFFIX, RunLock, default_file_mode, guard_output, lock_holder
from aiayn.interop import registry
from aiayn.interop.card import run_facts
from aiayn.interop.sentence_splitter import onnx_problem, sentence_splitter_onnx

ARGOS_VERSION = "1.9"  # the package format (metadata fields, minisbd/ directory) argostranslate 1.9-1.11 reads
ARGOS_LENGTH_PENALTY = 0.2  # hard-coded in argostranslate's translate_batch call
ARGOS_BEAM = 4  # argostranslate's default ARGOS_BEAM_SIZE
# Argos leaves CTranslate2's length limits at their defaults: sources cut at 1,024 tokens, up to 256 decoded. A
# position table shorter than that makes CTranslate2 fail mid-request, so the package's tables cover them.
CT2_MAX_INPUT, CT2_MAX_DECODING = 1024, 256
# Argos' search as aiayn's decoding options (DecodeOptions fields): the module docstring says where each comes from.
ARGOS_SEARCH: dict[str, Any] = dict(beam=ARGOS_BEAM, alpha=ARGOS_LENGTH_PENALTY, length_penalty="power", stop="first",
                                    min_len=1, max_len_a=0.0, max_len_b=CT2_MAX_DECODING)
ARGOS_FLAGS = "--beam 4 --alpha 0.2 --length-penalty power --stop first --min-len 1 --max-len-a 0 --max-len-b 256"

_README = """\
# {src_name} -> {tgt_name} ({src} -> {tgt}), an aiayn Transformer

Exported by `aiayn export argos` from the aiayn run `{run}`: an encoder-decoder Transformer
("Attention Is All You Need"), {layers} layers, d_model {d_model}, {params:,} parameters, trained with
SentencePiece BPE ({vocab:,} shared pieces). Weights: {quant}.

{facts}

Install and use:

    python -c "from argostranslate.package import install_from_path; install_from_path('{file}')"
    argos-translate --from {src} --to {tgt} "Text to translate."

(`argospm install` takes the name of a package in Argos' online index, not a file.)

Decoding: Argos Translate runs beam search with beam ARGOS_BEAM_SIZE (default 4) and CTranslate2's length
penalty 0.2; the run itself was configured with beam {beam}, {lp} length penalty alpha {alpha}. With the run,
`aiayn translate RUN {argos_flags}` decodes as Argos does.

Sentence splitting: {splitter}
"""

_RULE_SPLITTER = ("aiayn's rule-based splitter (minisbd/{lang}.onnx): a sentence ends at . ! ? (or a closing "
                  "quote after one) followed by a space and an upper-case letter, digit or opening quote, and at "
                  "。！？; it does not know abbreviations (\"Dr. Smith\" is split).")
_MODEL_SPLITTER = "the MiniSBD model {name}, packaged as given."


def _package_name(src: str, tgt: str, version: str) -> str:
    return f"translate-{src}_{tgt}-{version.replace('.', '_')}"


def _ctranslate2_model(run: Any, run_dir: str | os.PathLike, vocab: list[str], quantization: str | None) -> Any:
    """The run's model as a CTranslate2 model spec over the shared ``vocab``, quantized (None: float32), with
    position rows for what Argos decodes. What CTranslate2 cannot hold is refused in one line (ConfigError)."""
    from aiayn.interop.ctranslate2 import ctranslate2_spec

    cfg, sp = run.cfg, run.tokenizers.specials
    # sinusoids continue past max_positions by their formula; learned vectors must cover what Argos decodes
    rows = max(cfg.model.max_positions, CT2_MAX_INPUT if cfg.model.positional == "sinusoidal" else CT2_MAX_DECODING)
    try:
        spec = ctranslate2_spec(run.model, vocab, unk_id=sp.unk, bos_id=sp.decoder_start, eos_id=sp.eos,
                                positions=rows)
        spec.optimize(quantization=quantization)
    except ValueError as e:  # a bad quantization name, head widths CTranslate2 cannot hold, ...
        why = f"Argos decodes up to {CT2_MAX_DECODING} tokens: " if "positions" in str(e) else ""
        raise ConfigError(f"cannot export {run_dir}: {why}{first_line(e)}") from None
    return spec


def _metadata(src: str, tgt: str, package_version: str) -> dict[str, Any]:
    """The package's metadata.json: a translate package from ``src`` to ``tgt`` (language codes)."""
    return {
        "package_version": package_version, "argos_version": ARGOS_VERSION, "type": "translate",
        "from_code": src, "from_name": language_name(src), "to_code": tgt, "to_name": language_name(tgt),
        "code": f"translate-{src}_{tgt}", "links": [],
    }


def export_argos(run_dir: str | os.PathLike, out_file: str | os.PathLike, *, quantization: str | None = None,
                 sentence_model: str | os.PathLike | None = None, package_version: str = "1.0",
                 force: bool = False) -> Path:
    """Write an Argos Translate package of the translation run ``run_dir`` to ``out_file`` (``.argosmodel``)
    and return its path.

    ``quantization``: a CTranslate2 weight type (e.g. int8, as Argos' own packages) or None (float32).
    ``sentence_model``: a MiniSBD ``.onnx`` model for the source language to package instead of aiayn's
    rule-based splitter. Runs that Argos cannot reproduce are refused with one line (:class:`ConfigError`):
    Moses-pretokenized runs, separate or character vocabularies, imported Marian runs (tasks and model options
    such as head widths are refused first, by :mod:`aiayn.interop.registry`). The zip is
    written beside ``out_file`` and renamed into place.
    """
    from aiayn.run.directory import load_run

    require("ctranslate2", "ct2", "aiayn export argos")
    registry.check("argos", run_dir)  # a direct call refuses what aiayn export refuses
    out = Path(out_file)
    if out.suffix != ".argosmodel":
        raise ConfigError(f"{out}: an Argos package file ends in .argosmodel (argospm and LibreTranslate look for it)")
    sentence_model = _check_sentence_model(sentence_model)
    guard_output(out, "zip", [run_dir], "", replace=force)
    run = load_run(run_dir, "cpu")
    cfg, tok = run.cfg, run.tokenizers
    _check_packageable(run, run_dir)
    vocab = [tok.src.id_to_piece(i) for i in range(tok.src.vocab_size)]
    spec = _ctranslate2_model(run, run_dir, vocab, quantization)

    src, tgt = cfg.data.src_lang, cfg.data.tgt_lang
    name = _package_name(src, tgt, package_version)
    sp_model = Path(run_dir) / "tokenizer" / "shared.model"
    d = cfg.decode
    readme = _README.format(
        src=src, tgt=tgt, src_name=language_name(src), tgt_name=language_name(tgt), run=Path(run_dir).resolve().name,
        layers=f"{cfg.model.n_encoder_layers}+{cfg.model.n_decoder_layers}",
        d_model=cfg.model.d_model, params=sum(p.numel() for p in run.model.parameters()), vocab=len(vocab),
        quant=quantization or "float32", file=out.name, beam=d.beam, lp=d.length_penalty, alpha=d.alpha,
        argos_flags=ARGOS_FLAGS,
        facts="\n".join(run_facts(run_dir, cfg)),
        splitter=(_MODEL_SPLITTER.format(name=sentence_model.name) if sentence_model is not None
                  else _RULE_SPLITTER.format(lang=src)),
    )
    files = {"model": spec, "sentencepiece.model": sp_model, "sentence_model": sentence_model,
             "metadata.json": _metadata(src, tgt, package_version), "README.md": readme}
    _write_package(out, name, src, files)
    return out


def _check_sentence_model(sentence_model: str | os.PathLike | None) -> Path | None:
    """``--sentence-model`` as a path, refused in one line unless it is an ONNX model file (Argos would fail on
    anything else at its first translation, far from here)."""
    if sentence_model is None:
        return None
    path = Path(sentence_model)
    if path.suffix != ".onnx" or not path.is_file():
        raise ConfigError(f"--sentence-model {path}: not a MiniSBD .onnx model file")
    problem = onnx_problem(path.read_bytes())
    if problem is not None:
        raise ConfigError(f"--sentence-model {path}: {problem}; give a MiniSBD .onnx model file")
    return path


def _check_packageable(run: Any, run_dir: str | os.PathLike) -> None:
    """What an Argos package cannot reproduce of the run's tokenizer, refused in one line: separate or character
    vocabularies, Moses pretokenization (tasks and model options: aiayn.interop.registry)."""
    tok = run.tokenizers
    if tok.src.kind != "bpe" or not tok.shared:
        what = "separate source and target vocabularies" if tok.src.kind == "bpe" else f"a {tok.src.kind} tokenizer"
        raise ConfigError(f"{run_dir} has {what}; an Argos package holds one SentencePiece model for both sides "
                          "(data.tokenizer: bpe with a shared vocabulary)")
    if tok.pretokenize != "none":
        raise ConfigError(f"{run_dir} pretokenizes with {tok.pretokenize} before SentencePiece; Argos feeds raw "
                          "text to SentencePiece, so the package would see other pieces than training did")


def _write_package(out: Path, name: str, src: str, files: dict[str, Any]) -> None:
    """The package's directory (the CTranslate2 model, SentencePiece model, sentence splitter, metadata, README)
    zipped to ``out``: staged beside it, fsynced, renamed into place whole."""
    spec, sp_model, sentence_model = files["model"], files["sentencepiece.model"], files["sentence_model"]
    metadata, readme = files["metadata.json"], files["README.md"]
    with _staging(out, name) as d:
        try:
            pkg = d / name  # the zip holds this one directory, as argospm's packages do
            (pkg / "minisbd").mkdir(parents=True)
            (pkg / "model").mkdir()
            spec.save(str(pkg / "model"))
            shutil.copy2(sp_model, pkg / "sentencepiece.model")
            if sentence_model is not None:
                shutil.copy2(sentence_model, pkg / "minisbd" / sentence_model.name)
            else:
                (pkg / "minisbd" / f"{src}.onnx").write_bytes(sentence_splitter_onnx(src))
            (pkg / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
            (pkg / "README.md").write_text(readme, encoding="utf-8")

            tmp = d / out.name
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
                for path in sorted(pkg.rglob("*")):
                    z.write(path, path.relative_to(d).as_posix())
            with open(tmp, "rb+") as f:  # its bytes reach the disk before the rename
                os.fsync(f.fileno())
            os.chmod(tmp, default_file_mode())
            os.replace(tmp, out)  # the package appears whole or not at all
        except OSError as e:  # a full disk names the package, not a temporary of the staging directory
            if e.filename is None or str(d) in str(e.filename):
                raise OSError(e.errno, e.strerror or str(e), str(out)) from e
            raise


@contextlib.contextmanager
def _staging(out: Path, package: str) -> Iterator[Path]:
    """A directory beside ``out`` (never in $TMPDIR: the rename into place stays on one file system, and nothing is
    left where the user does not look) to build the package in, locked while this export runs and removed after.
    First, what killed exports of ``out`` left there is removed: staging directories nobody holds (``.NAME.*.tmp``,
    and ``.aiayn-argos-*`` ones of earlier versions that hold this package) and loose ``.NAME.*.tmp`` zips. The
    folder of ``out`` is created when missing, and removed again if the export fails and leaves it empty."""
    parent = out.parent
    created = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    for old in parent.glob(f".{glob.escape(out.name)}.*{TMP_SUFFIX}"):
        if old.is_dir() and (old / LOCK).exists() and lock_holder(old) is None:  # locked at once when made
            shutil.rmtree(old, ignore_errors=True)
        elif old.is_file():  # earlier versions wrote the zip loose beside out; this one never does
            old.unlink(missing_ok=True)
    for old in parent.glob(".aiayn-argos-*"):
        if old.is_dir() and (old / package).exists() and lock_holder(old) is None:
            shutil.rmtree(old, ignore_errors=True)
    d = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=TMP_SUFFIX, dir=parent))
    lock = RunLock(d)
    ok = False
    try:
        lock.acquire()
        lock.write_pid()
        yield d
        ok = True
    finally:
        lock.release()
        shutil.rmtree(d, ignore_errors=True)
        if created and not ok:
            with contextlib.suppress(OSError):
                parent.rmdir()

