"""The dead-letter path: a job that will not be retried gets its letter, once.

Only the live lease's holder may dead-letter (and so terminate) a job. A job whose key
is already committed is settled as a duplicate instead, and a job sealed already (by
this holder's earlier report) lands that seal: a job is never both committed and dead
(docs/commit.md#the-settle-rule).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from jetfleet.schemas import DeadLetter, Failure, SinkReply
from jetfleet.schemas.lease import Sealed, SealedDeath
from jetfleet.services.sink.commit import CommitPolicy, FenceRead, judge, read_fence, seal
from nats.aio.client import Client as NatsClient

from jetfleet.attempt_history import merged_history, old_attempts
from jetfleet.lease_store import LeaseStore
from jetfleet.results import committed_job
from jetfleet.settlement import land


async def dead_letter(
    nc: NatsClient,
    store: LeaseStore,
    failure: Failure,
    policy: CommitPolicy,
    on_written: Callable[[], None] | None = None,
) -> SinkReply:
    """Seal and write ``failure``'s dead letter if its fence holds the live lease; the
    answer. ``on_written`` is called if this call stored the letter (a report sent again
    is answered from the seal, and its letter is there already)."""
    order = failure.order
    # Every read at once: the seal follows one round trip after the fence was read. The
    # job's attempts are in its ledger entry (the fence read); events of its attempts
    # from before outcomes moved to per-target subjects are on its old outcome subject.
    read, holder, old = await asyncio.gather(
        read_fence(store, order.job.id) if policy.leases else _unfenced(),
        committed_job(nc.jetstream(), order.target, order.key),
        old_attempts(nc, order.target, order.job.id),
    )
    if read is not None:
        verdict = judge(read, failure.fence, order, failure.versions)
        if verdict is not None:
            return await _answer(nc, verdict, on_written)
    if holder is not None:
        # The work is already done (a lost ack or term, then a failing rerun): the job
        # is settled as a duplicate, never both committed and dead.
        return SinkReply(status="suppressed:duplicate-key", detail=order.key, committed_by=holder)
    entry = read.history.history if read is not None else None
    recorded = [*old, *(entry.attempts if entry is not None else [])]
    history = merged_history(order.job.id, recorded, failure.history)
    letter = DeadLetter(order=order, reason=failure.reason, history=history, detail=failure.detail)
    death = SealedDeath(fence=failure.fence, letter=letter)
    if read is None:
        return await land(nc.jetstream(), death, on_letter_written=on_written)
    return await _answer(nc, await seal(store, order, death, read, failure.versions), on_written)


async def _answer(
    nc: NatsClient, verdict: Sealed | SinkReply, on_written: Callable[[], None] | None
) -> SinkReply:
    """A rejection as it is; a seal, landed."""
    if isinstance(verdict, SinkReply):
        return verdict
    return await land(nc.jetstream(), verdict, on_letter_written=on_written)


async def _unfenced() -> FenceRead | None:
    """The fence read when leases are off: nothing to check."""
    return None
