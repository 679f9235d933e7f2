# The two commands of the README quickstart: `make train` and `make test`.
# Both create the virtual environment on first use (scripts/bootstrap.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# `make test` installs every optional extra, so the tests of export, eval and the loggers run.
TEST_EXTRAS := dev,hf,eval,tensorboard,wandb

.PHONY: train test test-fast lint bootstrap bootstrap-test

bootstrap:
	@VENV=$(VENV) scripts/bootstrap.sh

bootstrap-test:
	@VENV=$(VENV) EXTRAS=$(TEST_EXTRAS) scripts/bootstrap.sh

train: bootstrap
	$(VENV)/bin/nobubble train $(ARGS)

test: bootstrap-test
	$(PY) -m pytest -q $(ARGS)

test-fast: bootstrap-test
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check src tests benchmarks experiments
	$(VENV)/bin/ruff format --check src tests benchmarks experiments
