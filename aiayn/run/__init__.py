"""A run directory on disk (its layout: docs/architecture.md, "Run directory"): :mod:`aiayn.run.weights`, its weight
files (save, read, check, average, checkpoint names, which weights inference uses; floor 2, below the model and the
trainer that write them), and :mod:`aiayn.run.directory`, a trained run read for use (config, tokenizer, model;
floor 6, above the model and data it builds). Import from the module itself."""
