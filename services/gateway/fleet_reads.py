"""The JSON documents behind the dashboard's tables and chart (docs/dashboard.md).

Each is built from the ops modules the CLI prints from (target limits, breakers,
presence, versions, dead letters) plus the gateway's outcome tallies
(``outcome_series.py``), so a number on the page is the number the CLI shows.
"""

from __future__ import annotations

from typing import Any

from jetfleet.services.gateway.outcome_series import (
    BUCKET_S,
    BUCKETS,
    RATE_WINDOW_S,
    OutcomeSeries,
    Row,
)
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.cli.dlq_commands import entry_json
from jetfleet.identity_presence import IdentityPresence
from jetfleet.ops.breaker_status import open_breakers
from jetfleet.ops.dead_letters import DeadLetterEntry, dead_letter_total, list_dead_letters
from jetfleet.ops.target_view import target_listing
from jetfleet.ops.version_view import version_view
from jetfleet.region_presence import regions_present
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings

MAX_LETTERS = 500
"""The most dead letters one answer lists (the newest); ``total`` counts them all."""
SCAN_LETTERS = 2000
"""The newest ``JF_DLQ`` messages one answer looks at (``scanned``; ``complete`` says
whether that was every letter kept)."""
DEFAULT_LETTERS = 100


async def targets_doc(
    js: JetStreamContext, settings: Settings, series: OutcomeSeries, clock: ServerClock
) -> dict[str, Any]:
    """Each declared target's cap (permits' rate, burst, daily budget and where each came
    from), its hold, its breaker and the rate it was sent lately."""
    listing = await target_listing(js, settings)
    breakers = {b.record.target: b.state for b in await open_breakers(js)}
    now = await clock.now()
    rates = series.rates(now.timestamp()) if now is not None else {}
    return {
        "rate_window_s": RATE_WINDOW_S,
        "redis": listing.redis,
        "targets": [
            {
                "target": view.target,
                "rate_cap": view.rate,
                "rate_from": view.rate_from,
                "burst": view.burst,
                "daily": view.daily,
                "max_in_flight": view.max_in_flight,
                "held_s": view.held_s,
                "breaker": breakers.get(view.target, "closed"),
                "rate_now": rates.get(view.target, 0.0),
            }
            for view in listing.targets
        ],
    }


def _row_json(row: Row, now_s: float | None) -> dict[str, Any]:
    return {
        "name": row.name,
        "ok": row.ok,
        "blocked": row.blocked,
        "failed": row.failed,
        "seen_s_ago": None if now_s is None else round(max(0.0, now_s - row.last_s), 1),
    }


async def _owners(js: JetStreamContext) -> list[tuple[str, str]]:
    return await IdentityPresence(js).owners()


async def actors_doc(
    js: JetStreamContext, series: OutcomeSeries, clock: ServerClock
) -> dict[str, Any]:
    """Per worker and per identity: outcomes over the tallies' window, and the identity
    claims live in ``jf-workers`` (who holds which identity now); and the regions some
    running worker announces."""
    now = await clock.now()
    now_s = None if now is None else now.timestamp()
    owners = await _owners(js)
    held_by: dict[str, list[str]] = {}
    for identity, worker in owners:
        held_by.setdefault(worker, []).append(identity)
    owner_of = dict(owners)
    # No server clock answer: the newest event's time stands in to bound the window.
    window_end = series.newest_s if now_s is None else now_s
    workers = {row.name: _row_json(row, now_s) for row in series.rows("worker", window_end)}
    for worker in held_by:
        workers.setdefault(worker, _row_json(Row(worker, 0, 0, 0, 0.0), None))
    identities = {row.name: _row_json(row, now_s) for row in series.rows("identity", window_end)}
    for identity in owner_of:
        identities.setdefault(identity, _row_json(Row(identity, 0, 0, 0, 0.0), None))
    for name, doc in workers.items():
        doc["identities"] = sorted(held_by.get(name, []))
    for name, doc in identities.items():
        doc["owner"] = owner_of.get(name, "")
    return {
        "window_s": BUCKET_S * BUCKETS,
        "workers": [workers[k] for k in sorted(workers)],
        "identities": [identities[k] for k in sorted(identities)],
        "regions": await regions_present(js),
    }


async def versions_doc(
    js: JetStreamContext, series: OutcomeSeries, clock: ServerClock
) -> dict[str, Any]:
    """Per version tuple id: its success rate per bucket, and whether it is approved."""
    view = await version_view(js)
    approved = {a.id for a in view.approved}
    incumbent = next((a.id for a in view.approved if a.incumbent), "")
    now = await clock.now()
    window_end = series.newest_s if now is None else now.timestamp()
    return {
        "bucket_s": BUCKET_S,
        "now_s": None if now is None else now.timestamp(),
        "guard": view.guard,
        "versions": [
            {
                "id": tid,
                "approved": tid in approved,
                "incumbent": tid == incumbent,
                "points": [{"t": p.t, "ok": p.ok, "total": p.total} for p in points],
            }
            for tid, points in series.series(window_end).items()
        ],
    }


async def dead_letters_doc(
    js: JetStreamContext, target: str | None, reason: str | None, limit: int
) -> dict[str, Any]:
    """The newest ``limit`` dead letters (of ``target``, with ``reason``) among the
    newest ``SCAN_LETTERS`` messages of ``JF_DLQ``, newest first, and how many there are
    in all.

    Every open dashboard asks for this every poll, so it reads a bounded tail of the
    stream, never every letter kept (``jetfleet dlq list`` does that)."""
    try:
        state = (await js.stream_info(subjects.STREAM_DLQ)).state
    except NotFoundError:
        return {"total": 0, "matched": 0, "scanned": 0, "complete": True, "letters": []}
    from_seq = max(state.first_seq, state.last_seq - SCAN_LETTERS + 1, 1)
    entries = await list_dead_letters(js, target, reason, from_seq=from_seq)
    total = state.messages if target is None else await dead_letter_total(js, target)
    newest = entries[::-1][:limit]
    return {
        "total": total,
        "matched": len(entries),
        "scanned": state.last_seq - from_seq + 1 if state.messages else 0,
        "complete": from_seq <= state.first_seq,
        "letters": [_letter_json(e) for e in newest],
    }


def _letter_json(entry: DeadLetterEntry) -> dict[str, Any]:
    # The dashboard shows no URL and no idempotency key: left out, they cannot leak
    # through an open read (a URL may carry a credential in its query string).
    doc = entry_json(entry)
    del doc["key"], doc["url"]
    return doc
