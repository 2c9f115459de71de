"""The worker's side of leasing: ask the leaser over request/reply (queue ``leaser``)."""

from __future__ import annotations

import logging

import msgspec
from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetfleet import subjects
from jetfleet.schemas.lease import (
    LeaseGrant,
    LeaseRefusal,
    LeaseRelease,
    LeaseRenew,
    LeaseReply,
    LeaseRequest,
)

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(LeaseReply)
TIMEOUT_S = 3.0


class LeaseClient:
    """Grant, renew and release calls; ``None`` means the leaser could not be reached."""

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc

    async def _call(self, call: LeaseRequest | LeaseRenew | LeaseRelease) -> LeaseReply | None:
        try:
            answer = await self.nc.request(subjects.LEASE, _encoder.encode(call), timeout=TIMEOUT_S)
        except (NoRespondersError, NatsTimeoutError) as exc:
            log.warning("leaser unreachable (%s)", type(exc).__name__)
            return None
        return _decoder.decode(answer.data)

    async def grant(self, request: LeaseRequest) -> LeaseReply | None:
        """Ask for a lease."""
        return await self._call(request)

    async def renew(self, job_id: str, fence: int) -> bool | None:
        """True if still ours, False if lost, None if the leaser did not answer."""
        reply = await self._call(LeaseRenew(job_id=job_id, fence=fence))
        return None if reply is None else isinstance(reply, LeaseGrant)

    async def release(self, job_id: str, fence: int, refund: bool = False) -> bool:
        """True if it was still ours and is now released (``refund``: the attempt does
        not count against the job's budget)."""
        reply = await self._call(LeaseRelease(job_id=job_id, fence=fence, refund=refund))
        return isinstance(reply, LeaseGrant)


def is_refusal(reply: LeaseReply | None) -> bool:
    """Whether the leaser refused (as opposed to granting or saying already-done)."""
    return isinstance(reply, LeaseRefusal)
