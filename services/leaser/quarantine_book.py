"""Quarantine records for (worker or identity, target) scopes, in ``jf-control``."""

from __future__ import annotations

import base64
import logging
import re

import msgspec
from jetfleet.schemas.lease import QuarantineRecord, QuarantineScope
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.kv_watch import KeyWatch
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

    async def put(self, record: QuarantineRecord) -> None:
        """Quarantine a scope (with the server-side TTL ``for_s`` when it is set)."""
        key = record_key(record.scope, record.name, record.target)
        payload = _encoder.encode(record)
        if record.for_s > 0:
            # A timed quarantine expires by the server's clock, like a lease.
            await self.control.purge(key)
            await self.control.create(key, payload, msg_ttl=ttl_whole_seconds(record.for_s))
        else:
            await self.control.put(key, payload)

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
