# Two commands: `make demo` (the main job) and `make test`. Both set up .venv/ on a fresh clone.
# torch==2.13.0 is installed first so that no CUDA wheels are pulled on a CPU machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export AIAYN_DATA_DIR ?= $(if $(wildcard ../shared/data),$(abspath ../shared/data),)

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m aiayn demo

test: $(STAMP)
	$(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check aiayn tests benchmarks

clean:
	rm -rf $(VENV) runs/demo .pytest_cache
