"""The approved version set, the tuples leasers saw lately and the withdrawn ones, read
from ``jf-control`` (docs/versions.md): for the leaser's ``versions list``, the rollout
guard, and operators through ``jetfleet.ops.version_view``.

When a tuple was approved, seen or withdrawn is the stored timestamp of its KV entry:
the NATS server's clock, never a time written in a payload.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from jetfleet import subjects
from jetfleet.schemas.versions import (
    ApprovedShown,
    GuardState,
    SeenShown,
    VersionApproval,
    VersionSighting,
    VersionView,
    VersionWithdrawal,
    WithdrawnShown,
)
from jetfleet.server_clock import ServerClock
from jetfleet.stream_reader import read_stream

T = TypeVar("T")
CONTROL_STREAM = f"KV_{subjects.BUCKET_CONTROL}"
_approval = msgspec.json.Decoder(VersionApproval)
_sighting = msgspec.json.Decoder(VersionSighting)
_withdrawal = msgspec.json.Decoder(VersionWithdrawal)


async def version_view(js: JetStreamContext, gate: str = "") -> VersionView:
    """Every approved tuple (oldest approval first: the first is the incumbent), every
    tuple seen within the sightings' TTL (newest first) and every withdrawal with why.

    Args:
        js: a JetStream context of the fleet's NATS.
        gate: the ``versions.gate`` to show (the answering leaser's).
    """
    approved, seen, withdrawn = await asyncio.gather(
        _decoded(js, subjects.VERSION_APPROVED_PREFIX, _approval.decode),
        _decoded(js, subjects.VERSION_SEEN_PREFIX, _sighting.decode),
        _decoded(js, subjects.VERSION_WITHDRAWN_PREFIX, _withdrawal.decode),
    )
    approved.sort(key=lambda e: e[2])
    now = await ServerClock(js._nc, CONTROL_STREAM).now() if approved or seen or withdrawn else None
    now_s = None if now is None else now.timestamp()
    approved_ids = {e[0] for e in approved}
    return VersionView(
        approved=[
            ApprovedShown(
                id=tid,
                versions=rec.versions,
                by=rec.by,
                why=rec.why,
                age_s=_age(now_s, at),
                incumbent=n == 0,
            )
            for n, (tid, rec, at) in enumerate(approved)
        ],
        seen=[
            SeenShown(
                id=tid,
                versions=rec.versions,
                worker=rec.worker,
                age_s=_age(now_s, at),
                approved=tid in approved_ids,
            )
            for tid, rec, at in sorted(seen, key=lambda e: -e[2])
        ],
        withdrawn=[
            WithdrawnShown(
                id=tid, by=rec.by, why=rec.why, age_s=_age(now_s, at), figures=rec.figures
            )
            for tid, rec, at in sorted(withdrawn, key=lambda e: -e[2])
            if tid not in approved_ids
        ],
        guard=await guard_state(js),
        gate=gate,
    )


async def approved_tuples(js: JetStreamContext) -> list[tuple[str, float]]:
    """(tuple id, approved at: the server's timestamp in seconds) of every approved
    tuple, oldest approval first: the first is the incumbent."""
    found = await _with_ids(js, subjects.VERSION_APPROVED_PREFIX)
    return sorted(((tid, stored) for _, tid, stored in found), key=lambda e: e[1])


async def stored_ids(js: JetStreamContext, prefix: str) -> list[str]:
    """The tuple ids with a live key under ``prefix`` (``version-approved``,
    ``version-withdrawn``), read from the bucket's stream: ``kv.keys()`` may return
    partial results under concurrent writes (nats.py issue 842)."""
    return [tid for _, tid, _ in await _with_ids(js, prefix)]


async def guard_state(js: JetStreamContext) -> GuardState:
    """The rollout guard's fleet-wide switch: off only once an operator turned it off."""
    control = await js.key_value(subjects.BUCKET_CONTROL)
    try:
        entry = await control.get(subjects.VERSION_GUARD_KEY)
    except KeyNotFoundError:
        return "on"
    return "off" if entry.value == b"off" else "on"


async def _decoded(
    js: JetStreamContext, prefix: str, decode: Callable[[bytes], T]
) -> list[tuple[str, T, float]]:
    """(tuple id, record, stored at) of each live key under ``prefix`` that decodes (one
    written by hand, or by another version, is left out: a listing answers whatever)."""
    found = []
    for data, subject, stored in await _with_ids(js, prefix):
        try:
            found.append((subject, decode(data), stored))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    return found


async def _with_ids(js: JetStreamContext, prefix: str) -> list[tuple[bytes, str, float]]:
    """(value, tuple id, stored at) of each live key under ``prefix``."""
    latest: dict[str, tuple[bytes, str, float]] = {}
    async for msg in read_stream(js, CONTROL_STREAM, f"$KV.{subjects.BUCKET_CONTROL}.{prefix}.>"):
        tid = msg.subject.rsplit(".", 1)[-1]
        if not msg.data or (msg.headers or {}).get("KV-Operation"):
            latest.pop(tid, None)  # deleted or purged
        else:
            latest[tid] = (msg.data, tid, msg.metadata.timestamp.timestamp())
    return list(latest.values())


def _age(now_s: float | None, stored_s: float) -> float:
    return -1.0 if now_s is None else round(max(0.0, now_s - stored_s), 1)
