# Every install step lives here: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

# The lowest torch pyproject admits, in a venv of its own (a CUDA build from PyPI: about
# 5 GB; it runs on the CPU).
LOWEST_TORCH ?= 2.11.0
LOWEST_VENV ?= .venv-torch-lowest

.PHONY: install demo test test-suite test-structure test-multirank test-lowest-torch clean

install: $(VENV)/.installed

# torch is installed first and by exact version so pip takes the local CPU build
# instead of resolving the multi-GB CUDA build from the index.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

demo: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/train_tiny_gpt.py

# Tests run in a random order (pytest-randomly). Not -q: the header names the order's seed;
# `pytest --randomly-seed=N tests` replays it, `pytest -p no:randomly tests` runs file order.
# `make test`: the whole suite on the pinned torch, then the structure tier on the lowest.
test: test-suite test-lowest-torch

# The single-process tier runs on NPROC pytest workers (pytest-xdist): its tests are
# independent processes' worth of work on one core each. The spawning tiers run one test at a
# time, their ranks using the cores.
test-suite: install
	$(PY) -m pytest -m structure -n $(NPROC) tests
	$(PY) -m pytest -m "not structure" tests

# One tier, for the change at hand: the single-process tier in minutes, the spawning one.
test-structure: install
	$(PY) -m pytest -m structure -n $(NPROC) tests

test-multirank: install
	$(PY) -m pytest -m multirank tests

$(LOWEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet torch==$(LOWEST_TORCH)
	$(LOWEST_VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $@

test-lowest-torch: $(LOWEST_VENV)/.installed
	$(LOWEST_VENV)/bin/python -m pytest -m structure -n $(NPROC) tests

clean:
	rm -rf $(VENV) $(LOWEST_VENV) build *.egg-info
