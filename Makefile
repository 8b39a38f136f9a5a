# prism-fl developer commands. `make test` is the test command of the README and of CI.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1

.PHONY: install demo test lint typecheck pytest test-slow test-gpu mutation bench-mechanism clean
.PHONY: bench-server bench-diagnostics bench-utility bench-gpu

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

DEMO_ARGS ?=

demo: $(STAMP)
	$(BIN)/python -m server.demo "$(DEMO_ARGS)"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

test: lint typecheck pytest

# Tests marked `slow` (none at present: the crash/resume tests run in `make test`); pytest's
# exit status 5 ("no tests collected") is not a failure here.
test-slow: $(STAMP)
	$(BIN)/pytest -m slow || [ $$? -eq 5 ]

# The CUDA tests (tests/gpu): bf16 base, float32 LoRA; they skip, saying so, without a GPU.
test-gpu: $(STAMP)
	$(BIN)/pytest -m gpu tests/gpu -rs

# Mutation testing of the privacy-critical modules, each against its own tests (mutmut; not
# part of `make test` or CI: hours of CPU). MUTATION_ARGS: module names and/or --jobs N.
MUTATION_ARGS ?=

mutation: $(STAMP)
	$(BIN)/python tests/mutation.py $(MUTATION_ARGS)

bench-mechanism: $(STAMP)
	$(BIN)/python bench/mechanism.py

# Benchmarks of docs/benchmarks.md (one thread each: the machine is shared).
BENCH_OUT ?= bench-results
UTILITY_ARGS ?=
UTILITY_OUT ?= $(BENCH_OUT)/utility-sst2

bench-server: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(BIN)/python bench/server.py --threads 1 --out $(BENCH_OUT)/server.json

bench-diagnostics: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(BIN)/python bench/diagnostics.py --threads 1 --plots docs --out $(BENCH_OUT)/diagnostics.json

bench-utility: $(STAMP)
	$(BIN)/python bench/utility.py --jobs 2 --threads 1 --out $(UTILITY_OUT) $(UTILITY_ARGS)

bench-gpu: $(STAMP)
	bench/gpu.sh $(BENCH_OUT)/gpu

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .flwr
