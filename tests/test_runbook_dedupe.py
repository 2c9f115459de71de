"""The runbook's dedupe TTL is how long a committed key is really remembered: the result
record is the key, and the results stream keeps it max(retention_s, dedupe_ttl_s), so
with a longer retention a resubmission is still suppressed past ``dedupe_ttl_s``."""

from __future__ import annotations

import msgspec

from jetfleet.ops.runbook import dedupe_section
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
