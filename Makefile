# Two commands: `make demo` (the main job) and `make test`. Both set up .venv/ on a fresh clone.
# `make test-browser` also installs Debian's chromium + chromedriver (apt) and selenium, then drives the
# attention explorer page of `aiayn serve` in headless Chromium (tests/test_browser.py).
# PyTorch first: a PyTorch already in .venv is kept, whatever its version or build (the README's `pip install
# torch` into .venv, a CUDA build, a nightly), and make says so; otherwise TORCH (the version the suite last passed
# on) is installed, from TORCH_INDEX when it is set: pip's default index gives the CUDA build on Linux x86-64 (about
# 2 GB with its nvidia-* packages); `make TORCH_INDEX=https://download.pytorch.org/whl/cpu` gives the CPU-only wheel
# (about 200 MB). `make TORCH=torch==2.X.Y` given on the command line installs that one over what is there. Then
# the package, editable, with the test and serve extras, at the exact versions of constraints/test.txt (the test
# environment's lock, which leaves torch out; `make lock` refreshes it, see CONTRIBUTING.md).
PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK := constraints/test.txt
export AIAYN_DATA_DIR ?= $(if $(wildcard ../shared/data),$(abspath ../shared/data),)
# Test processes (pytest-xdist): one per core, at most 4 (each holds its own torch and fixtures); idle ones
# take tests from busy ones (worksteal), since a few tests run for minutes. The 15 slowest are listed, and every
# skip with its reason.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

.PHONY: setup demo test test-alone test-isa test-browser docs-check lint lock clean

setup: $(STAMP)
	@echo "aiayn is installed in $(VENV): activate it with 'source $(VENV)/bin/activate' to run 'aiayn ...'"

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ "$(origin TORCH)" = "file" ] && have=$$($(PY) -c "import torch; print(torch.__version__)" 2>/dev/null); then \
	  echo "keeping the PyTorch already in $(VENV): torch $$have (make TORCH=torch==X.Y.Z installs another; the suite last passed on $(TORCH))"; \
	else \
	  echo "installing $(TORCH) into $(VENV)$(if $(TORCH_INDEX), from $(TORCH_INDEX),)"; \
	  $(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),); \
	fi
	$(PY) -m pip install -q -c $(LOCK) -e ".[dev,serve,clients]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m aiayn demo

# In a random order (pytest-randomly): the seed is printed at the end, with the option that runs that order again.
test: $(STAMP)
	$(PY) -m pytest tests -m "not browser" -p randomly -n $(TEST_WORKERS) --dist worksteal --durations=15 -rs

# Each test file in a pytest process of its own (tests/alone.py): CI runs one of 6 shares of the files, by the day;
# ALONE=all runs every file, ALONE=K/6 share K.
ALONE ?= today
test-alone: $(STAMP)
	TEST_WORKERS=$(TEST_WORKERS) $(PY) tests/alone.py --share $(ALONE)

# The tests that compare two decoding paths token for token (batched vs alone, cached vs uncached, aiayn vs
# Hugging Face and CTranslate2), once more under another set of CPU kernels: ATEN_CPU_CAPABILITY=default (PyTorch's
# plain C++, any x86 CPU) rounds otherwise than avx2/avx512, and MKL_CBWR=COMPATIBLE makes MKL's matrix products
# take its SSE2 path instead of the one it picks for this CPU (AVX-512 kernels on an AVX-512 Xeon), so a test that
# holds only by one machine's rounding fails here. CI runs both (.ci/run); CONTRIBUTING.md says how to check the
# whole suite.
# ROUNDING=SEED[:SCALE] adds tests/rounding.py's simulated rounding of another CPU (every matrix product, softmax
# and layer norm result moved by up to SCALE of itself, 1e-6 by default): a machine with other kernels, on any machine.
ISA ?= default
MKL_CBWR ?=
ROUNDING ?=
ISA_TESTS := tests/test_translate.py tests/test_search.py tests/test_head_widths.py tests/test_export_run.py \
             tests/test_hf_interop.py tests/test_ctranslate2.py tests/test_argos.py tests/test_native.py
test-isa: $(STAMP)
	ATEN_CPU_CAPABILITY=$(ISA) MKL_CBWR=$(MKL_CBWR) AIAYN_TEST_ROUNDING=$(ROUNDING) $(PY) -m pytest $(ISA_TESTS) -n $(TEST_WORKERS) --dist worksteal

test-browser: $(STAMP)
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }
	$(PY) -c "import selenium" 2>/dev/null || $(PY) -m pip install -q -c $(LOCK) -e ".[dev,serve,browser]"
	$(PY) -m pytest tests/test_browser.py -m browser

# Every shell block of README.md and docs/*.md, run as written in a scratch directory against small stand-in runs
# (tests/docs_check.py says how); the blocks marked skip (network, GPU, long trainings) are listed with why.
docs-check: $(STAMP)
	$(PY) tests/docs_check.py

lint: $(STAMP)
	$(VENV)/bin/ruff check aiayn tests benchmarks

# The newest version of every dependency (torch stays $(TORCH)): a fresh .venv-latest, the suite run there, and
# on a pass its versions written to $(LOCK). Review the diff of the lock, then commit it with the result.
LATEST := .venv-latest
lock:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
	$(LATEST)/bin/python -m pip install -q -e ".[dev,serve,clients,browser]"
	$(LATEST)/bin/python -m pytest tests -m "not browser" -n $(TEST_WORKERS) --dist worksteal
	{ sed -n '/^#/p' $(LOCK); $(LATEST)/bin/python -m pip freeze --all --exclude-editable | grep -v -e '^torch==' -e '^pip=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) $(LATEST) runs/demo .pytest_cache
