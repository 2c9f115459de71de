"""The audit log (issue 11): every control action of a scripted incident is recorded
by the service or command that executed it, with who, what and why, and `jetfleet
audit` lists them in order with the server's times. Real leaser, real NATS."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
from pathlib import Path

import pytest
from jetfleet.schemas.breaker import BreakerOpen, BreakerRecord
from nats.aio.client import Client as NatsClient

from jetfleet.audit import read_actions, record_action
from jetfleet.cli.actor import actor
from jetfleet.cli.audit_command import parse_since
from jetfleet.cli.breaker_commands import send_breaker
from jetfleet.cli.main import build_parser, main
from jetfleet.dev.settings_file import settings_toml
from jetfleet.errors import JetfleetError
from jetfleet.lease_client import LeaseClient
from jetfleet.ops.dead_letters import list_dead_letters
from jetfleet.settings import Settings
from tests.leasing import grant_fence, order_for, report_failure
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)


def _config(settings: Settings, tmp_path: Path) -> str:
    path = tmp_path / "jetfleet.toml"
    path.write_text(settings_toml(settings))
    return str(path)


async def _cli(config: str, *argv: str) -> int:
    """``jetfleet --config CONFIG ARGV``, in a thread (the CLI runs its own event loop)."""
    return await asyncio.to_thread(main, ["--config", config, *argv])


async def _audit_json(
    capsys: pytest.CaptureFixture[str], config: str, *argv: str
) -> list[dict[str, str]]:
    capsys.readouterr()
    assert await _cli(config, "audit", "--json", *argv) == 0
    entries: list[dict[str, str]] = json.loads(capsys.readouterr().out)
    return entries


async def _dead_letter_one(settings: Settings, nc: NatsClient) -> int:
    order = order_for(settings, "/page/dead")
    fence = await grant_fence(LeaseClient(nc), order, "w-a")
    assert (await report_failure(nc, order, fence, "w-a")).status == "dead-lettered"
    [letter] = await list_dead_letters(nc.jetstream(), "demo", None)
    return letter.id


async def test_the_audit_lists_every_action_of_a_scripted_incident_in_order(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _config(settings, tmp_path)
    letter = await _dead_letter_one(settings, nc)
    ana = ("--as", "ana")

    # The incident: blocks on demo; an identity quarantined, the breaker opens (a rule),
    # an operator closes it, slows the target, replays and purges the dead letter, tries
    # to approve a proposal that does not exist, then undoes the quarantine and the rate.
    quarantine = ("quarantine", "set", "--identity", "id-1", "--target", "demo")
    assert await _cli(config, *quarantine, *ana, "--why", "blocks on demo") == 0
    record = BreakerRecord(target="demo", cool_s=60.0, reason="3 identities", opened_by="breaker")
    assert (await send_breaker(settings, BreakerOpen(record=record))).ok
    assert await _cli(config, "breaker", "close", "--target", "demo", *ana, "--why", "fixed") == 0
    first_half_done = datetime.datetime.now(datetime.UTC)
    assert await _cli(config, "target", "set", "demo", "--rate", "2/s", "--as", "bo") == 0
    assert await _cli(config, "dlq", "replay", str(letter), "--as", "bo", "--why", "retry") == 0
    assert await _cli(config, "dlq", "purge", "--yes", *ana, "--why", "clean up") == 0
    assert await _cli(config, "quarantine", "approve", "0123456789abcdef", *ana) != 0
    release = ("quarantine", "release", "--identity", "id-1", "--target", "demo")
    assert await _cli(config, *release, *ana, "--why", "over") == 0
    assert await _cli(config, "target", "unset", "demo", "--as", "bo") == 0

    entries = await _audit_json(capsys, config)
    assert [(e["action"], e["who"], e["outcome"]) for e in entries] == [
        ("quarantine.set", "ana", "done"),
        ("breaker.open", "breaker", "done"),
        ("breaker.close", "ana", "done"),
        ("target.set", "bo", "done"),
        ("dlq.replay", "bo", "done"),
        ("dlq.purge", "ana", "done"),
        ("quarantine.approve", "ana", "refused"),
        ("quarantine.release", "ana", "done"),
        ("target.unset", "bo", "done"),
    ]
    by_action = {e["action"]: e for e in entries}
    assert by_action["quarantine.set"]["what"] == "identity id-1 on demo until released"
    assert by_action["quarantine.set"]["why"] == "blocks on demo"
    assert by_action["breaker.close"]["why"] == "fixed"
    assert by_action["target.set"]["what"] == "target demo: rate 2/s"
    assert by_action["dlq.replay"]["what"] == f"dead letter {letter}"
    assert by_action["dlq.replay"]["detail"].startswith("replayed 1 letter(s) as ")
    assert by_action["dlq.purge"]["detail"] == "removed 1 letter(s)"
    assert "no egress proposal" in by_action["quarantine.approve"]["detail"]
    times = [datetime.datetime.fromisoformat(e["at"]) for e in entries]
    assert times == sorted(times)
    seqs = [int(e["seq"]) for e in entries]
    assert seqs == sorted(seqs)

    # --since by an ISO time: the entries the server stored from then on (one loopback
    # host: its clock and the server's are the same clock).
    since = await _audit_json(capsys, config, "--since", first_half_done.isoformat())
    assert since[0]["action"] == "target.set"
    assert len(since) == 6
    recent = await _audit_json(capsys, config, "--since", "1h")
    assert len(recent) == len(entries)

    # The text listing shows the same entries, with the server's times.
    capsys.readouterr()
    assert await _cli(config, "audit") == 0
    text = capsys.readouterr().out
    assert "quarantine.set" in text and "blocks on demo" in text and "target.unset" in text


async def test_an_audit_entry_that_cannot_be_written_is_logged_loudly_and_fails_nothing(
    nc: NatsClient, caplog: pytest.LogCaptureFixture
) -> None:
    js = nc.jetstream()
    with caplog.at_level(logging.ERROR, logger="jetfleet.audit"):
        assert await record_action(js, "Not An Action", "ana", "target demo", "why") is False
    assert "AUDIT NOT WRITTEN" in caplog.text and "who=ana" in caplog.text
    assert [r async for r in read_actions(js, None)] == []
    assert await record_action(js, "pause", "ana", "fleet", "incident 7") is True
    [written] = [r async for r in read_actions(js, None)]
    assert (written.entry.action, written.entry.who, written.entry.why) == (
        "pause",
        "ana",
        "incident 7",
    )


def test_who_defaults_to_the_os_user_and_since_reads_durations_and_times() -> None:
    parser = build_parser()
    args = parser.parse_args(["breaker", "close", "--target", "demo"])
    assert actor(args) and actor(args) != "operator"
    named = parser.parse_args(["breaker", "close", "--target", "demo", "--as", "ana"])
    assert actor(named) == "ana"
    now = datetime.datetime(2026, 12, 1, 20, 0, tzinfo=datetime.UTC)
    assert parse_since("90m", now) == now - datetime.timedelta(minutes=90)
    assert parse_since("2026-12-01T19:00:00Z", now) == now - datetime.timedelta(hours=1)
    assert parse_since("2026-12-01T19:00:00", now).tzinfo == datetime.UTC
    with pytest.raises(JetfleetError, match="duration"):
        parse_since("yesterday", now)
