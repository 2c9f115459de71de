"""The pauses ``jetfleet status`` and ``jetfleet pause --list`` show, read from
``jf-control`` (durable state) and judged by the NATS server's clock (docs/pause.md)."""

from __future__ import annotations

from nats.aio.client import Client as NatsClient

from jetfleet.pause_book import SCOPES, read_pauses
from jetfleet.schemas.control import PauseView
from jetfleet.server_clock import ServerClock


async def pauses_in_force(nc: NatsClient) -> list[PauseView]:
    """Every pause in force now, widest scope first, with the seconds it has left."""
    now = await ServerClock(nc).now()
    entries = [e for e in await read_pauses(nc.jetstream()) if e.in_force(now)]
    entries.sort(key=lambda e: (SCOPES.index(e.record.scope), e.record.name))
    return [e.view(now) for e in entries]


def pause_lines(pauses: list[PauseView]) -> list[str]:
    """What ``jetfleet status`` prints for them (nothing when none is in force)."""
    if not pauses:
        return []
    lines = [f"pauses in force: {len(pauses)} (`jetfleet resume ...` ends one)"]
    for view in pauses:
        record = view.record
        what = "fleet" if record.scope == "fleet" else f"{record.scope} {record.name}"
        lasts = f"{view.left_s:.0f} s left" if record.for_s > 0 else "until resumed"
        why = f": {record.why}" if record.why else ""
        lines.append(f"  {what}  {lasts}, {record.mode}, by {record.by or 'unknown'}{why}")
    return lines
