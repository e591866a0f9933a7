# Two commands for a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs the package (editable) with its test extras.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cpkv-installed
DEMO_DIR ?= .demo
ARGS ?=

.PHONY: demo test lint format clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m serving.demo --model-dir $(DEMO_DIR)/tiny-glm5-fp8 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers (the dev machine's cores), whole test files per worker so module fixtures
# (servers, checkpoints) are built once; the ten slowest tests are printed at the end.
# Files go out in the order tests/conftest.py sorts them (the longest slow files first);
# xdist's default reorders them by test count, which started the long PD load files last.
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache .ruff_cache
