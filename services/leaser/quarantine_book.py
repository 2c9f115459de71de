"""Quarantine records for (worker or identity, target) scopes, in ``jf-control``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
from typing import Any

import msgspec
from jetfleet.schemas.lease import QuarantineRecord, QuarantineScope
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
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
        self._known: set[str] = set()
        self._watching: asyncio.Task[None] | None = None
        self._warned = False

    async def start(self) -> None:
        """Load the records in force and follow changes."""
        watcher = await self.control.watch(f"{PREFIX}.>")
        loaded = asyncio.get_running_loop().create_future()
        self._watching = asyncio.create_task(self._follow(watcher, loaded))
        await asyncio.wait_for(loaded, 10.0)

    async def stop(self) -> None:
        """Stop following changes."""
        watching, self._watching = self._watching, None
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    def _following(self) -> bool:
        """Whether the watch is alive. If it died, every ask is read from KV: slower, but
        a quarantine set since must not be missed (the book fails closed, not open)."""
        if self._watching is None or not self._watching.done():
            return self._watching is not None
        if not self._warned:
            self._warned = True
            log.error("quarantine watch stopped; reading every quarantine check from KV")
        return False

    async def _follow(self, watcher: Any, loaded: asyncio.Future[None]) -> None:
        async for entry in watcher:
            if entry is None:  # the end of the records that existed when we started
                if not loaded.done():
                    loaded.set_result(None)
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._known.discard(entry.key)
            else:
                self._known.add(entry.key)

    async def get(self, scope: QuarantineScope, name: str, target: str) -> QuarantineRecord | None:
        """The record for this scope on ``target``, if it is quarantined."""
        if not name:
            return None
        key = record_key(scope, name, target)
        if self._following() and key not in self._known:
            return None
        try:
            entry = await self.control.get(key)
        except KeyNotFoundError:
            self._known.discard(key)
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
