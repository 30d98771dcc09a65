"""Decoding on token ids (search) and text in / text out (translator, generator), and :func:`load`, the one loader
of a trained run (:mod:`aiayn.decode.open_run`)."""

from aiayn.decode.open_run import load

__all__ = ["load"]
