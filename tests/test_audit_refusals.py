"""The audit records an operator command the leaser refuses on its bounds too (issue 11,
docs/audit.md: "refused ones too"): a refusal is an action asked for, and an incident's
log must show that someone tried. Real leaser, real NATS, through the CLI."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.cli.main import main
from jetfleet.dev.settings_file import settings_toml
from jetfleet.lease_client import LeaseClient
from jetfleet.settings import Settings
from tests.leasing import ask, order_for, refused
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def config(settings: Settings, services: InProcessStack, tmp_path: Path) -> str:
    """A config file for the CLI, naming the running stack's servers."""
    path = tmp_path / "jetfleet.toml"
    path.write_text(settings_toml(settings))
    return str(path)


async def _cli(config: str, *argv: str) -> int:
    return await asyncio.to_thread(main, ["--config", config, *argv])


async def _audit(config: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, str]]:
    capsys.readouterr()
    assert await _cli(config, "audit", "--json") == 0
    entries: list[dict[str, str]] = json.loads(capsys.readouterr().out)
    return entries


async def test_operator_commands_refused_on_their_bounds_are_recorded_refused(
    config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ana = ("--as", "ana", "--why", "incident 7")

    # Longer than the 366 days a record may last: the leaser's bounds check refuses it.
    too_long = ("quarantine", "set", "--identity", "id-1", "--target", "demo", "--for", "4e7")
    assert await _cli(config, *too_long, *ana) != 0
    # Not the canonical spelling of a network: refused before anything is looked up.
    release = ("quarantine", "release", "--subnet", "10.1.0.1/24", "--target", "demo")
    assert await _cli(config, *release, *ana) != 0
    # An approve naming no tuple.
    assert await _cli(config, "versions", "approve", "not-a-tuple-id", *ana) != 0

    entries = await _audit(config, capsys)
    assert [(e["action"], e["who"], e["why"], e["outcome"]) for e in entries] == [
        ("quarantine.set", "ana", "incident 7", "refused"),
        ("quarantine.release", "ana", "incident 7", "refused"),
        ("versions.approve", "ana", "incident 7", "refused"),
    ]
    assert "record.for_s" in entries[0]["detail"]
    assert "10.1.0.0/24" in entries[1]["detail"]
    assert "tuple id" in entries[2]["detail"]


async def test_cli_actions_refused_by_what_the_servers_hold_are_recorded_refused(
    config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands that act themselves (dlq, target) record a refusal as the leaser does."""
    bo = ("--as", "bo", "--why", "retry it")

    assert await _cli(config, "dlq", "replay", "999", *bo) != 0  # no such dead letter

    entries = await _audit(config, capsys)
    assert [(e["action"], e["who"], e["what"], e["why"], e["outcome"]) for e in entries] == [
        ("dlq.replay", "bo", "dead letter 999", "retry it", "refused"),
    ]
    assert "999" in entries[0]["detail"]


async def test_with_the_audit_stream_gone_the_escape_hatch_acts_and_says_what_it_did(
    settings: Settings, nc: NatsClient, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An audit outage refuses nothing, and the operator is told both that the action
    was done and that its entry is missing (not one in place of the other)."""
    await nc.jetstream().delete_stream(subjects.STREAM_AUDIT)
    ana = ("--as", "ana", "--why", "incident 8")

    capsys.readouterr()
    assert await _cli(config, "pause", "--target", "demo", *ana) == 0
    paused = capsys.readouterr()
    assert "target demo" in paused.out, paused
    assert "audit entry could not be written" in paused.err, paused
    refusal = await refused(LeaseClient(nc), ask(order_for(settings, "/page/1")))
    assert refusal.reason == "paused", refusal

    quarantine = ("quarantine", "set", "--identity", "id-1", "--target", "demo")
    assert await _cli(config, *quarantine, *ana) == 0
    quarantined = capsys.readouterr()
    assert quarantined.out.startswith("quarantined; revoked"), quarantined
    assert "audit entry could not be written" in quarantined.err, quarantined

    release = ("quarantine", "release", "--identity", "id-1", "--target", "demo")
    assert await _cli(config, *release, *ana) == 0
    released = capsys.readouterr()
    assert released.out.strip() == "released", released
    assert "audit entry could not be written" in released.err, released

    assert await _cli(config, "resume", "--target", "demo", *ana) == 0
    resumed = capsys.readouterr()
    assert resumed.out.startswith("resumed"), resumed
    assert "audit entry could not be written" in resumed.err, resumed
