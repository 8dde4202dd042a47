# Default: the CPU build of torch (installs from a local file on the project's machines).
# A GPU user overrides it, e.g. `make test TORCH=torch`.
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-cp demo bench bench-gpu lint

$(PY):
	python3 -m venv $(VENV)

setup: $(PY)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,bench,hf]"

test: setup
	$(PY) -m pip install -q -e ".[peers]"
	# OpenRLHF's full install needs CUDA builds (flash-attn, deepspeed); its loss module needs only torch
	$(PY) -m pip install -q --no-deps "openrlhf==0.11.2"
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q -n 2 --dist loadfile

# The context-parallel harness over every (dp, cp) layout x shard style (CI runs each layout once).
test-cp: setup
	PACKLOSS_CP_FULL=1 $(PY) -m pytest -q tests/testing/test_context_parallel.py

demo: setup
	$(VENV)/bin/packloss demo --out demo-out

bench: setup
	$(VENV)/bin/packloss bench all --threads 1 --out bench-out

# On a CUDA machine (with a CUDA torch, e.g. TORCH=torch): sync checks, GPU equivalence, every suite,
# figures written into docs/benchmarks.md.
bench-gpu: setup
	$(PY) scripts/gpu_check.py --out bench-out-gpu

lint: setup
	$(PY) -m ruff check src tests
