"""I9 in the code, not only on the wire: the leaser, the sink and the worker never read
the wall clock. Lease expiry is the server's per-key TTL and every local wait is
monotonic (DESIGN.md I2, I9), so a skewed or jumping clock on any host decides nothing.

An AST check over those modules and every jetfleet module they import (so a helper that
reads ``time.time()`` on their behalf is caught too). ``time.monotonic`` and
``loop.time()`` are fine; ``time.time``, ``datetime.now`` and friends are not, called or
passed as a clock.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Where each installed package lives in the repository (package-dir mapping).
PACKAGE_DIRS = {
    "jetfleet.services": REPO / "services",
    "jetfleet.schemas": REPO / "schemas",
    "jetfleet": REPO / "jetfleet",
}
ROOTS = (
    "jetfleet.services.leaser",
    "jetfleet.services.sink",
    "jetfleet.worker",
    "jetfleet.lease_store",
    "jetfleet.lease_client",
)
WALL_CLOCK = frozenset(
    {
        "time.time",
        "time.time_ns",
        "time.localtime",
        "time.gmtime",
        "time.ctime",
        "time.asctime",
        "time.strftime",
        "datetime.datetime.now",
        "datetime.datetime.utcnow",
        "datetime.datetime.today",
        "datetime.date.today",
    }
)


def module_file(module: str) -> Path | None:
    """The repository file of a jetfleet module (a package's ``__init__.py``), if any."""
    for prefix, folder in PACKAGE_DIRS.items():
        if module == prefix or module.startswith(prefix + "."):
            rel = module[len(prefix) :].lstrip(".").replace(".", "/")
            base = folder / rel if rel else folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
            return None
    return None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(tree: ast.Module, module: str, path: Path) -> Iterator[str]:
    """Every module ``tree`` imports (``from . import x`` resolved), jetfleet or not."""
    package = _package_of(module, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def closure(roots: tuple[str, ...]) -> dict[str, Path]:
    """The roots and every jetfleet module reachable from them by imports."""
    found: dict[str, Path] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        path = module_file(module)
        if path is None or module in found:
            continue
        found[module] = path
        todo += imported_modules(ast.parse(path.read_text()), module, path)
    return found


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value, aliases)
        return f"{head}.{node.attr}" if head else None
    return None


def wall_clock_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every reference to a wall-clock reader in ``source``."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> what it is ("time", "datetime.date", ...)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = full
                if full in WALL_CLOCK:  # from time import time
                    found.append((node.lineno, full))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute | ast.Name):
            name = _dotted(node, aliases)
            if name in WALL_CLOCK:
                found.append((node.lineno, name))
    return sorted(set(found))


def test_I9_the_leaser_sink_and_worker_never_read_the_wall_clock() -> None:
    modules = closure(ROOTS)
    # The closure really spans what it guards (a broken resolver would check nothing).
    for expected in (*ROOTS, "jetfleet.services.sink.commit", "jetfleet.worker.runtime"):
        assert expected in modules, sorted(modules)
    assert "jetfleet.inflight_caps" in modules  # reached only through an import
    reads = {
        f"{path.relative_to(REPO)}:{line}": name
        for module, path in sorted(modules.items())
        for line, name in wall_clock_reads(path.read_text())
    }
    assert reads == {}, f"wall-clock reads in the lease path (use time.monotonic): {reads}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import time\nt = time.time()", ["time.time"]),
        ("import time\nclock = time.time_ns", ["time.time_ns"]),
        ("import time as t\nx = t.time()", ["time.time"]),
        ("from time import time\nx = time()", ["time.time", "time.time"]),
        ("from time import time as now\nx = now()", ["time.time", "time.time"]),
        ("import datetime\nx = datetime.datetime.now(datetime.UTC)", ["datetime.datetime.now"]),
        ("from datetime import datetime\nx = datetime.utcnow()", ["datetime.datetime.utcnow"]),
        ("from datetime import date as d\nx = d.today()", ["datetime.date.today"]),
        ("import time\nx = time.monotonic()\ny = time.perf_counter()", []),
        ("import asyncio\nx = asyncio.get_running_loop().time()", []),
        ("def time():\n    return 1\nx = time()", []),
    ],
)
def test_I9_the_clock_check_sees_every_spelling(source: str, expected: list[str]) -> None:
    """Guards the guard: aliases, from-imports and references passed as clocks."""
    assert [name for _, name in wall_clock_reads(source)] == sorted(expected)
