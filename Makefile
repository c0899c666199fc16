# The README's two commands: `make demo` (main job) and `make test` (suite).
# Each target creates the virtual environment and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint format docs docs-serve clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,demo]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/keras-dist demo

test: $(STAMP)
	$(BIN)/ruff check keras_dist tests examples benchmarks
	$(BIN)/ruff format --check keras_dist tests examples benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check keras_dist tests examples benchmarks
	$(BIN)/ruff format --check keras_dist tests examples benchmarks

format: $(STAMP)
	$(BIN)/ruff format keras_dist tests examples benchmarks
	$(BIN)/ruff check --fix keras_dist tests examples benchmarks

# The documentation site (mkdocs + mkdocstrings), strict: a broken link or
# reference fails. The test suite builds it too (tests/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .ruff_cache
