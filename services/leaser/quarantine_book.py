"""Quarantine records for (worker or identity, target) scopes, in ``jf-control``."""

from __future__ import annotations

import base64
import logging
import re
from dataclasses import dataclass

import msgspec
from jetfleet.schemas.lease import QuarantineRecord, QuarantineScope
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.js_errors import is_wrong_last_sequence
from jetfleet.kv_watch import KeyWatch
from jetfleet.leader_reads import last_message
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.stream_reader import read_stream

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(QuarantineRecord)
PREFIX = "quarantine"
_PLAIN = re.compile(r"[A-Za-z0-9_=-]{1,200}")


def record_key(scope: QuarantineScope, name: str, target: str) -> str:
    """The KV key of a scope's quarantine on a target.

    Worker ids and identities are free text; one that is not a plain KV key token
    (letters, digits, ``_ = -``) is spelled in base32 so any name can be quarantined.
    """
    token = (
        name
        if _PLAIN.fullmatch(name)
        else "b32-" + base64.b32encode(name.encode()).decode().rstrip("=").lower()
    )
    return f"{PREFIX}.{target}.{scope}.{token}"


@dataclass(frozen=True)
class BookEntry:
    """A record in force as its stream's leader stores it, to compare-and-set against."""

    record: QuarantineRecord
    revision: int
    stored_s: float
    """When the server stored it (its clock, epoch seconds): a timed record lapses
    ``ttl_whole_seconds(for_s)`` after this."""

    def left_s(self, now_s: float) -> float | None:
        """Seconds it has left at the server's ``now_s`` (None: lasts until released)."""
        if self.record.for_s <= 0:
            return None
        return self.stored_s + ttl_whole_seconds(self.record.for_s) - now_s


class QuarantineBook:
    """Reads and writes quarantine records.

    Every grant asks about two scopes, so the book follows the records with a KV watch
    instead of two KV reads per grant. Only a hit is confirmed with a read: a timed
    quarantine may have expired by the server's per-key TTL, which a watch does not see.
    """

    def __init__(self, js: JetStreamContext, control: KeyValue) -> None:
        self.js = js
        self.control = control
        self.watch = KeyWatch(control, f"{PREFIX}.>", "quarantine")

    async def start(self) -> None:
        """Load the records in force and follow changes."""
        await self.watch.start()

    async def stop(self) -> None:
        """Stop following changes."""
        await self.watch.stop()

    async def get(self, scope: QuarantineScope, name: str, target: str) -> QuarantineRecord | None:
        """The record for this scope on ``target``, if it is quarantined."""
        if not name:
            return None
        key = record_key(scope, name, target)
        if self.watch.following() and key not in self.watch.keys:
            return None
        try:
            entry = await self.control.get(key)
        except KeyNotFoundError:
            self.watch.keys.discard(key)
            return None
        return _decoder.decode(entry.value) if entry.value else None

    async def entry(self, scope: QuarantineScope, name: str, target: str) -> BookEntry | None:
        """The scope's record in force with its revision and stored time, read from the
        stream's leader (a command decides on it); None when there is none."""
        key = record_key(scope, name, target)
        msg = await last_message(
            self.js, f"KV_{subjects.BUCKET_CONTROL}", f"$KV.{subjects.BUCKET_CONTROL}.{key}"
        )
        if msg is None or not msg.data or (msg.headers or {}).get("KV-Operation"):
            return None  # never set, lapsed by its TTL, or released (a delete marker)
        assert msg.seq is not None and msg.time is not None
        return BookEntry(_decoder.decode(msg.data), msg.seq, msg.time.timestamp())

    async def put(self, record: QuarantineRecord, last: int) -> bool:
        """Quarantine a scope (with the server-side TTL ``for_s`` when it is set) if its
        key is still at revision ``last`` (0: no record in force); False if it moved.

        One write, a compare-and-set: the key is never absent between an old record and
        its replacement (a grant then would pass), and of two commands racing on one
        scope the second reads the first's record and decides again. nats-py's
        ``kv.update`` takes no TTL, so a replacement is a raw publish with
        ``Nats-Expected-Last-Subject-Sequence`` and ``Nats-TTL``, as a lease renewal is.
        """
        key = record_key(record.scope, record.name, record.target)
        payload = _encoder.encode(record)
        # A timed quarantine expires by the server's clock, like a lease; an untimed one
        # carries no TTL and lasts until released.
        ttl = ttl_whole_seconds(record.for_s) if record.for_s > 0 else None
        try:
            if not last:
                # create also recreates a key whose last message is a delete marker.
                await self.control.create(key, payload, msg_ttl=ttl)
            else:
                await self.js.publish(
                    f"$KV.{subjects.BUCKET_CONTROL}.{key}",
                    payload,
                    headers={"Nats-Expected-Last-Subject-Sequence": str(last)},
                    msg_ttl=ttl,
                )
        except KeyWrongLastSequenceError:
            return False
        except APIError as exc:
            if is_wrong_last_sequence(exc):
                return False
            raise
        return True

    async def remove(self, scope: QuarantineScope, name: str, target: str) -> None:
        """Lift a quarantine."""
        await self.control.delete(record_key(scope, name, target))

    async def all(self) -> list[QuarantineRecord]:
        """Every quarantine record in force."""
        records = []
        stream = f"KV_{subjects.BUCKET_CONTROL}"
        filter_ = f"$KV.{subjects.BUCKET_CONTROL}.{PREFIX}.>"
        async for msg in read_stream(self.js, stream, filter_):
            if msg.data and not (msg.headers or {}).get("KV-Operation"):
                records.append(_decoder.decode(msg.data))
        return records
