# The README's two commands: `make demo` (main job) and `make test` (suite).
# Each target creates the virtual environment and installs what it needs:
# `make demo` the demo's extra only (".[demo]": scikit-learn and matplotlib
# on top of TensorFlow and Keras), `make test` the suite's (".[test]": JAX,
# Ray, tf_keras, tfmot, mkdocs, ... several GB), which holds the demo's too.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# One stamp per extra, named after the checksum of setup.cfg and
# pyproject.toml: editing either installs again.
CHECKSUM := $(shell cat setup.cfg pyproject.toml | cksum | cut -d' ' -f1)
DEMO_STAMP := $(VENV)/.installed-demo-$(CHECKSUM)
TEST_STAMP := $(VENV)/.installed-test-$(CHECKSUM)

.PHONY: demo test test-all lint format docs docs-serve clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(DEMO_STAMP): setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[demo]"
	rm -f $(VENV)/.installed-demo-*
	touch $(DEMO_STAMP)

# ".[test]" holds every requirement of ".[demo]" (tests/test_install_lines.py
# checks it), so it stands for both.
$(TEST_STAMP): setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test]"
	rm -f $(VENV)/.installed-*
	touch $(TEST_STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/keras-dist demo

test: $(TEST_STAMP)
	$(BIN)/ruff check keras_dist tests examples benchmarks
	$(BIN)/ruff format --check keras_dist tests examples benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The whole suite: `make test` and the tests marked `extended` (longer soaks,
# further fault scenarios and backends; CONTRIBUTING.md, "Two tiers").
test-all: $(TEST_STAMP)
	$(MAKE) test PYTEST_ARGS="--extended $(PYTEST_ARGS)"

lint: $(TEST_STAMP)
	$(BIN)/ruff check keras_dist tests examples benchmarks
	$(BIN)/ruff format --check keras_dist tests examples benchmarks

format: $(TEST_STAMP)
	$(BIN)/ruff format keras_dist tests examples benchmarks
	$(BIN)/ruff check --fix keras_dist tests examples benchmarks

# The documentation site (mkdocs + mkdocstrings), strict: a broken link or
# reference fails. The test suite builds it too (tests/test_docs.py).
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .ruff_cache
