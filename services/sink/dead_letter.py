"""The dead-letter path: a job that will not be retried gets its letter, once.

Only the live lease's holder may dead-letter (and so terminate) a job; a job whose key
is already committed is settled as a duplicate instead (docs/commit.md).
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from jetfleet.schemas import DeadLetter, Failure, SinkReply
from jetfleet.services.sink.commit import CommitPolicy, check_fence
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.attempt_history import attempt_history
from jetfleet.lease_store import LeaseStore
from jetfleet.publish import publish_durably
from jetfleet.results import committed_job

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()


async def dead_letter(
    nc: NatsClient, store: LeaseStore, failure: Failure, policy: CommitPolicy
) -> SinkReply:
    """Write ``failure``'s dead letter if its fence holds the live lease; the answer."""
    js = nc.jetstream()
    order = failure.order
    # Every read at once, so the letter is written one round trip after the fence
    # was confirmed: the shorter that gap, the less room for a revoke and a rerun
    # that commits to slip in before the letter lands.
    fence_check = (
        check_fence(store, order.job.id, failure.fence) if policy.leases else _no_refusal()
    )
    refusal, holder, history = await asyncio.gather(
        fence_check,
        committed_job(js, order.target, order.key),
        attempt_history(nc, order.target, order.job.id, failure.history),
    )
    if refusal is not None:
        return refusal
    if holder is not None:
        # The work is already done (a lost ack or term, then a failing rerun): the job
        # is settled as a duplicate, never both committed and dead.
        return SinkReply(status="suppressed:duplicate-key", detail=order.key, committed_by=holder)
    letter = DeadLetter(order=order, reason=failure.reason, history=history, detail=failure.detail)
    # Written (and acked by the stream) BEFORE the worker terminates the message.
    await publish_durably(
        js,
        subjects.dead_letter(order.target, order.job.id),
        _encoder.encode(letter),
        msg_id=f"dlq-{order.job.id}",
        headers={"Jf-Reason": failure.reason, "Jf-Job": order.job.id},
    )
    log.info("dead-lettered %s: %s", order.job.id, failure.reason)
    return SinkReply(status="dead-lettered", detail=failure.reason)


async def _no_refusal() -> SinkReply | None:
    """The fence check when leases are off: nothing to refuse."""
    return None
