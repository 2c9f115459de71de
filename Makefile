# One entry point for checks. `make check` = lint + types + generated schemas current.
PY ?= python

.PHONY: all check lint format mypy schemas test bench bench-smoke

all: check test

check: lint mypy schemas

lint:
	$(PY) -m ruff check jetfleet services schemas tests bench
	$(PY) -m ruff format --check jetfleet services schemas tests bench

format:
	$(PY) -m ruff format jetfleet services schemas tests bench
	$(PY) -m ruff check --fix jetfleet services schemas tests bench

# mypy cannot follow setuptools' editable import hook, so it reads a tree of links laid
# out the way the package installs (services/ and schemas/ inside jetfleet/). The links
# live under build/ only; the repository itself has none.
TYPECHECK_TREE := build/typecheck

mypy:
	rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/jetfleet
	for f in jetfleet/*; do ln -s $(CURDIR)/$$f $(TYPECHECK_TREE)/$$f; done
	ln -s $(CURDIR)/services $(TYPECHECK_TREE)/jetfleet/services
	ln -s $(CURDIR)/schemas $(TYPECHECK_TREE)/jetfleet/schemas
	MYPYPATH=$(TYPECHECK_TREE) $(PY) -m mypy

schemas:
	$(PY) -m jetfleet schemas check

test:
	$(PY) -m pytest

bench:
	$(PY) bench/run.py

# The speed guard: the full path's jobs/s beside the raw nats-py floor, measured in one run.
bench-smoke:
	$(PY) bench/smoke_bench.py
