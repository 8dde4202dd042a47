# Default: the CPU build of torch (installs from a local file on the project's machines).
# A GPU user overrides it, e.g. `make test TORCH=torch`.
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo bench lint

$(PY):
	python3 -m venv $(VENV)

setup: $(PY)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,bench,hf]"

test: setup
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/packloss demo --out demo-out

bench: setup
	$(VENV)/bin/packloss bench all --threads 1 --out bench-out

lint: setup
	$(PY) -m ruff check src tests
