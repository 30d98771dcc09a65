"""What an exported model says about itself: its languages, data, training, measured BLEU and license, in the
lines that Hugging Face model cards (``aiayn export hf``) and Argos package READMEs (``aiayn export argos``)
share. An export that was never evaluated says "not measured"; one trained too briefly says so."""

from __future__ import annotations

import json
from pathlib import Path

from aiayn.config import Config
from aiayn.data.languages import language_name
from aiayn.eval.results import weights_info
from aiayn.run.directory import trained_updates

LICENSE_LINE = ("not set by aiayn (its code is MIT-licensed): these weights follow the terms of their training "
                "data and of whoever trained them; check both before publishing")


def _data(cfg: Config, source: str | None) -> str:
    d = cfg.data
    if source and source.startswith("imported from "):
        return f"{source} (see that model's card for its data)"
    if d.dataset:
        return f"the `{d.dataset}` dataset (its train split)"
    if d.train_src:
        return " and ".join(f"`{Path(f).name}`" for f in (d.train_src, d.train_tgt) if f)
    return "not recorded"


def _scores(run_dir: Path, source: str | None) -> list[str]:
    """One line per evaluation in eval/*.json of the weights the run uses now (older weights' are left out)."""
    lines = []
    for path in sorted((run_dir / "eval").glob("*.json")):
        try:
            r = json.loads(path.read_text(encoding="utf-8"))
            bleu = r["scores"]["bleu"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if source is not None and r.get("run", {}).get("weights_source", source) != source:
            continue
        n = f"{r['n_sentences']:,} sentences, " if "n_sentences" in r else ""
        chrf = f", chrF {r['scores']['chrf']:.2f}" if "chrf" in r["scores"] else ""
        sig = (r.get("signatures") or {}).get("bleu")
        decode = r.get("decode") if isinstance(r.get("decode"), dict) else {}
        lines.append(f"{r.get('name', path.stem)} ({n}beam {decode.get('beam', '?')}): "
                     f"{bleu:.2f} sacreBLEU{chrf}" + (f" (`{sig}`)" if sig else ""))
    return lines


def run_facts(run_dir: str | Path, cfg: Config) -> list[str]:
    """The facts of a translation run as markdown list items: languages, data, training, BLEU, license."""
    run_dir = Path(run_dir)
    source = weights_info(run_dir).get("weights_source")
    d = cfg.data
    updates = trained_updates(run_dir)
    if updates is None:
        training = "not recorded here" + (" (an imported model)" if source and "imported" in source else "")
    else:
        training = f"{updates:,} updates" + (f"; weights: {source}" if source else "")
        useful = cfg.expect.useful_updates
        if useful is not None and updates < useful:
            training += (f". **Undertrained**: its recipe needs {useful:,} updates to be useful; expect poor "
                         "translations")
    scores = _scores(run_dir, source)
    bleu = "; ".join(scores) if scores else ("not measured (`aiayn evaluate RUN --split NAME` or `--src F --ref F` "
                                              "before exporting puts it here)")
    return [f"- Languages: {language_name(d.src_lang)} ({d.src_lang}) -> {language_name(d.tgt_lang)} ({d.tgt_lang})",
            f"- Data: {_data(cfg, source)}",
            f"- Training: {training}",
            f"- BLEU: {bleu}",
            f"- License: {LICENSE_LINE}"]
