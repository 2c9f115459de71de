"""The quarantine records in force and the egress proposals, read from ``jf-control``
with how long each has left by the NATS server's clock, for ``jetfleet status`` and
``jetfleet quarantine list`` (docs/quarantine.md).

A record's ``for_s`` runs from when the leaser stored it; a proposal's TTL from when the
service (or the operator's reject) wrote it. Both are the server's per-key TTL, so time
left is the TTL less the age of the stored message: the server's now less its stored
timestamp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.quarantine_proposals import PREFIX as PROPOSAL_PREFIX
from jetfleet.quarantine_proposals import decode_proposal
from jetfleet.schemas.lease import QuarantineProposal, QuarantineRecord
from jetfleet.server_clock import ServerClock
from jetfleet.stream_reader import read_stream

CONTROL_STREAM = f"KV_{subjects.BUCKET_CONTROL}"
RECORD_PREFIX = "quarantine"
_record_decoder = msgspec.json.Decoder(QuarantineRecord)
T = TypeVar("T")


class RecordShown(QuarantineRecord, frozen=True):
    """A quarantine record in force, with its age and time left."""

    age_s: float | None = None
    """Seconds since the leaser stored it, by the server's clock (None: unknown)."""
    left_s: float | None = None
    """Seconds until it lapses (None: it lasts until released, or the age is unknown)."""


class ProposalShown(QuarantineProposal, frozen=True):
    """An egress proposal (pending or rejected), with its age and time left."""

    age_s: float | None = None
    left_s: float | None = None
    """Seconds until it lapses unanswered (a rejected one: until it is no longer shown)."""


class QuarantineView(msgspec.Struct):
    """What ``jf-control`` holds of quarantines right now."""

    records: list[RecordShown] = msgspec.field(default_factory=list)
    proposals: list[ProposalShown] = msgspec.field(default_factory=list)
    second_order: int = 0
    """Records in force that are second-order retirements (``second_order_of`` set)."""


def _ttl_s(headers: dict[str, str] | None) -> float | None:
    """The message's per-key TTL in seconds, from its ``Nats-TTL`` header."""
    text = (headers or {}).get("Nats-TTL", "").strip().removesuffix("s")
    return float(text) if text.isdigit() else None


async def _latest(js: JetStreamContext, prefix: str) -> list[tuple[bytes, float | None, float]]:
    """(value, TTL, stored at) of each live key under ``prefix``."""
    latest: dict[str, tuple[bytes, float | None, float]] = {}
    filter_ = f"$KV.{subjects.BUCKET_CONTROL}.{prefix}.>"
    async for msg in read_stream(js, CONTROL_STREAM, filter_):
        if not msg.data or (msg.headers or {}).get("KV-Operation"):
            latest.pop(msg.subject, None)
            continue
        stored = msg.metadata.timestamp.timestamp()
        latest[msg.subject] = (msg.data, _ttl_s(msg.headers), stored)
    return list(latest.values())


def _decoded(
    decode: Callable[[bytes], T], entries: list[tuple[bytes, float | None, float]]
) -> Iterator[tuple[T, float | None, float]]:
    """The entries that decode. One that does not (written by hand, or by a version that
    spelled it otherwise) is left out: status must answer whatever a key holds."""
    for data, ttl_s, stored_s in entries:
        try:
            yield decode(data), ttl_s, stored_s
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue


async def read_quarantines(js: JetStreamContext) -> QuarantineView:
    """Every record in force and every proposal, oldest first, with time left."""
    found = await asyncio.gather(_latest(js, RECORD_PREFIX), _latest(js, PROPOSAL_PREFIX))
    records, proposals = (sorted(entries, key=lambda e: e[2]) for entries in found)
    view = QuarantineView()
    if not records and not proposals:
        return view  # the usual answer: no round trip for the server's time
    # nats-py's JetStreamContext has no public getter for its connection; the clock needs
    # it to read the server's time.
    now = await ServerClock(js._nc, CONTROL_STREAM).now()
    now_s = None if now is None else now.timestamp()

    def timing(ttl_s: float | None, stored_s: float) -> tuple[float | None, float | None]:
        if now_s is None:
            return None, None
        age_s = max(0.0, now_s - stored_s)
        return round(age_s, 1), None if ttl_s is None else round(max(0.0, ttl_s - age_s), 1)

    for record, ttl_s, stored_s in _decoded(_record_decoder.decode, records):
        age_s, left_s = timing(ttl_s or (record.for_s or None), stored_s)
        view.records.append(
            RecordShown(**msgspec.structs.asdict(record), age_s=age_s, left_s=left_s)
        )
    for proposal, ttl_s, stored_s in _decoded(decode_proposal, proposals):
        age_s, left_s = timing(ttl_s, stored_s)
        view.proposals.append(
            ProposalShown(**msgspec.structs.asdict(proposal), age_s=age_s, left_s=left_s)
        )
    view.second_order = sum(1 for r in view.records if r.second_order_of)
    return view
