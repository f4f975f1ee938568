# The two commands of the README: `make run` (the stack, embedded model) and `make test`.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup run test test-slow test-gpu lint bench

setup:
	@./scripts/setup.sh

run: setup
	@$(PY) -m deploy.launcher $(ARGS)

# the default suite over TEST_WORKERS processes (pytest-xdist), a test file each (its module stacks start once);
# TEST_WORKERS=0: one process
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m "slow and not gpu" $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check services deploy tests bench
	$(PY) -m mypy services/engine services/common

bench: setup
	$(PY) bench/decode.py
