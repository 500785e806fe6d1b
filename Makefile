# Two commands do everything: `make train` and `make test`. Both create .venv on first use.
#   make train ARGS="model=cnn trainer.max_epochs=5"   # Hydra overrides pass through ARGS
#   make eval ARGS="ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt"
#   make test PYTEST_ARGS="-k ddp -x"
# TORCH picks the torch build installed before the project (default: the newest release;
# a CPU-only machine can save gigabytes with e.g. TORCH="torch==2.13.0" where a CPU wheel is at hand).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch>=2.6
ARGS ?=
PYTEST_ARGS ?=
# Tests run in parallel, one worker per core (pytest-xdist); tests that share one expensive run
# stay on one worker (tests/conftest.py: SHARED_RUNS). PARALLEL= runs them one at a time. At
# most 8 workers (each may run a 2-process training); where a container sees more cores than
# its CPU quota grants, set PYTEST_XDIST_AUTO_NUM_WORKERS to the quota. A worker that crashes
# ends the run (its test fails): with --dist loadgroup, xdist 3.8 deadlocks at the end of a run
# whose crashed worker was replaced (pytest-dev/pytest-xdist#1378).
PARALLEL ?= -n auto --maxprocesses 8 --dist loadgroup --max-worker-restart=0

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install train eval test test-slow test-all lint format schema gpu-check

# Re-installs only when pyproject.toml changes (or the venv is missing): a second run is a no-op.
# train/eval need the project alone; test, lint and schema also the dev extras (test tools and
# what the optional features' tests use: plot, track, sweep).
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: Python 3.10+ is needed; run make PYTHON=python3.11 ...")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(DEV_STAMP)

install: $(DEV_STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

eval: $(STAMP)
	$(PY) eval.py $(ARGS)

# test: the fast tier (tests marked quick: configs, bad input, one 2-process DDP run with its
# parity check, one resume) and a line with its wall time. test-all: every test (what .ci/run
# runs). test-slow: only the slow end-to-end ones (docs/development.md).
test: lint
	@start=$$(date +%s); OMP_NUM_THREADS=1 $(PY) -m pytest -m quick $(PARALLEL) $(PYTEST_ARGS); code=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s wall (the quick tier; make test-all runs every test)"; \
	exit $$code

# pytest exits 5 when no test is marked slow: that is not a failure.
test-slow: $(DEV_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -m slow $(PARALLEL) $(PYTEST_ARGS) || [ $$? -eq 5 ]

# It lists its 20 slowest tests: what to trim first when the full tier's time grows.
test-all: lint
	@start=$$(date +%s); OMP_NUM_THREADS=1 $(PY) -m pytest $(PARALLEL) --durations=20 $(PYTEST_ARGS); code=$$?; \
	echo "make test-all: $$(( $$(date +%s) - start )) s wall (every test)"; exit $$code

lint: $(DEV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(DEV_STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# What only a GPU shows (precisions, compile, pinned memory and workers with CUDA, a bitwise
# resume, throughput and MFU): one line per check, under 5 minutes on one GPU; without CUDA one
# line and exit 0. src/project/gpu_check.py says what each check runs.
gpu-check: $(STAMP)
	$(PY) -m project.gpu_check $(ARGS)

# schema/<group>.json (for editors) from the typed-config dataclasses in
# src/project/engine/schema.py; a test fails while the committed files are stale.
schema: $(DEV_STAMP)
	$(PY) -m project.engine.config.schema schema
