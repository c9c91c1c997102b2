# Tandem: setup / serve / test / bench. `make test` works from a fresh clone on a CPU machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
# CPU machines get the local CPU build of torch; GPU nodes: `make setup TORCH_SPEC=torch` (CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: setup test lint format serve bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

serve: setup
	$(BIN)/tandem serve $(MODEL) $(ARGS)

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
