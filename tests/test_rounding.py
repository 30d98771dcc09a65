"""The simulated rounding of another CPU (tests/rounding.py, ``AIAYN_TEST_ROUNDING``) does what the suite relies on:
deterministic, bounded, shape-keyed for matrix products and row-keyed for softmax, and present in the processes
tests start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import rounding
import torch

SITE = Path(__file__).resolve().parent / "rounding_site"


def test_perturb_is_a_bounded_deterministic_function_of_the_bits():
    x = torch.tensor([1.0, -2.5, 0.0, float("inf"), float("-inf"), 3e-30, 7.0, 7.0])
    a, b = rounding.perturb(x, key=11, scale=1e-6), rounding.perturb(x, key=11, scale=1e-6)
    assert torch.equal(a, b)  # same bits, same key: same result (exact contracts still hold)
    assert a[6] == a[7]  # equal values stay equal
    assert a[2] == 0 and a[3] == float("inf") and a[4] == float("-inf")
    finite = torch.isfinite(x) & (x != 0)
    rel = ((a - x) / x)[finite].abs()
    assert rel.max() <= 1e-6 * 1.01 and rel.max() > 0  # moved, and by no more than the scale
    assert not torch.equal(rounding.perturb(x, key=12, scale=1e-6), a)  # another key, another machine
    nan = rounding.perturb(torch.tensor([float("nan")]), key=1, scale=1e-6)
    assert torch.isnan(nan).all()
    assert torch.equal(rounding.perturb(torch.arange(4), key=1, scale=1e-6), torch.arange(4))  # integers kept


def test_perturb_keeps_the_gradient():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    rounding.perturb(x, key=3, scale=1e-3).sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, torch.ones(2), atol=2e-3)


def test_settings_read_seed_and_scale(monkeypatch):
    monkeypatch.delenv(rounding.ENV, raising=False)
    assert rounding.settings() is None
    monkeypatch.setenv(rounding.ENV, "7")
    assert rounding.settings() == (7, 1e-6)
    monkeypatch.setenv(rounding.ENV, "7:1e-5")
    assert rounding.settings() == (7, 1e-5)


PROBE = """
import json, torch
import torch.nn.functional as F
torch.manual_seed(0)
x, w, s = torch.randn(5, 16), torch.randn(8, 16), torch.randn(5, 9)
print(json.dumps({
    "installed": getattr(F.linear, "_aiayn_rounding", False),
    "linear": F.linear(x, w).tolist(), "linear_row0_alone": F.linear(x[:1], w)[0].tolist(),
    "log_softmax": F.log_softmax(s, -1).tolist(), "log_softmax_row0_alone": torch.log_softmax(s[:1], -1)[0].tolist(),
    "matmul_op": (x @ w.T).tolist(),
}))
"""


def _probe(value: str | None) -> dict:
    """PROBE's output in a fresh Python process with ``AIAYN_TEST_ROUNDING=value`` (unset for None) and the
    rounding site on its path, as conftest gives the processes tests start."""
    env = {k: v for k, v in os.environ.items() if k not in (rounding.ENV, "PYTHONPATH")}
    env["PYTHONPATH"] = str(SITE)
    if value is not None:
        env[rounding.ENV] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_started_process_rounds_by_the_seed_and_the_shape():
    plain, one, again, two = _probe(None), _probe("1"), _probe("1"), _probe("2")
    assert not plain["installed"] and one["installed"]
    assert one == again  # deterministic across processes
    assert one["linear"] != plain["linear"] and one["linear"] != two["linear"]
    assert torch.allclose(torch.tensor(one["linear"]), torch.tensor(plain["linear"]), rtol=1e-5, atol=1e-5)
    assert one["matmul_op"] != plain["matmul_op"]  # the @ operator too
    # a matrix product of another shape may take another kernel: its rows may round otherwise
    assert one["linear_row0_alone"] != one["linear"][0]
    # a softmax reduces each row alone: a row rounds the same whatever the number of rows
    assert one["log_softmax_row0_alone"] == one["log_softmax"][0] != plain["log_softmax"][0]


def test_a_process_that_never_imports_torch_does_not_get_it():
    env = {**os.environ, rounding.ENV: "1", "PYTHONPATH": str(SITE)}
    code = "import sys, json; print(json.dumps('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


def test_this_process_rounds_exactly_when_asked():
    """The test process itself (an xdist worker too, where the site hook meets conftest's own import) is wrapped
    when the variable is set and only then."""
    import torch.nn.functional as F

    assert getattr(F.linear, "_aiayn_rounding", False) == (rounding.settings() is not None)
