# prism-fl developer commands. `make test` is the test command of the README and of CI.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1

.PHONY: install demo test lint typecheck pytest test-fast test-slow test-gpu test-compose mutation
.PHONY: bench-mechanism clean
.PHONY: bench-server bench-diagnostics bench-utility bench-gpu bench-accountant

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

# mypy as configured in pyproject.toml: strict on prism_core, prism_runtime, server and client.
typecheck: $(STAMP)
	$(BIN)/mypy

# Two pytest-xdist workers; the real-Flower tests share one group (tests/conftest.py), so one
# federation runs at a time beside the in-process tests. The 15 slowest tests are listed last.
PYTEST_WORKERS ?= 2

pytest: $(STAMP)
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=15

# The everyday inner loop: no lint or typecheck, and none of the tests that start real Flower
# processes (marker `flower`); `make test` still runs them all.
test-fast: $(STAMP)
	$(BIN)/pytest -n $(PYTEST_WORKERS) -m 'not slow and not gpu and not docker and not flower'

test: lint typecheck pytest

# Tests marked `slow`, outside `make test`: the hundred-virtual-site secure round on Flower's
# simulation engine (tests/e2e/test_secure_scale_simulation.py) and a run at the planner's config
# charging the plan's epsilon (tests/runtime/test_plan.py); pytest's exit status 5 ("no tests
# collected") is not a failure here.
test-slow: $(STAMP)
	$(BIN)/pytest -m slow || [ $$? -eq 5 ]

# The CUDA tests (tests/gpu): bf16 base, float32 LoRA; they skip, saying so, without a GPU.
test-gpu: $(STAMP)
	$(BIN)/pytest -m gpu tests/gpu -rs

# The compose federation on a REAL Docker Engine (tests/deploy/test_compose_docker.py, marker
# `docker`; not part of `make test`: CI has no engine). Builds prism-fl:cpu from this checkout
# first. TORCH_CPU_INDEX: where the image gets the CPU torch wheel (a local PEP 503 index on a
# machine without internet access); PRISM_UID/PRISM_GID: the containers' user (never 0; default
# 10001).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PRISM_UID ?= 10001
PRISM_GID ?= 10001

test-compose: $(STAMP)
	@docker info >/dev/null 2>&1 || { echo "make test-compose needs a running Docker Engine" \
		"with Compose v2" >&2; exit 2; }
	docker build --network host --build-arg TORCH_CPU_INDEX=$(TORCH_CPU_INDEX) \
		--build-arg PRISM_UID=$(PRISM_UID) --build-arg PRISM_GID=$(PRISM_GID) \
		-f deploy/Dockerfile -t prism-fl:cpu .
	$(BIN)/pytest -m docker tests/deploy/test_compose_docker.py -s

# Mutation testing of the privacy-critical modules, each against its own tests (mutmut; not
# part of `make test` or CI: hours of CPU). MUTATION_ARGS: module names and/or --jobs N.
MUTATION_ARGS ?=

mutation: $(STAMP)
	$(BIN)/python tests/mutation.py $(MUTATION_ARGS)

bench-mechanism: $(STAMP)
	$(BIN)/python bench/mechanism.py

bench-accountant: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(BIN)/python bench/accountant.py --out $(BENCH_OUT)/accountant.json

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
