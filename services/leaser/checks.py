"""The ordered list of grant checks. Each answers a refusal (or already-done) or None.

Later capabilities (pause, approved versions, activity windows, rate permits) add their
check to ``GRANT_CHECKS``; order matters: the cheapest and most final checks come first.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.results import committed_job
from jetfleet.schemas.lease import LeaseAlreadyDone, LeaseRefusal, LeaseRequest
from jetfleet.services.leaser.quarantine_book import QuarantineBook
from jetfleet.settings import Settings

# How often a quarantined scope asks again: a quarantine may be lifted early, so a
# worker never holds off longer than this, whatever the quarantine's duration.
QUARANTINE_RETRY_S = 30.0


@dataclass(frozen=True)
class GrantContext:
    """What a grant check may look at."""

    request: LeaseRequest
    settings: Settings
    js: JetStreamContext
    quarantine: QuarantineBook


GrantCheck = Callable[[GrantContext], Awaitable[LeaseRefusal | LeaseAlreadyDone | None]]


async def already_done(ctx: GrantContext) -> LeaseAlreadyDone | None:
    """The idempotency key is committed: no second request to the target."""
    committed_by = await committed_job(ctx.js, ctx.request.target, ctx.request.key)
    if committed_by is not None:
        return LeaseAlreadyDone(key=ctx.request.key, committed_by=committed_by)
    return None


async def dead_lettered(ctx: GrantContext) -> LeaseRefusal | None:
    """The job was dead-lettered already (its terminate was lost): it must not run again,
    or it would end both dead and committed. The worker terminates this delivery."""
    subject = subjects.dead_letter(ctx.request.target, ctx.request.job_id)
    try:
        await ctx.js.get_msg(subjects.STREAM_DLQ, subject=subject, direct=True)
    except NotFoundError:
        return None
    return LeaseRefusal(reason="dead-lettered", detail="the job is in the dead letter queue")


async def quarantined(ctx: GrantContext) -> LeaseRefusal | None:
    """The worker or its identity is quarantined on this target."""
    req = ctx.request
    for scope, name in (("worker", req.worker), ("identity", req.identity)):
        record = await ctx.quarantine.get(scope, name, req.target)  # type: ignore[arg-type]
        if record is not None:
            return LeaseRefusal(
                reason="quarantined",
                retry_after_s=min(record.for_s or QUARANTINE_RETRY_S, QUARANTINE_RETRY_S),
                detail=f"{scope} {name} is quarantined on {req.target}: {record.reason}",
            )
    return None


async def pinned_identity(ctx: GrantContext) -> LeaseRefusal | None:
    """A job pinned to an identity goes only to the worker that owns it."""
    req = ctx.request
    if req.pin_identity and req.pin_identity != req.identity:
        return LeaseRefusal(
            reason="wrong-identity",
            # Another worker owns the identity; give it the job quickly.
            retry_after_s=0.0,
            detail=f"job is pinned to identity {req.pin_identity}, worker has "
            f"{req.identity or 'none'}",
        )
    return None


GRANT_CHECKS: tuple[GrantCheck, ...] = (
    already_done,
    dead_lettered,
    quarantined,
    pinned_identity,
)
