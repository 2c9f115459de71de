"""``jetfleet runbook`` (issue 11): the five things a fleet runbook states, from the live
configuration. Two configurations give two runbooks that differ where they should, and
the JSON says the same as the Markdown. Real NATS for what the servers say."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from jetfleet.cli.main import main
from jetfleet.dev.settings_file import settings_toml
from jetfleet.settings import QuarantineRule, QuarantineSettings, Settings
from jetfleet.topology import results_max_age

pytestmark = pytest.mark.timeout(60)


def _changed(settings: Settings) -> Settings:
    """Another lease TTL and ack_wait, one quarantine rule, the breaker off."""
    fleet = msgspec.structs.replace(settings.fleet, lease_ttl_s=12.0, ack_wait_s=20.0)
    rule = QuarantineRule(
        name="cool-fast",
        on="challenged",
        scope="worker",
        count=5,
        window_s=120.0,
        action="cool",
        for_s=30.0,
    )
    breaker = msgspec.structs.replace(settings.quarantine.breaker, enabled=False)
    quarantine = QuarantineSettings(rules=(rule,), breaker=breaker)
    return msgspec.structs.replace(settings, fleet=fleet, quarantine=quarantine)


async def _runbook(
    settings: Settings, path: Path, capsys: pytest.CaptureFixture[str], *argv: str
) -> str:
    await asyncio.to_thread(path.write_text, settings_toml(settings))
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["--config", str(path), "runbook", *argv]) == 0
    return capsys.readouterr().out


async def test_the_runbook_follows_a_changed_config(
    settings: Settings, nc: NatsClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    changed = _changed(settings)
    before = await _runbook(settings, tmp_path / "a.toml", capsys)
    after = await _runbook(changed, tmp_path / "b.toml", capsys)

    for text in (before, after):  # the five sections, each time
        for title in (
            "Lease contract",
            "Dedupe keys",
            "Quarantine triggers",
            "Versions",
            "Escape hatch",
        ):
            assert f"## {title}" in text
        assert "does not ack" in text and "jetfleet pause" in text and "operator" in text
    assert "Lease TTL: **3 s**" in before and "every **1 s**" in before
    assert "Lease TTL: **12 s**" in after and "every **4 s**" in after
    assert "`retire-after-3-refusals`" in before and "cool-fast" not in before
    assert "`cool-fast`: 5 outcome(s) challenged from one worker" in after
    assert "retire-after-3-refusals" not in after
    assert "Circuit breaker:" in before and "Circuit breaker:" not in after
    # What the server says: the results stream's max age, as topology declared it.
    assert f"max_age {results_max_age(settings):g} s" in before

    facts: dict[str, Any] = json.loads(
        await _runbook(changed, tmp_path / "b.toml", capsys, "--json")
    )
    assert set(facts) == {"lease", "dedupe", "quarantine", "versions", "escape_hatch"}
    assert facts["lease"]["lease_ttl_s"] == 12.0 and facts["lease"]["renew_every_s"] == 4.0
    assert [r["name"] for r in facts["quarantine"]["rules"]] == ["cool-fast"]
    assert facts["quarantine"]["breaker"]["enabled"] is False
    assert facts["dedupe"]["check_holds"] is True
    assert facts["dedupe"]["needed_s"] == facts["dedupe"]["retry_horizon_s"] + 20.0
    assert set(facts["dedupe"]["handlers"]) == {"http.get", "noop", "browser.page"}
    assert facts["escape_hatch"]["role"] == "operator"
