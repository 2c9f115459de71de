"""The worker's side of leasing: ask the leaser over request/reply (queue ``leaser``)."""

from __future__ import annotations

import asyncio
import logging
from typing import TypeGuard

import msgspec
from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry.trace import SpanKind

from jetfleet import subjects, tracing
from jetfleet.backoff import Backoff
from jetfleet.schemas.lease import (
    LEASE_LOST,
    LeaseGrant,
    LeaseRefusal,
    LeaseRelease,
    LeaseRenew,
    LeaseReply,
    LeaseRequest,
)
from jetfleet.schemas.report import AttemptRecord

log = logging.getLogger(__name__)

BUSY = "busy"
"""The leaser's refusal when it has ``fleet.service_concurrency`` calls in hand: this one
was not looked at, so nothing was decided; ask again after its retry-after."""

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(LeaseReply)
TIMEOUT_S = 3.0
RELEASE_TRIES = 3
"""Asks of a release the leaser answered busy: a lost refund would spend an attempt."""


class LeaseClient:
    """Grant, renew and release calls; ``None`` means the leaser could not be reached."""

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc

    async def _call(self, call: LeaseRequest | LeaseRenew | LeaseRelease) -> LeaseReply | None:
        with tracing.span(
            tracing.call_name(call), SpanKind.CLIENT, attributes=tracing.call_attributes(call)
        ):
            try:
                answer = await self.nc.request(
                    subjects.LEASE,
                    _encoder.encode(call),
                    timeout=TIMEOUT_S,
                    headers=tracing.inject(),
                )
            except (NoRespondersError, NatsTimeoutError) as exc:
                log.warning("leaser unreachable (%s)", type(exc).__name__)
                tracing.note("unanswered", type(exc).__name__, error=True)
                return None
            reply = _decoder.decode(answer.data)
            tracing.note_reply(reply)
            return reply

    async def grant(self, request: LeaseRequest) -> LeaseReply | None:
        """Ask for a lease."""
        return await self._call(request)

    async def renew(self, job_id: str, fence: int) -> bool | None:
        """True if still ours, False if lost, None if unknown (no answer, or the leaser
        failed to read its store: a passing error must not cost a healthy job)."""
        return _settled(await self._call(LeaseRenew(job_id=job_id, fence=fence)))

    async def release(
        self,
        job_id: str,
        fence: int,
        refund: bool = False,
        avoid_reason: str = "",
        attempt: AttemptRecord | None = None,
    ) -> bool | None:
        """True if it was still ours and is now released (``refund``: the attempt does
        not count against the job's budget; ``avoid_reason``: the target refused it
        here, so this worker's identity goes on the job's avoid list), False if it was
        not ours any more, None if unknown (it then expires by its TTL). ``attempt``: the
        record of the attempt the release ends, for the job's history (recorded also when
        the lease was lost, if nobody was granted the job since: LeaseRelease.attempt).
        Asked again, briefly, while the leaser is busy."""
        call = LeaseRelease(
            job_id=job_id,
            fence=fence,
            refund=refund,
            avoid_reason=avoid_reason,
            attempt=attempt,
        )
        backoff = Backoff()
        reply = await self._call(call)
        for _ in range(RELEASE_TRIES - 1):
            if not is_busy(reply):
                break
            await asyncio.sleep(backoff.next_s(reply.retry_after_s))
            reply = await self._call(call)
        return _settled(reply)


def _settled(reply: LeaseReply | None) -> bool | None:
    """A renew's or release's answer: only ``lease-lost`` says the lease is not ours."""
    if isinstance(reply, LeaseGrant):
        return True
    if isinstance(reply, LeaseRefusal) and reply.reason == LEASE_LOST:
        return False
    if reply is not None and not is_busy(reply):
        log.warning("leaser could not settle a lease call: %s", reply)
    return None


def is_busy(reply: LeaseReply | None) -> TypeGuard[LeaseRefusal]:
    """Whether the leaser was too full to look at the call (ask again later)."""
    return isinstance(reply, LeaseRefusal) and reply.reason == BUSY


def is_refusal(reply: LeaseReply | None) -> bool:
    """Whether the leaser refused (as opposed to granting or saying already-done)."""
    return isinstance(reply, LeaseRefusal)
