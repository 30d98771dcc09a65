"""Side-by-side speed comparisons of aiayn with the peers users would pick instead.

Scripts, not tests: ``python -m benchmarks.run_all`` (or one entry point) writes JSON and its section of
BENCHMARKS.md. CI runs only their seconds-long ``--smoke`` versions (tests/test_benchmarks.py).
"""
