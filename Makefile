# Every install step lives here: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2

# The lowest torch pyproject admits, in a venv of its own (a CUDA build from PyPI: about
# 5 GB installed, 3 GB downloaded; it runs on the CPU). Installed without pip's cache, which
# would keep the 3 GB of wheels a second time: a CI disk once ran out of space here.
LOWEST_TORCH ?= 2.11.0
LOWEST_VENV ?= .venv-torch-lowest
LOWEST_FREE_GB ?= 9

.PHONY: install demo test test-suite test-structure test-multirank test-extended test-lowest-torch clean

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
# `make test` (CI, 90 minutes on 2 cores): the structure, multirank and gpu tiers on the
# pinned torch, then the bench's and test_structure's structure tests on the lowest. `--durations` names the
# slowest spawning tests in CI's log.
test: test-suite test-lowest-torch

# The single-process tier runs on NPROC pytest workers (pytest-xdist): its tests are
# independent processes' worth of work on one core each. The spawning tiers run one test at a
# time, their ranks using the cores.
test-suite: install
	$(PY) -m pytest -m structure -n $(NPROC) tests
	$(PY) -m pytest -m "multirank or gpu" --durations=25 tests

# One tier, for the change at hand: the single-process tier in minutes, the spawning one.
test-structure: install
	$(PY) -m pytest -m structure -n $(NPROC) tests

test-multirank: install
	$(PY) -m pytest -m multirank tests

# The spawning combinations CI leaves out for time (about 21 minutes on a 2-core EPYC): run them
# for a change to what they cover (docs/testing.md says what that is).
test-extended: install
	$(PY) -m pytest -m extended tests

$(LOWEST_VENV)/.installed: pyproject.toml
	@free=$$(df -Pk $(dir $(LOWEST_VENV)) | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(LOWEST_FREE_GB) ]; then \
	  echo "test-lowest-torch: $$free GB free beside $(LOWEST_VENV), the CUDA build of torch $(LOWEST_TORCH) needs about $(LOWEST_FREE_GB) GB while it installs; free disk space or set LOWEST_VENV to a larger disk" >&2; \
	  exit 1; \
	fi
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --no-cache-dir torch==$(LOWEST_TORCH)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --no-cache-dir -e '.[test]'
	touch $@

# On the lowest torch (the GPU image's), what the GPU rows run: the bench's structure tests
# (its presets at a fake world: HF Llama, tensor parallelism, float8, a compile-cache restart)
# and the core passes' invariants, and where torch 2.11's autograd differs: a missing gradient
# a block compiled on its own hands on. `LOWEST_TESTS=tests` runs the whole structure tier there.
LOWEST_TESTS ?= tests/test_bench.py tests/test_structure.py \
	tests/test_recompile.py::test_blocks_compiled_one_by_one_compile_once_for_all_the_layers
test-lowest-torch: $(LOWEST_VENV)/.installed
	$(LOWEST_VENV)/bin/python -m pytest -m structure -n $(NPROC) $(LOWEST_TESTS)

clean:
	rm -rf $(VENV) $(LOWEST_VENV) build *.egg-info
