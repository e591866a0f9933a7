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
	$(PY) -m cpkv_jax.tools.make_tiny_checkpoint $(DEMO_DIR)/tiny-glm5 --arch glm_moe_dsa
	$(PY) -m cpkv_jax.generate --model-path $(DEMO_DIR)/tiny-glm5 \
		--prompt "Context-parallel prefill shares one copy of the KV cache across ranks." \
		--max-new-tokens 24 --page-size 16 --ignore-eos \
		--output-json $(DEMO_DIR)/reference.json $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache .ruff_cache
