# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0

.PHONY: install demo test test-fast lint bench bench-memory clean

# torch goes in first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/shardwise demo

test: install lint
	OMP_NUM_THREADS=1 $(PY) -m pytest

# The loop while developing: everything but the tests marked slow (`make test` runs them all).
test-fast: install lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy src

bench: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 benchmarks/step_time.py

bench-memory: install
	OMP_NUM_THREADS=1 $(PY) benchmarks/memory.py

clean:
	rm -rf $(VENV) build src/*.egg-info
