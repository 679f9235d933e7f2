# The two commands of the README quickstart: `make train` and `make test`.
# Both create the virtual environment on first use (scripts/bootstrap.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test test-fast lint bootstrap

bootstrap:
	@VENV=$(VENV) scripts/bootstrap.sh

train: bootstrap
	$(VENV)/bin/nobubble train $(ARGS)

test: bootstrap
	$(PY) -m pytest -q $(ARGS)

test-fast: bootstrap
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check src tests benchmarks experiments
	$(VENV)/bin/ruff format --check src tests benchmarks experiments
