# One entry point for checks. `make check` = lint + types + generated schemas current.
PY ?= python

.PHONY: all check lint format mypy schemas test bench

all: check test

check: lint mypy schemas

lint:
	$(PY) -m ruff check jetfleet services schemas tests bench
	$(PY) -m ruff format --check jetfleet services schemas tests bench

format:
	$(PY) -m ruff format jetfleet services schemas tests bench
	$(PY) -m ruff check --fix jetfleet services schemas tests bench

mypy:
	$(PY) -m mypy

schemas:
	$(PY) -m jetfleet schemas check

test:
	$(PY) -m pytest

bench:
	$(PY) bench/run.py
