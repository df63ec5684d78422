# Every install step lives here: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: install demo test clean

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
test: install
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
