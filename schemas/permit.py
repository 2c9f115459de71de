"""Rate permits: what a worker asks the ``ratelimit`` service on ``jf.ratelimit`` just
before each request (a job's, a redirect hop's, a robots.txt fetch's), and what it tells
it when a target says to slow down. Durations only, never wall-clock deadlines (I9).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from jetfleet.schemas.names import Name, TargetName

Seconds = Annotated[float, msgspec.Meta(ge=0, le=86400 * 366)]


class PermitRequest(msgspec.Struct, frozen=True, tag="permit", omit_defaults=True):
    """One request to ``target`` is about to be sent: may it go now?

    Every limit that applies is checked and taken in one step: the fleet aggregate, the
    target's own rate and daily budget, its per-egress and per-identity rates, and any
    hold the target asked for."""

    target: TargetName
    worker: Name = ""
    identity: Name = ""
    egress: Name = ""
    purpose: Literal["job", "robots"] = "job"


class HoldRequest(msgspec.Struct, frozen=True, tag="hold", omit_defaults=True):
    """``target`` answered ``status`` (429, or 503 without a challenge): hold it for the
    whole fleet, for ``retry_after_s`` if it said how long (``said_how_long``; already
    cut to the target's ``max_retry_after_s``), else for the target's adaptive backoff."""

    target: TargetName
    status: int
    said_how_long: bool = False
    """Whether the answer carried a Retry-After (then ``retry_after_s`` is it)."""
    retry_after_s: Seconds = 0.0
    worker: Name = ""


PermitCall = PermitRequest | HoldRequest


class PermitAllowed(msgspec.Struct, frozen=True, tag="allowed", omit_defaults=True):
    """The request may go now; its permit is taken."""


class PermitWait(msgspec.Struct, frozen=True, tag="wait", omit_defaults=True):
    """Not now: ask again in ``retry_after_s``. ``limit`` names the limit that said so
    (fleet, target, egress, identity, daily or hold)."""

    retry_after_s: Seconds
    limit: str
    detail: str = ""


class HoldPlaced(msgspec.Struct, frozen=True, tag="held", omit_defaults=True):
    """The target is held for everyone for ``hold_s`` more seconds; ``streak`` counts its
    slow-down answers since it was last quiet for ``fleet.hold_forgive_s``."""

    hold_s: Seconds
    streak: int = 1


class PermitRefused(msgspec.Struct, frozen=True, tag="refused", omit_defaults=True):
    """No answer on the merits: ``ratelimit-unavailable`` (Redis cannot be reached: the
    limiter fails closed), ``busy``, ``unknown-target``, ``malformed-request``,
    ``request-too-large`` or ``ratelimit-error``. Ask again in ``retry_after_s``."""

    reason: str
    retry_after_s: Seconds = 1.0
    detail: str = ""


PermitReply = PermitAllowed | PermitWait | PermitRefused
HoldReply = HoldPlaced | PermitRefused
RatelimitReply = PermitAllowed | PermitWait | HoldPlaced | PermitRefused
