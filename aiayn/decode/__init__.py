"""Decoding on token ids (search) and text in / text out (translator, generator). A run is opened for use by
``aiayn.load``, the one public loader (:func:`aiayn.decode.open_run.open_run` below it); import the rest from the
module itself (``aiayn.decode.translator``, ...)."""
