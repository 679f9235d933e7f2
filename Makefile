# The two commands of the README quickstart: `make train` and `make test`.
# Both create the virtual environment on first use (scripts/bootstrap.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# `make test` installs every optional extra, so the tests of export, eval and the loggers run.
TEST_EXTRAS := dev,hf,eval,tensorboard,wandb

.PHONY: train test test-all test-fast lint bootstrap bootstrap-test

bootstrap:
	@VENV=$(VENV) scripts/bootstrap.sh

bootstrap-test:
	@VENV=$(VENV) EXTRAS=$(TEST_EXTRAS) scripts/bootstrap.sh

train: bootstrap
	$(VENV)/bin/nobubble train $(ARGS)

# make test: what CI runs (.ci/run); test-all adds the `extended` cases (more optimizers and
# schedules over paths make test already covers); test-fast: no multi-process or long test.
test: bootstrap-test
	$(PY) -m pytest -q -m "not extended" $(ARGS)

test-all: bootstrap-test
	$(PY) -m pytest -q $(ARGS)

test-fast: bootstrap-test
	$(PY) -m pytest -q -m "not slow and not extended" $(ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check src tests benchmarks experiments
	$(VENV)/bin/ruff format --check src tests benchmarks experiments
