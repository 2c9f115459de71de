"""Presence writes: what a worker asks the leaser on ``jf.presence`` to write for it.

A worker has no KV rights of its own: its identity claim, its region's presence, the
reason of a last hand-back and the robots.txt record it fetched are written by the
leaser on its behalf. The four operations are those of a KV bucket (create if
absent, compare-and-set update, put, compare-and-set delete), each with the per-key TTL
the worker asked for; the leaser refuses any bucket or key outside the families listed in
docs/identities.md#who-writes-what (never a lease, fence or control key).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

KvKey = Annotated[str, msgspec.Meta(min_length=1, max_length=512, pattern=r"^[-/_=.a-zA-Z0-9]+$")]
"""A KV key: the characters nats-server accepts in one (no wildcards, no spaces)."""
Bucket = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[-_a-zA-Z0-9]+$")]
Revision = Annotated[int, msgspec.Meta(ge=1)]
TtlS = Annotated[int, msgspec.Meta(ge=0, le=86400 * 366)]
"""A per-key TTL in whole seconds (0: the bucket's max age, no TTL of its own)."""
TimeoutS = Annotated[float, msgspec.Meta(ge=0, le=60)]
"""How long the leaser may wait for JetStream (0: its default); the caller waits about as
long for the answer, so a write it gave up on is not answered long after."""


class PresenceCreate(msgspec.Struct, frozen=True, tag="create", omit_defaults=True):
    """Write ``key`` only if it holds nothing (never written, deleted, or lapsed)."""

    bucket: Bucket
    key: KvKey
    value: bytes
    ttl_s: TtlS = 0
    timeout_s: TimeoutS = 0.0


class PresenceUpdate(msgspec.Struct, frozen=True, tag="update", omit_defaults=True):
    """Write ``key`` only if its last revision is still ``last`` (compare-and-set)."""

    bucket: Bucket
    key: KvKey
    value: bytes
    last: Revision
    ttl_s: TtlS = 0
    timeout_s: TimeoutS = 0.0


class PresencePut(msgspec.Struct, frozen=True, tag="put", omit_defaults=True):
    """Write ``key`` whatever it holds (many writers may share the key)."""

    bucket: Bucket
    key: KvKey
    value: bytes
    ttl_s: TtlS = 0
    timeout_s: TimeoutS = 0.0


class PresenceDelete(msgspec.Struct, frozen=True, tag="delete", omit_defaults=True):
    """Delete ``key`` only if its last revision is still ``last`` (compare-and-set)."""

    bucket: Bucket
    key: KvKey
    last: Revision
    timeout_s: TimeoutS = 0.0


PresenceWrite = PresenceCreate | PresenceUpdate | PresencePut | PresenceDelete


class PresenceWritten(msgspec.Struct, frozen=True, tag="written", omit_defaults=True):
    """The write landed; ``revision`` is the key's new revision (0 after a delete)."""

    revision: int = 0


PresenceRefusalReason = Literal[
    "wrong-revision",
    "not-permitted",
    "malformed-request",
    "request-too-large",
    "busy",
    "failed",
]
"""``wrong-revision``: the compare-and-set lost (the key moved, or holds something for a
create); ``not-permitted``: the bucket, key family or operation is not one a worker may
write; ``busy``: nothing was written, or it is not known whether it was (JetStream did
not answer in time): ask again after ``retry_after_s``; ``failed``: the write was refused
otherwise (the detail says why)."""


class PresenceRefused(msgspec.Struct, frozen=True, tag="refused", omit_defaults=True):
    """Nothing was written (or, for ``busy``, it is not known whether it was)."""

    reason: PresenceRefusalReason
    detail: str = ""
    retry_after_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


PresenceReply = PresenceWritten | PresenceRefused
