# One entry point for checks. `make check` = lint + types + generated schemas current.
PY ?= python

.PHONY: all check lint format mypy schemas lock-check lock lock-upgrade test bench bench-smoke

all: check test

check: lint mypy schemas lock-check

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

# The lock files (docs/deploy.md#the-lock-files): every package by exact version and hash,
# for CPython 3.11 on Linux x86_64, resolved from PyPI by uv (`pip install uv`; 0.13.9
# wrote the committed ones). requirements.lock is the runtime (the image, the README's
# demo install); requirements-dev.lock adds the dev extra (CI, the tests) under the same
# versions. `make lock` keeps every pin that still fits pyproject.toml and resolves only
# what changed; `make lock-upgrade` takes the newest releases the ranges allow.
# lock-check (part of `check`) fails when pyproject.toml changed without a relock.
UV ?= uv
LOCK_FOR := --python-version 3.11 --python-platform x86_64-unknown-linux-gnu \
	--generate-hashes --custom-compile-command "make lock"

lock:
	$(UV) pip compile pyproject.toml $(LOCK_FOR) $(LOCK_FLAGS) -o requirements.lock
	$(UV) pip compile pyproject.toml --extra dev -c requirements.lock $(LOCK_FOR) $(LOCK_FLAGS) \
		-o requirements-dev.lock

lock-upgrade:
	$(MAKE) lock LOCK_FLAGS=--upgrade

lock-check:
	$(PY) -m pytest -q -p no:cacheprovider -n 0 tests/test_lock.py

test:
	$(PY) -m pytest

bench:
	$(PY) bench/run.py

# The speed guard: the full path's jobs/s beside the raw nats-py floor, measured in one run.
bench-smoke:
	$(PY) bench/smoke_bench.py
