"""The recipe of the tests' tiny trained run (conftest's ``tiny_run`` fixture, the docs check's stand-in, and the
tests that resume or retrain a copy of it): configs/tiny_reverse.yaml with these ``--set`` overrides. A module of
its own, free of side effects, so that tests/docs_check.py (a script) reads the very same list."""

from __future__ import annotations

TINY_RUN_OVERRIDES = [
    "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.dropout=0.0",
    "train.max_updates=60", "train.warmup=30", "train.eval_every=20", "train.save_every=20", "train.threads=1",
    "train.log_every=10", "data.max_tokens=512", "decode.max_len_b=5",
    # Short pieces (most words split in several) make targets long, so after 60 updates the toy model
    # emits varied non-empty output; with whole-word pieces it would still answer EOS at once.
    "data.vocab_size=300",
    # A peak learning rate of 0.2 x noam's for d_model 32 (6e-3 at update 30): at the full 3e-2 the 60 updates are
    # chaotic, so a CPU whose kernels round otherwise trains another model (under MKL_CBWR=COMPATIBLE it answered
    # EOS to every source, and `make test-isa ISA=avx2 MKL_CBWR=COMPATIBLE` failed). At 0.2 that passes, as does
    # the whole suite under the kernel sets of CONTRIBUTING.md ("The suite must pass on every CPU").
    "train.lr_scale=0.2",
]
