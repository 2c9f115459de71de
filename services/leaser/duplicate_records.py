"""The leaser's ``already-done`` answers, stored before they are sent.

A job whose idempotency key another job's commit holds is settled by that commit: the
worker acks it without running it. Status counts it as committed only through its
duplicate record (``jf.duplicates.<target>``, I3), and a worker writes no stream, so the
leaser writes the record before it answers. Whatever check answered ``already-done``
(``already_done``, ``settled``, a seal met after the create), the answer passes here.
"""

from __future__ import annotations

import asyncio
import logging

from jetfleet.schemas.lease import LeaseAlreadyDone, LeaseRefusal, LeaseReply, LeaseRequest
from nats.js import JetStreamContext

from jetfleet.duplicates import record_duplicate
from jetfleet.lease_client import BUSY

log = logging.getLogger(__name__)

RECORD_RETRY_S = 1.0
"""How soon a worker asks again when the duplicate record could not be stored."""
RECORD_WITHIN_S = 2.0
"""How long the record's publish is retried (through a leader election) before the
answer is ``busy``: within the worker's lease-call timeout (3 s,
jetfleet/lease_client.py), so the worker hears ``busy`` and asks again rather than
timing out while the leaser still retries."""


async def recorded(js: JetStreamContext, request: LeaseRequest, reply: LeaseReply) -> LeaseReply:
    """``reply``, once the duplicate record it implies is stored; ``busy`` when it could
    not be stored: the worker asks again for the same delivery (it must not ack a job
    that would then be counted nowhere). A job's own commit (a lost ack) needs none."""
    if not isinstance(reply, LeaseAlreadyDone):
        return reply
    try:
        # The whole write, not only its retries: one try alone may wait 5 s for an ack
        # during an election. Cut short, a later try is the same record (its message id).
        async with asyncio.timeout(RECORD_WITHIN_S):
            await record_duplicate(
                js,
                request.job_id,
                request.target,
                request.key,
                reply.committed_by,
                "already-done",
                retry_for_s=RECORD_WITHIN_S,
            )
    except Exception as exc:
        log.warning("could not record job %s as a duplicate: %s", request.job_id, exc)
        return LeaseRefusal(
            reason=BUSY,
            retry_after_s=RECORD_RETRY_S,
            detail="already done, but its duplicate record was not stored "
            f"({exc or type(exc).__name__})",
        )
    return reply
