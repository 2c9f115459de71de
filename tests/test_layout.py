"""The core never imports dev tooling or operator tools.

The core is the life of a job: the top of ``jetfleet/``, the worker, the wire types, and
the scheduler, leaser and sink. The embedded servers and dev stack (``jetfleet.dev``),
the operator tools (``jetfleet.ops``), the CLI, the simulator and the scenario sit one
level down and may import the core, never the other way round (a production worker must
not drag in the test target or the embedded nats-server). Every import counts, also one
inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLING = (
    "jetfleet.dev",
    "jetfleet.ops",
    "jetfleet.cli",
    "jetfleet.simulator",
    "jetfleet.scenario",
)


def _core_files() -> list[Path]:
    top = [p for p in (ROOT / "jetfleet").glob("*.py") if p.name != "__main__.py"]
    deeper = [
        *(ROOT / "jetfleet" / "worker").rglob("*.py"),
        *(ROOT / "schemas").rglob("*.py"),
        *(ROOT / "services" / "scheduler").rglob("*.py"),
        *(ROOT / "services" / "leaser").rglob("*.py"),
        *(ROOT / "services" / "sink").rglob("*.py"),
    ]
    return sorted(top + deeper)


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_core_is_where_the_layout_says() -> None:
    assert len(_core_files()) > 40  # the globs above still find the core


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_core_module_imports_no_dev_or_operator_tooling(path: Path) -> None:
    bad = sorted(
        name
        for name in _imported(path)
        if any(name == tool or name.startswith(tool + ".") for tool in TOOLING)
    )
    assert bad == [], f"{path.relative_to(ROOT)} imports {bad}"
