"""Put on PYTHONPATH by tests/conftest.py when AIAYN_TEST_ROUNDING is set: every Python process a test starts
(the CLI, torchrun's workers) rounds as the test's own process does (tests/rounding.py)."""

import os
import sys

if os.environ.get("AIAYN_TEST_ROUNDING", "").strip():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import rounding

    rounding.install()
