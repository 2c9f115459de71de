"""Quarantine records for (worker or identity, target) scopes, in ``jf-control``."""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.schemas.lease import QuarantineRecord, QuarantineScope
from jetfleet.stream_reader import read_stream

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(QuarantineRecord)
PREFIX = "quarantine"


def record_key(scope: QuarantineScope, name: str, target: str) -> str:
    """The KV key of a scope's quarantine on a target."""
    return f"{PREFIX}.{target}.{scope}.{name}"


class QuarantineBook:
    """Reads and writes quarantine records."""

    def __init__(self, js: JetStreamContext, control: KeyValue) -> None:
        self.js = js
        self.control = control

    async def get(self, scope: QuarantineScope, name: str, target: str) -> QuarantineRecord | None:
        """The record for this scope on ``target``, if it is quarantined."""
        if not name:
            return None
        try:
            entry = await self.control.get(record_key(scope, name, target))
        except KeyNotFoundError:
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
