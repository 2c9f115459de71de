"""The runbook states what the code does. Its dedupe TTL is how long a committed key is
really remembered: the result record is the key, and the results stream keeps it
max(retention_s, dedupe_ttl_s), so with a longer retention a resubmission is still
suppressed past ``dedupe_ttl_s``. Its lease contract says what a worker does."""

from __future__ import annotations

import msgspec

from jetfleet.ops.runbook import dedupe_section, lease_section
from jetfleet.settings import Settings


async def test_the_dedupe_ttl_stated_is_how_long_the_key_is_kept(settings: Settings) -> None:
    fleet = msgspec.structs.replace(
        settings.fleet, dedupe_ttl_s=settings.fleet.dedupe_ttl_s, retention_s=9_000_000.0
    )
    longer = msgspec.structs.replace(settings, fleet=fleet)
    section = await dedupe_section(longer, None)
    ttl_line = next(line for line in section.lines if line.startswith("- TTL:"))
    assert ttl_line.startswith("- TTL: **9e+06 s**"), ttl_line
    assert "`fleet.dedupe_ttl_s`" in ttl_line and "`fleet.retention_s`" in ttl_line
    assert section.facts["key_kept_s"] == 9_000_000.0
    assert section.facts["dedupe_ttl_s"] == fleet.dedupe_ttl_s


def test_the_lease_contract_says_what_a_worker_does_when_renewal_fails(
    settings: Settings,
) -> None:
    """What the worker does (jetfleet/worker/runtime.py ``_keep_lease``): cancel the
    handler, keep nothing of the attempt, never ack, nak or term. Its identity's cookie
    jar is the identity's, shared by its jobs, and is not rolled back, so the runbook
    must not promise a discard the code does not do."""
    section = lease_section(settings)
    text = "\n".join(section.lines)
    assert "discards the identity state" not in text
    assert "cancels the handler" in text and "not rolled back" in text, text
    assert section.facts["on_renewal_failure"] == [
        "stop (cancel the handler)",
        "keep nothing of the attempt",
        "do not ack, nak or term",
    ]
