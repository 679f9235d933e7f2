# The two commands of the README quickstart: `make train` and `make test`.
# Both create the virtual environment on first use (scripts/bootstrap.sh), from the hashed locks
# of scripts/lock.sh: `make train` installs nobubble's own dependencies (locks/core.txt); `make
# test` those of every optional extra too (locks/all.txt), so that every test runs.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test test-all test-fast lint lock bootstrap bootstrap-test

bootstrap:
	@VENV=$(VENV) LOCK=core scripts/bootstrap.sh

bootstrap-test:
	@VENV=$(VENV) LOCK=all scripts/bootstrap.sh

# after a change to pyproject.toml's dependencies; ARGS=--upgrade moves every pin to the newest
lock: bootstrap-test
	UV=$(VENV)/bin/uv scripts/lock.sh $(ARGS)

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

lint: bootstrap-test
	$(VENV)/bin/ruff check src tests benchmarks experiments
	$(VENV)/bin/ruff format --check src tests benchmarks experiments
