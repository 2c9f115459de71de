"""The audit records an operator command the leaser refuses on its bounds too (issue 11,
docs/audit.md: "refused ones too"): a refusal is an action asked for, and an incident's
log must show that someone tried. Real leaser, real NATS, through the CLI."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from jetfleet.cli.main import main
from jetfleet.dev.settings_file import settings_toml
from jetfleet.settings import Settings
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)


async def _cli(config: str, *argv: str) -> int:
    return await asyncio.to_thread(main, ["--config", config, *argv])


async def test_operator_commands_refused_on_their_bounds_are_recorded_refused(
    settings: Settings,
    services: InProcessStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "jetfleet.toml"
    path.write_text(settings_toml(settings))
    config = str(path)
    ana = ("--as", "ana", "--why", "incident 7")

    # Longer than the 366 days a record may last: the leaser's bounds check refuses it.
    too_long = ("quarantine", "set", "--identity", "id-1", "--target", "demo", "--for", "4e7")
    assert await _cli(config, *too_long, *ana) != 0
    # Not the canonical spelling of a network: refused before anything is looked up.
    release = ("quarantine", "release", "--subnet", "10.1.0.1/24", "--target", "demo")
    assert await _cli(config, *release, *ana) != 0
    # An approve naming no tuple.
    assert await _cli(config, "versions", "approve", "not-a-tuple-id", *ana) != 0

    capsys.readouterr()
    assert await _cli(config, "audit", "--json") == 0
    entries = json.loads(capsys.readouterr().out)
    assert [(e["action"], e["who"], e["why"], e["outcome"]) for e in entries] == [
        ("quarantine.set", "ana", "incident 7", "refused"),
        ("quarantine.release", "ana", "incident 7", "refused"),
        ("versions.approve", "ana", "incident 7", "refused"),
    ]
    assert "record.for_s" in entries[0]["detail"]
    assert "10.1.0.0/24" in entries[1]["detail"]
    assert "tuple id" in entries[2]["detail"]


async def test_cli_actions_refused_by_what_the_servers_hold_are_recorded_refused(
    settings: Settings,
    services: InProcessStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The commands that act themselves (dlq, target) record a refusal as the leaser does."""
    path = tmp_path / "jetfleet.toml"
    path.write_text(settings_toml(settings))
    config = str(path)
    bo = ("--as", "bo", "--why", "retry it")

    assert await _cli(config, "dlq", "replay", "999", *bo) != 0  # no such dead letter

    capsys.readouterr()
    assert await _cli(config, "audit", "--json") == 0
    entries = json.loads(capsys.readouterr().out)
    assert [(e["action"], e["who"], e["what"], e["why"], e["outcome"]) for e in entries] == [
        ("dlq.replay", "bo", "dead letter 999", "retry it", "refused"),
    ]
    assert "999" in entries[0]["detail"]
