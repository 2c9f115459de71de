"""How presence is written: one small interface, two ways.

Identity claims, region presence, last hand-back notes and robots.txt records are KV
writes with the semantics the claim logic relies on: create if absent, compare-and-set
on the revision, put, compare-and-set delete, each with a per-key TTL judged by the
server. ``DirectPresenceWriter`` makes them itself (the leaser, and tests, have KV
rights); ``LeaserPresenceWriter`` asks the leaser on ``jf.presence`` to make them (a
worker has no KV rights: docs/identities.md#who-writes-what). Both raise
``WrongRevision`` when a compare-and-set loses, and anything else (``PresenceRefused``,
a timeout, no responders, a closed connection) when the write did not surely happen: a
write whose answer was lost may still have landed, as with a KV write whose ack was lost.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.errors import PresenceRefused, WrongRevision
from jetfleet.js_errors import is_wrong_last_sequence
from jetfleet.leader_reads import leader_bucket
from jetfleet.schemas.presence import (
    PresenceCreate,
    PresenceDelete,
    PresencePut,
    PresenceReply,
    PresenceUpdate,
    PresenceWrite,
    PresenceWritten,
)

DEFAULT_TIMEOUT_S = 5.0
"""What a write waits for JetStream (or the leaser) when the caller names no timeout."""
LEASER_SHARE = 0.8
"""The share of a request's timeout the leaser may wait for JetStream, so a write that
timed out there is answered ``busy`` before the requester stops waiting (the requester's
own budget, a renewal's especially, stays what it was with a direct write)."""
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"


class PresenceWriter(Protocol):
    """KV writes of presence keys (schemas/presence.py says what each means)."""

    async def create(
        self, bucket: str, key: str, value: bytes, ttl_s: int = 0, timeout_s: float = 0.0
    ) -> int:
        """Write ``key`` if it holds nothing; its revision.

        Raises:
            WrongRevision: the key holds something (or moved while that was checked).
        """
        ...

    async def update(
        self,
        bucket: str,
        key: str,
        value: bytes,
        last: int,
        ttl_s: int = 0,
        timeout_s: float = 0.0,
    ) -> int:
        """Write ``key`` if its revision is still ``last``; the new revision.

        Raises:
            WrongRevision: the key moved (or lapsed) since ``last``.
        """
        ...

    async def put(
        self, bucket: str, key: str, value: bytes, ttl_s: int = 0, timeout_s: float = 0.0
    ) -> int:
        """Write ``key`` whatever it holds; the new revision."""
        ...

    async def delete(self, bucket: str, key: str, last: int, timeout_s: float = 0.0) -> None:
        """Delete ``key`` if its revision is still ``last``.

        Raises:
            WrongRevision: the key moved since ``last``.
        """
        ...


class DirectPresenceWriter:
    """Writes presence with this connection's own KV rights (the leaser's, a test's)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._buckets: dict[str, KeyValue] = {}

    async def bucket(self, name: str) -> KeyValue:
        """The bucket ``name``, bound once, with every read answered by its leader."""
        if name not in self._buckets:
            self._buckets[name] = await leader_bucket(self.js, name)
        return self._buckets[name]

    async def create(
        self, bucket: str, key: str, value: bytes, ttl_s: int = 0, timeout_s: float = 0.0
    ) -> int:
        kv = await self.bucket(bucket)
        try:
            return await kv.create(key, value, msg_ttl=ttl_s or None)
        except (KeyWrongLastSequenceError, KeyNotFoundError) as exc:
            # (Not found: the key lapsed between nats-py's refused create and its read of
            # it; the caller reads the key and decides, as for a live one.)
            raise WrongRevision(f"{bucket} {key} holds something: not created") from exc

    async def update(
        self,
        bucket: str,
        key: str,
        value: bytes,
        last: int,
        ttl_s: int = 0,
        timeout_s: float = 0.0,
    ) -> int:
        # A publish, not kv.update: it carries a timeout of its own (a renewal waits for
        # its answer only as long as the claim can spare).
        try:
            ack = await self.js.publish(
                _kv_subject(bucket, key),
                value,
                timeout=timeout_s or DEFAULT_TIMEOUT_S,
                # A fresh dict each time: nats-py adds the TTL header to it.
                headers={_EXPECTED_LAST: str(last)},
                msg_ttl=ttl_s or None,
            )
        except APIError as exc:
            if is_wrong_last_sequence(exc):
                raise WrongRevision(f"{bucket} {key} moved since revision {last}") from exc
            raise
        return ack.seq

    async def put(
        self, bucket: str, key: str, value: bytes, ttl_s: int = 0, timeout_s: float = 0.0
    ) -> int:
        ack = await self.js.publish(
            _kv_subject(bucket, key),
            value,
            timeout=timeout_s or DEFAULT_TIMEOUT_S,
            msg_ttl=ttl_s or None,
        )
        return ack.seq

    async def delete(self, bucket: str, key: str, last: int, timeout_s: float = 0.0) -> None:
        kv = await self.bucket(bucket)
        try:
            await kv.delete(key, last=last)
        except (KeyWrongLastSequenceError, APIError) as exc:
            if isinstance(exc, KeyWrongLastSequenceError) or is_wrong_last_sequence(exc):
                raise WrongRevision(f"{bucket} {key} moved since revision {last}") from exc
            raise


class LeaserPresenceWriter:
    """Asks the leaser on ``jf.presence`` to write presence (a worker's way)."""

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc

    async def create(
        self, bucket: str, key: str, value: bytes, ttl_s: int = 0, timeout_s: float = 0.0
    ) -> int:
        return await self._ask(PresenceCreate(bucket, key, value, ttl_s), timeout_s)

    async def update(
        self,
        bucket: str,
        key: str,
        value: bytes,
        last: int,
        ttl_s: int = 0,
        timeout_s: float = 0.0,
    ) -> int:
        return await self._ask(PresenceUpdate(bucket, key, value, last, ttl_s), timeout_s)

    async def put(
        self, bucket: str, key: str, value: bytes, ttl_s: int = 0, timeout_s: float = 0.0
    ) -> int:
        return await self._ask(PresencePut(bucket, key, value, ttl_s), timeout_s)

    async def delete(self, bucket: str, key: str, last: int, timeout_s: float = 0.0) -> None:
        await self._ask(PresenceDelete(bucket, key, last), timeout_s)

    async def _ask(self, write: PresenceWrite, timeout_s: float) -> int:
        """The revision the leaser wrote, waiting at most ``timeout_s`` (0: the default).
        Raises as the module docstring says; nats-py's own errors (no responders, a
        timeout, a closed connection) pass through."""
        wait_s = timeout_s or DEFAULT_TIMEOUT_S
        write = msgspec.structs.replace(write, timeout_s=round(wait_s * LEASER_SHARE, 3))
        answer = await self.nc.request(subjects.PRESENCE, _encoder.encode(write), timeout=wait_s)
        try:
            reply = _decoder.decode(answer.data)
        except msgspec.MsgspecError as exc:
            raise PresenceRefused(f"the leaser's answer on {subjects.PRESENCE}: {exc}") from exc
        if isinstance(reply, PresenceWritten):
            return reply.revision
        if reply.reason == "wrong-revision":
            raise WrongRevision(reply.detail)
        raise PresenceRefused(f"the leaser refused the write ({reply.reason}): {reply.detail}")


def _kv_subject(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(PresenceReply)
