# The two commands of the README: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test setup
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

demo: setup
	$(BIN)/ltmp demo

test: setup
	@! grep -rn --include='*.py' -e 'fmt: skip' -e 'fmt: off' src tests benchmarks scripts || { echo 'the formatter lays out every file: remove fmt: skip / fmt: off'; exit 1; }
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q tests
