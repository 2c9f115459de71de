"""Serve ``jf.presence``: the KV writes a worker may have made for it, and no others.

A worker has no KV rights, yet it must claim its identity, say its
region runs, note why it handed a job back the last time, and share the robots.txt it
fetched. The leaser makes exactly those writes for it, with the semantics the worker's
code relies on (create if absent, compare-and-set on the revision, per-key TTL, delete),
and answers a lost compare-and-set as ``wrong-revision``, apart from every other refusal,
so the claim logic behaves as it does with a direct write (jetfleet/identity_presence.py).

Everything else is refused ``not-permitted`` before anything is written: another bucket
(leases, fences, control), another key family, an operation the family does not use
(a put over an identity claim would take it without compare-and-set), a TTL out of the
family's bounds (a claim or a presence without one would never lapse), or a value that
names another key than the one written (a claim of ``owned.<digest>`` must carry the
identity that hashes to it; a robots record must be of the declared target it is keyed
by). What the leaser cannot check is who asks: a worker that forges another's claim
token could still take its identity (docs/identities.md#who-writes-what).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import msgspec
from jetfleet.schemas.presence import (
    PresenceCreate,
    PresenceDelete,
    PresencePut,
    PresenceRefused,
    PresenceReply,
    PresenceUpdate,
    PresenceWrite,
    PresenceWritten,
)
from jetfleet.schemas.targets import RobotsRecord
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.errors import WrongRevision
from jetfleet.identity_presence import owned_key
from jetfleet.last_hand_back import NOTE_TTL_S
from jetfleet.presence_writer import DirectPresenceWriter
from jetfleet.region_presence import region_key
from jetfleet.responder import Refusals
from jetfleet.settings import Settings

NOT_PERMITTED: Final = "not-permitted"
MAX_PRESENCE_TTL_S = 600
"""The longest TTL of a claim or a region's presence (``worker.claim_ttl_s`` at most)."""
_robots_decoder = msgspec.json.Decoder(RobotsRecord)

PRESENCE_REFUSALS = Refusals[PresenceReply](
    malformed=lambda error: PresenceRefused(
        reason="malformed-request",
        detail=f"not a presence write (schemas/presence.py): {error}",
    ),
    busy=lambda wait, why: PresenceRefused(
        reason="busy", retry_after_s=wait, detail=f"{why}: write again later"
    ),
    failed=lambda exc: PresenceRefused(
        reason="failed", retry_after_s=1.0, detail=f"{type(exc).__name__}: {exc}"
    ),
    too_large=lambda why: PresenceRefused(reason="request-too-large", detail=why),
)


@dataclass(frozen=True)
class KeyFamily:
    """One kind of key a worker may have written for it."""

    what: str
    bucket: str
    key: re.Pattern[str]
    writes: tuple[type[PresenceWrite], ...]
    ttl_s: tuple[int, int]
    """The per-key TTL it must carry, from..to whole seconds (0 from: may carry none)."""
    max_value_bytes: int
    value_names: Callable[[str, bytes, Settings], str | None]
    """What is wrong with a value for the key (it names another key), or None."""


def _claim_value(key: str, value: bytes, _: Settings) -> str | None:
    identity = value.decode(errors="replace").partition("\n")[0]
    if owned_key(identity) != key:
        return "a claim's value must start with the identity whose digest is its key"
    return None


def _region_value(key: str, value: bytes, _: Settings) -> str | None:
    if region_key(value.decode(errors="replace")) != key:
        return "a region's presence must carry the region whose digest is its key"
    return None


def _any_value(key: str, value: bytes, _: Settings) -> str | None:
    return None


def _robots_value(key: str, value: bytes, settings: Settings) -> str | None:
    if key not in settings.targets:
        return f"target {key!r} is not declared in the leaser's settings"
    try:
        record = _robots_decoder.decode(value)
    except msgspec.MsgspecError as exc:
        return f"not a robots.txt record (schemas/targets.py): {exc}"
    if record.target != key:
        return f"the record is of target {record.target!r}, not {key!r}"
    return None


_DIGEST = "[0-9a-f]{32}"
FAMILIES = (
    KeyFamily(
        "an identity claim",
        subjects.BUCKET_WORKERS,
        re.compile(rf"owned\.{_DIGEST}"),
        (PresenceCreate, PresenceUpdate, PresenceDelete),
        (1, MAX_PRESENCE_TTL_S),
        # An identity and a worker id (256 characters each, up to 4 bytes a character)
        # and a token.
        4096,
        _claim_value,
    ),
    KeyFamily(
        "a region's presence",
        subjects.BUCKET_WORKERS,
        re.compile(rf"region\.{_DIGEST}"),
        (PresencePut,),
        (1, MAX_PRESENCE_TTL_S),
        1024,
        _region_value,
    ),
    KeyFamily(
        "a last hand-back note",
        subjects.BUCKET_WORKERS,
        re.compile(r"handback\.[A-Za-z0-9][A-Za-z0-9_=.-]{0,127}"),
        (PresencePut,),
        (1, NOTE_TTL_S),
        1024,
        _any_value,
    ),
    KeyFamily(
        "a robots.txt record",
        subjects.BUCKET_ROBOTS,
        subjects.TARGET_NAME_RE,
        (PresencePut,),
        (0, 86400),
        # Bounded by the route (the server's max_payload), like a worker's direct write.
        2**31,
        _robots_value,
    ),
)


def _ops(family: KeyFamily) -> str:
    return ", ".join(str(w.__struct_config__.tag) for w in family.writes)


PERMITTED = "; ".join(f"{f.what}: {f.key.pattern} in {f.bucket} ({_ops(f)})" for f in FAMILIES)


def objection(settings: Settings, write: PresenceWrite) -> PresenceRefused | None:
    """Why ``write`` is not one a worker may have made for it, or None."""
    family = next(
        (f for f in FAMILIES if f.bucket == write.bucket and f.key.fullmatch(write.key)), None
    )
    op = str(type(write).__struct_config__.tag)
    why: str | None
    if family is None:
        why = f"{write.bucket} {write.key} is in no key family a worker may write"
    elif not isinstance(write, family.writes):
        why = f"{family.what} ({write.bucket} {write.key}) is never written by {op!r}"
    else:
        why = _value_objection(settings, family, write)
    if why is None:
        return None
    return PresenceRefused(
        reason=NOT_PERMITTED,
        detail=f"{op} refused: {why}. {subjects.PRESENCE} writes only: {PERMITTED}",
    )


def _value_objection(settings: Settings, family: KeyFamily, write: PresenceWrite) -> str | None:
    if isinstance(write, PresenceDelete):
        return None
    low, high = family.ttl_s
    if not (low <= write.ttl_s <= high):
        return f"{family.what} carries a TTL of {low} to {high} s, not {write.ttl_s}"
    if len(write.value) > family.max_value_bytes:
        return f"{family.what} is at most {family.max_value_bytes} bytes"
    return family.value_names(write.key, write.value, settings)


class PresenceWrites:
    """Makes the presence writes the route admits."""

    def __init__(self, settings: Settings, js: JetStreamContext) -> None:
        self.settings = settings
        self.writer = DirectPresenceWriter(js)

    def check(self, _: Msg, write: PresenceWrite) -> PresenceRefused | None:
        """The route's check: refuse a write outside the key families."""
        return objection(self.settings, write)

    async def answer(self, write: PresenceWrite) -> PresenceReply:
        """Make ``write``; a lost compare-and-set is ``wrong-revision``. JetStream not
        answering in time raises (the responder answers ``busy``)."""
        writer, timeout_s = self.writer, write.timeout_s
        try:
            if isinstance(write, PresenceCreate):
                revision = await writer.create(write.bucket, write.key, write.value, write.ttl_s)
            elif isinstance(write, PresenceUpdate):
                revision = await writer.update(
                    write.bucket, write.key, write.value, write.last, write.ttl_s, timeout_s
                )
            elif isinstance(write, PresencePut):
                revision = await writer.put(
                    write.bucket, write.key, write.value, write.ttl_s, timeout_s
                )
            else:
                await writer.delete(write.bucket, write.key, write.last)
                revision = 0
        except WrongRevision as exc:
            return PresenceRefused(reason="wrong-revision", detail=str(exc))
        return PresenceWritten(revision=revision)
