"""A run directory on disk (its layout: docs/architecture.md, "Run directory"): :mod:`aiayn.run.weights`, its weight
files (save, read, check, average, checkpoint names, which weights inference uses; floor 2, below the model and the
trainer that write them), :mod:`aiayn.run.inference_weights`, the weights a training's end writes for inference (floor
2, the validation scores handed to it), :mod:`aiayn.run.ownership`, who owns it (new, empty or resumed, its marker and
lock; floor 3, the training's processes and checkpoint check handed to it), and :mod:`aiayn.run.directory`, a trained
run read for use (config, tokenizer, model; floor 6, above the model and data it builds). Import from the module
itself."""
