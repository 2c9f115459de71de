"""The distribution: one import root, no symlinks, sdist and wheel that install and run.

``services/`` and ``schemas/`` are top-level folders in the checkout but install as
``jetfleet.services`` and ``jetfleet.schemas``; nothing generic may land in site-packages.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _package_folders() -> set[str]:
    """Every package folder of the checkout, by the name it installs under."""
    names = set()
    for init in ROOT.glob("**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] not in ("jetfleet", "services", "schemas"):
            continue
        parts = list(rel.parts)
        if parts[0] != "jetfleet":
            parts.insert(0, "jetfleet")
        names.add(".".join(parts))
    return names


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    assert _package_folders() == listed


def test_the_checkout_has_no_symlinks() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    links = [line.split("\t")[1] for line in tracked.splitlines() if line.startswith("120000")]
    assert links == []


@pytest.mark.parametrize("name", ["schemas", "services"])
def test_the_source_folders_refuse_a_second_import_name(name: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode != 0
    assert f"import jetfleet.{name}, not {name}" in run.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    # The wheel is built from the sdist, as pip and PyPI would: a file missing from the
    # sdist then fails here too.
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


def test_the_wheel_holds_every_module_under_jetfleet_only(built: dict[str, Path]) -> None:
    names = zipfile.ZipFile(built["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"jetfleet"}
    for folder, prefix in (("services", "jetfleet/services"), ("schemas", "jetfleet/schemas")):
        for source in (ROOT / folder).rglob("*.py"):
            assert f"{prefix}/{source.relative_to(ROOT / folder).as_posix()}" in names
    assert "jetfleet/schemas/asyncapi.json" in names


@pytest.fixture(scope="module")
def installed(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheel and the sdist, each installed in a fresh venv of its own; both installs
    run at once (each is mostly waiting on pip)."""
    venvs = {kind: tmp_path_factory.mktemp(f"venv-{kind}") / "venv" for kind in built}
    for venv in venvs.values():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    installs = {
        kind: subprocess.Popen(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(built[kind])]
        )
        for kind, venv in venvs.items()
    }
    for kind, install in installs.items():
        assert install.wait(timeout=600) == 0, f"pip install of the {kind} failed"
    return venvs


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_each_distribution_installs_in_a_fresh_venv_and_runs(
    kind: str, installed: dict[str, Path], tmp_path: Path
) -> None:
    venv = installed[kind]
    py = venv / "bin" / "python"
    help_text = subprocess.run(
        [str(venv / "bin" / "jetfleet"), "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "jetfleet demo" in help_text
    probe = (
        "import importlib.util, jetfleet.schemas, jetfleet.services.sink.commit;"
        "print(importlib.util.find_spec('schemas'), importlib.util.find_spec('services'))"
    )
    # Run from the venv, not the checkout, so the source folders are not on sys.path.
    seen = subprocess.run(
        [str(py), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert seen.stdout.split() == ["None", "None"]
