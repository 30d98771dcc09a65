# Two commands: `make demo` (the main job) and `make test`. Both set up .venv/ on a fresh clone.
# `make test-browser` also installs Debian's chromium + chromedriver (apt) and selenium, then drives the
# attention explorer page of `aiayn serve` in headless Chromium (tests/test_browser.py).
# torch==2.13.0 is installed first so that no CUDA wheels are pulled on a CPU machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export AIAYN_DATA_DIR ?= $(if $(wildcard ../shared/data),$(abspath ../shared/data),)

.PHONY: setup demo test test-browser lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,serve]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m aiayn demo

test: $(STAMP)
	$(PY) -m pytest tests -m "not browser"

test-browser: $(STAMP)
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }
	$(PY) -c "import selenium" 2>/dev/null || $(PY) -m pip install -q -e ".[dev,serve,browser]"
	$(PY) -m pytest tests/test_browser.py -m browser

lint: $(STAMP)
	$(VENV)/bin/ruff check aiayn tests benchmarks

clean:
	rm -rf $(VENV) runs/demo .pytest_cache
