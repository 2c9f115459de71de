"""Fired markers in ``jf-control``: the newest outcome event that fired a rule for one
scope, so neither a second replica nor a replay after a restart acts twice on the same
evidence (docs/quarantine.md#replicas-and-restarts).

A marker is claimed by compare-and-set on its revision before anything is sent, so it
only moves forward and of two replicas only the one whose claim lands acts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import msgspec
from jetfleet.schemas.lease import QuarantineFired
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.server_clock import ServerClock

CLAIM_ATTEMPTS = 5
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(QuarantineFired)


@dataclass
class Claim:
    """A fired marker this replica moved to its firing's newest evidence."""

    key: str
    revision: int
    previous: int | None
    """The marker's seq before (None: there was none), put back if the send fails."""


class FiredMarkers:
    """Claims and puts back fired markers; each lives ``ttl_s`` by the server's TTL."""

    def __init__(
        self, js: JetStreamContext, control: KeyValue, ttl_s: float, clock: ServerClock
    ) -> None:
        self.js = js
        self.control = control
        self.ttl_s = ttl_s
        self.clock = clock

    async def outlived(self, newest_at_s: float) -> bool:
        """Whether evidence whose newest event the server stored at ``newest_at_s`` is
        older than a marker lives, by the server's now: the marker it set (written after
        that event, so lapsing after ``newest_at_s + ttl_s``) may be gone, and a claim
        would not know it fired. Only a replica lagging by more than that meets such
        evidence (one that restarts reads from the longest window before now). False
        while the server's time cannot be read: the firing goes on as before."""
        now = await self.clock.now()
        return now is not None and newest_at_s <= now.timestamp() - self.ttl_s

    async def claim(self, key: str, oldest_seq: int, newest_seq: int) -> Claim | int:
        """Move marker ``key`` to ``newest_seq``, atomically; or the marker's seq if it
        already covers ``oldest_seq`` (the evidence fired before)."""
        for _ in range(CLAIM_ATTEMPTS):
            try:
                entry = await self.control.get(key)
                revision, value = entry.revision or 0, entry.value
            except KeyNotFoundError as exc:  # none, or deleted (its tombstone's revision)
                gone = getattr(exc, "entry", None)
                revision, value = (gone.revision or 0) if gone is not None else 0, b""
            previous = _decoder.decode(value).seq if value else None
            if previous is not None and previous >= oldest_seq:
                return previous
            try:
                mine = await self._write(key, newest_seq, revision)
            except KeyWrongLastSequenceError:
                continue  # another replica moved it meanwhile: read it again
            return Claim(key, mine, previous)
        raise RuntimeError(f"the fired marker {key} kept changing")

    async def unclaim(self, claim: Claim | None) -> None:
        """Put a claimed marker back as it was, so the firing is not taken as sent (a
        replay may act on it); unless another replica moved the marker on since."""
        if claim is None:
            return
        with contextlib.suppress(Exception):
            if claim.previous is None:
                await self.control.delete(claim.key, last=claim.revision)
            else:
                await self._write(claim.key, claim.previous, claim.revision)

    async def _write(self, key: str, seq: int, last: int) -> int:
        """Write a marker if its revision is still ``last`` (0: it does not exist), with
        the TTL every marker carries; its new revision."""
        subject = f"$KV.{subjects.BUCKET_CONTROL}.{key}"
        headers = {js_api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(last)}
        try:
            ack = await self.js.publish(
                subject,
                _encoder.encode(QuarantineFired(seq=seq)),
                headers=headers,
                msg_ttl=ttl_whole_seconds(self.ttl_s),
            )
        except APIError as err:
            if err.err_code in (10071, 10164):
                raise KeyWrongLastSequenceError from err
            raise
        return int(ack.seq)
