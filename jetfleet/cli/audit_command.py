"""``jetfleet audit``: the control actions recorded in ``JF_AUDIT``, oldest first, with
the server's time of each (docs/audit.md)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import re
from typing import Any

from jetfleet import subjects
from jetfleet.audit import AuditRecord, read_actions
from jetfleet.cli.progress import print_json, print_table
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(commands: Any) -> None:
    """Add ``audit`` to the parser."""
    parser = commands.add_parser(
        "audit",
        help="list the recorded control actions (who, what, when, why)",
        description="Every control action (quarantine, release, approve, reject, breaker "
        "open and close, target change, dead-letter replay and purge, pause, resume, "
        "version approve and revoke, the rollout guard switch) as recorded by the service "
        "or command that executed it, oldest first. Times are the NATS server's, from when "
        "it stored the entry.",
    )
    parser.add_argument(
        "--since",
        default=None,
        help="only entries from this long ago (30m, 1h, 2d: by the server's clock) or "
        "from this time (ISO 8601, e.g. 2026-12-01T20:00:00Z)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.set_defaults(run=_run)


def parse_since(text: str, now: datetime.datetime) -> datetime.datetime:
    """``--since``: a duration back from ``now`` or an ISO 8601 time (UTC if no zone)."""
    relative = _RELATIVE.match(text.strip())
    if relative:
        return now - datetime.timedelta(seconds=float(relative[1]) * _UNIT_S[relative[2]])
    try:
        when = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise JetfleetError(
            f"--since {text!r}: give a duration (30m, 1h, 2d) or an ISO 8601 time "
            "(2026-12-01T20:00:00Z)"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=datetime.UTC)


async def audit_records(settings: Settings, since: str | None) -> list[AuditRecord]:
    """The recorded actions, oldest first (from ``since``, judged by the server's clock)."""
    nc = await connect_nats(settings.nats, "jetfleet-audit", role="operator")
    try:
        js = nc.jetstream()
        start = None
        if since is not None:
            now = await ServerClock(nc, subjects.STREAM_AUDIT).now()
            start = parse_since(since, now or datetime.datetime.now(datetime.UTC))
        return [record async for record in read_actions(js, start)]
    finally:
        await nc.close()


def record_json(record: AuditRecord) -> dict[str, object]:
    """One entry as ``--json`` prints it: the entry's fields, its server time and seq."""
    entry = record.entry
    return {
        "at": record.at.isoformat().replace("+00:00", "Z"),
        "seq": record.seq,
        "action": entry.action,
        "who": entry.who,
        "what": entry.what,
        "why": entry.why,
        "outcome": entry.outcome,
        "detail": entry.detail,
    }


def _run(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    records = asyncio.run(audit_records(settings_from(args), args.since))
    if args.json:
        print_json([record_json(r) for r in records])
        return 0
    if not records:
        print("no control actions recorded" + (f" since {args.since}" if args.since else ""))
        return 0
    print_table(
        ["when (server)", "action", "who", "what", "why", "outcome", "detail"],
        [
            [
                r.at.strftime("%Y-%m-%d %H:%M:%S"),
                r.entry.action,
                r.entry.who,
                r.entry.what,
                r.entry.why or "-",
                r.entry.outcome,
                r.entry.detail or "-",
            ]
            for r in records
        ],
    )
    return 0
