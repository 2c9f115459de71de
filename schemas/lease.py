"""Lease requests and answers (served by the leaser; see docs/leases.md)."""

from __future__ import annotations

import msgspec

from jetfleet.schemas.report import Versions


class LeaseRequest(msgspec.Struct, frozen=True, tag="grant", omit_defaults=True):
    """Ask for the lease on a job."""

    job_id: str
    target: str
    key: str
    worker: str
    versions: Versions
    identity: str = ""
    region: str = ""
    reply_subject: str = ""
    """The JetStream reply subject of the delivery the lease is for."""


class LeaseRenew(msgspec.Struct, frozen=True, tag="renew"):
    """Extend a held lease; refused unless ``fence`` is still the live one."""

    job_id: str
    fence: int


class LeaseRelease(msgspec.Struct, frozen=True, tag="release"):
    """Give a lease back early."""

    job_id: str
    fence: int


class LeaseGrant(msgspec.Struct, frozen=True, tag="granted"):
    """The lease is yours under ``fence`` for ``ttl_s`` seconds of server time."""

    fence: int
    ttl_s: float


class LeaseRefusal(msgspec.Struct, frozen=True, tag="refused", omit_defaults=True):
    """No lease: ``reason`` says why, ``retry_after_s`` when to ask again."""

    reason: str
    retry_after_s: float = 0.0
    detail: str = ""


class LeaseAlreadyDone(msgspec.Struct, frozen=True, tag="already-done"):
    """The job's idempotency key is committed: ack it without running it again."""

    key: str


LeaseReply = LeaseGrant | LeaseRefusal | LeaseAlreadyDone
