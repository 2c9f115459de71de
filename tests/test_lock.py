"""The lock files agree with pyproject.toml: a dependency added, dropped or re-ranged
without `make lock` fails here, naming the package and the fix (docs/deploy.md, "The lock
files"). Offline: it reads the files, it does not resolve anything."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_LOCK = ROOT / "requirements.lock"
DEV_LOCK = ROOT / "requirements-dev.lock"
RELOCK = "run `make lock` (docs/deploy.md#the-lock-files) and commit both lock files"
SELF = "jetfleet (pyproject.toml)"
"""How the resolver names pyproject.toml in a pin's ``# via`` lines."""
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


@dataclass
class Pin:
    """One package of a lock file: its version, hashes and what requires it."""

    version: str
    hashes: list[str] = field(default_factory=list)
    via: list[str] = field(default_factory=list)


def read_lock(path: Path) -> dict[str, Pin]:
    """``path``'s pins by canonical name, with the ``--hash`` and ``# via`` lines under each."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            current = pins.setdefault(canonicalize_name(match[1]), Pin(match[2]))
        elif current is not None and "--hash=" in line:
            current.hashes.append(line.split("--hash=", 1)[1].rstrip(" \\"))
        elif current is not None and line.startswith("    #"):
            text = line.lstrip(" #").removeprefix("via").strip()
            if text and not text.startswith("-c "):
                current.via.append(canonicalize_name(text) if text != SELF else SELF)
    return pins


def declared(extra: str | None = None) -> list[Requirement]:
    """pyproject.toml's runtime requirements, or those of one extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def _problems(lock: dict[str, Pin], wanted: list[Requirement], name: str) -> list[str]:
    found = []
    direct = {canonicalize_name(r.name) for r in wanted}
    for req in wanted:
        pin = lock.get(canonicalize_name(req.name))
        if pin is None:
            found.append(f"{req} is in pyproject.toml but not pinned in {name}")
        elif not req.specifier.contains(Version(pin.version), prereleases=True):
            found.append(f"{name} pins {req.name}=={pin.version}, outside pyproject's {req}")
    for package, pin in lock.items():
        if not pin.hashes:
            found.append(f"{name}: {package}=={pin.version} has no --hash")
        if not pin.via:
            found.append(f"{name}: {package} says nothing requires it")
        for source in pin.via:
            if source == SELF and package not in direct:
                found.append(
                    f"{name}: {package} is pinned for pyproject.toml, which no longer asks for it"
                )
            elif source != SELF and source not in lock:
                found.append(f"{name}: {package} is pinned for {source}, which is not pinned")
    return found


def test_the_runtime_lock_pins_exactly_what_pyproject_asks_for() -> None:
    problems = _problems(read_lock(RUNTIME_LOCK), declared(), RUNTIME_LOCK.name)
    assert problems == [], "\n".join([*problems, RELOCK])


def test_the_dev_lock_pins_the_runtime_and_the_dev_extra() -> None:
    wanted = declared() + declared("dev")
    problems = _problems(read_lock(DEV_LOCK), wanted, DEV_LOCK.name)
    assert problems == [], "\n".join([*problems, RELOCK])


def test_both_locks_agree_on_every_package_they_share() -> None:
    """CI and the tests run the dev lock, the image the runtime one: the same versions and
    files, or the image would run code the tests never saw."""
    runtime, dev = read_lock(RUNTIME_LOCK), read_lock(DEV_LOCK)
    missing = sorted(set(runtime) - set(dev))
    assert missing == [], f"{DEV_LOCK.name} lacks {missing}: {RELOCK}"
    differ = [
        f"{name}: {pin.version} in {RUNTIME_LOCK.name}, {dev[name].version} in {DEV_LOCK.name}"
        for name, pin in runtime.items()
        if (pin.version, sorted(pin.hashes)) != (dev[name].version, sorted(dev[name].hashes))
    ]
    assert differ == [], "\n".join([*differ, RELOCK])


def test_the_check_itself_catches_a_dependency_added_without_relocking(tmp_path: Path) -> None:
    lock = read_lock(RUNTIME_LOCK)
    assert lock, "the lock reads as empty: its format changed, and this test sees nothing"
    added = [*declared(), Requirement("left-pad>=1")]
    narrowed = [Requirement("nats-py<2.0") if r.name == "nats-py" else r for r in declared()]
    dropped = [r for r in declared() if r.name != "protego"]
    assert _problems(lock, added, "x") == ["left-pad>=1 is in pyproject.toml but not pinned in x"]
    assert _problems(lock, narrowed, "x") == [
        f"x pins nats-py=={lock['nats-py'].version}, outside pyproject's nats-py<2.0"
    ]
    assert _problems(lock, dropped, "x") == [
        "x: protego is pinned for pyproject.toml, which no longer asks for it"
    ]


@pytest.mark.parametrize("path", [RUNTIME_LOCK, DEV_LOCK], ids=lambda p: p.name)
def test_the_lock_names_the_command_that_writes_it(path: Path) -> None:
    header = path.read_text().splitlines()[:2]
    assert header[1].strip("# ") == "make lock", f"{path.name}: written by hand? {RELOCK}"
    assert "pip compile pyproject.toml" in (ROOT / "Makefile").read_text()
