"""The circuit breakers ``jetfleet status`` shows: one line per target whose breaker is
open, probing or half-open, read from ``jf-control`` (durable state, like every status
count)."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError

from jetfleet import subjects
from jetfleet.breaker_book import BreakerBook
from jetfleet.schemas.breaker import BreakerView


async def open_breakers(js: JetStreamContext) -> list[BreakerView]:
    """Every breaker open, probing or half-open, by target."""
    try:
        control = await js.key_value(subjects.BUCKET_CONTROL)
    except BucketNotFoundError:
        return []
    return await BreakerBook(js, control).views()


def breaker_lines(breakers: list[BreakerView]) -> list[str]:
    """What ``jetfleet status`` prints for them (nothing when none is open)."""
    if not breakers:
        return []
    lines = [f"circuit breakers: {len(breakers)} (`jetfleet breaker list` for the reasons)"]
    width = max(len(b.record.target) for b in breakers)
    for view in breakers:
        record = view.record
        what = {
            "open": f"open, no grants for up to {record.cool_s:g} s, then one probe",
            "probing": "probing: one lease is the probe, its request's answer decides",
            "half-open": "half-open: the next grant is the probe",
        }[view.state]
        lines.append(
            f"  {record.target:<{width}}  {what} ({len(record.identities)} identities "
            f"refused; opened {record.opens} time(s) in a row)"
        )
    return lines
