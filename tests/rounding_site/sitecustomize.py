"""Put on PYTHONPATH by tests/conftest.py when AIAYN_TEST_ROUNDING is set: every Python process a test starts
(the CLI, torchrun's workers) rounds as the test's own process does (tests/rounding.py). Installed when the process
imports torch, not before: a process that never does (``aiayn --help``) must not pay for it, and a test checks so."""

import importlib.abc
import importlib.util
import os
import sys


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds torch as usual, then wraps its ops once its module has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            import rounding

            # torch imported by rounding itself (conftest imports it first in a test process): rounding is half
            # run here, and its importer installs it once it has run
            if hasattr(rounding, "install"):
                rounding.install()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("AIAYN_TEST_ROUNDING", "").strip():
    sys.meta_path.insert(0, _AfterTorch())
