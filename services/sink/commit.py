"""The one commit function. Every result reaches the world through here.

Checks, in order (docs/commit.md explains each crash point):

1. fence: the report's fence must be >= the highest fence ever granted for the job;
   otherwise ``rejected:fenced-out``;
2. lease: the job's lease must be live (server-clock TTL) under exactly this fence;
   missing -> ``rejected:lease-expired``, another fence -> ``rejected:fenced-out``; a
   job never granted at all (no lease, no fence in its history) -> ``rejected:not-granted``;
3. grant: the live lease's record (what the leaser wrote at the grant) must name the
   report's target and idempotency key, else ``rejected:not-granted``: the sink trusts
   only what the leaser granted, never what a report says of itself;
4. seal: the commit is written into the job's ``jf-fences`` entry as its one terminal
   decision, compare-and-set on the revision read in check 1, so no grant (and no dead
   letter) can come after it; a job sealed already answers that decision;
5. key: the result is published to ``jf.results.<target>.<key>`` with
   ``Nats-Expected-Last-Subject-Sequence: 0``, an atomic put-if-absent. The result record
   IS the idempotency key, so "key written but result lost" (or the reverse) cannot
   happen. A second commit of the same key answers ``suppressed:duplicate-key``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from jetfleet.schemas import CommittedResult, SinkReply, Success, WorkOrder
from jetfleet.schemas.lease import LeaseRecord, Sealed, SealedCommit
from jetfleet.schemas.report import Versions
from nats.js import JetStreamContext

from jetfleet.lease_store import HistoryEntry, LeaseStore, LiveLease
from jetfleet.settlement import land
from jetfleet.version_tuple import tuple_id

# Seal attempts before giving up under contention (each conflict is a grant, a refund
# or another seal landing between our read and our write).
_SEAL_TRIES = 10


@dataclass(frozen=True)
class CommitPolicy:
    """How strict the commit is. Both true in production."""

    leases: bool = True
    """Check fence and lease, and seal (false: the foundation's direct path, a benchmark
    baseline)."""
    dedupe: bool = True
    """Refuse a second commit of the same key (false only to demonstrate why it exists)."""


@dataclass(frozen=True)
class FenceRead:
    """What a settle decides on: the job's history (with its revision, to seal against)
    and its live lease."""

    history: HistoryEntry
    live: LiveLease | None


async def read_fence(store: LeaseStore, job_id: str) -> FenceRead:
    """The job's history and live lease, read at once.

    Whichever a grant racing them lands between, the seal's compare-and-set on the
    history catches it (a grant moves the revision), so their order adds no safety.
    """
    history, live = await asyncio.gather(store.read_history(job_id), store.live(job_id))
    return FenceRead(history, live)


def judge(
    read: FenceRead, fence: int, order: WorkOrder, versions: Versions | None = None
) -> Sealed | SinkReply | None:
    """The job's seal, if ``fence``'s holder (or a report of it sent again) sealed it
    already; the rejection if ``fence`` does not hold the live lease, or the lease was
    granted for another target or key than ``order``'s; else None."""
    history = read.history.history
    highest = history.fence if history else 0
    if history is not None and history.settled is not None and fence == history.settled.fence:
        return _sealed_as_reported(history.settled, order)
    if fence < highest:
        return SinkReply(
            status="rejected:fenced-out", detail=f"fence {fence} < highest granted {highest}"
        )
    if history is not None and history.settled is not None:
        return SinkReply(
            status="rejected:fenced-out",
            detail=f"the job was settled under fence {history.settled.fence}, not {fence}",
        )
    if read.live is None:
        if highest == 0:
            return SinkReply(
                status="rejected:not-granted",
                detail=f"job {order.job.id!r} was never granted a lease: nothing to settle",
            )
        return SinkReply(
            status="rejected:lease-expired",
            detail=f"no live lease for fence {fence} (server clock)",
        )
    if read.live.fence != fence:
        return SinkReply(
            status="rejected:fenced-out",
            detail=f"live lease has fence {read.live.fence}, not {fence}",
        )
    return granted_as_reported(read.live.record, fence, order, versions)


def _sealed_as_reported(sealed: Sealed, order: WorkOrder) -> Sealed | SinkReply:
    """The seal, for a report sent again by its sealer; a refusal for a report under the
    sealer's fence that names another target or key (the seal is not re-landed for it)."""
    sealed_order = (
        (sealed.result.target, sealed.result.key)
        if isinstance(sealed, SealedCommit)
        else (sealed.letter.order.target, sealed.letter.order.key)
    )
    if sealed_order == (order.target, order.key):
        return sealed
    return SinkReply(
        status="rejected:not-granted",
        detail=f"the job was settled under fence {sealed.fence} for target "
        f"{sealed_order[0]!r} with key {sealed_order[1]!r}, not {order.target!r} with "
        f"key {order.key!r}",
    )


def granted_as_reported(
    record: LeaseRecord, fence: int, order: WorkOrder, versions: Versions | None = None
) -> SinkReply | None:
    """The refusal of a report whose job, target or key is not the one the lease under
    ``fence`` was granted for, or whose version tuple (``versions``, when given) is not
    the one it was granted to; None when they match. A record from before the key (the
    version) was kept is checked without it."""
    granted = (record.job_id, record.target, record.key or order.key)
    reported = (order.job.id, order.target, order.key)
    if granted == reported:
        reported_version = tuple_id(versions) if versions is not None else ""
        if not record.version or not reported_version or record.version == reported_version:
            return None
        return SinkReply(
            status="rejected:not-granted",
            detail=f"fence {fence} was granted to version tuple {record.version}, not to "
            f"the report's {reported_version}",
        )
    return SinkReply(
        status="rejected:not-granted",
        detail=f"fence {fence} was granted for job {record.job_id!r} of target "
        f"{record.target!r} with key {record.key!r}, not for job {order.job.id!r} of "
        f"{order.target!r} with key {order.key!r}",
    )


async def seal(
    store: LeaseStore,
    order: WorkOrder,
    decision: Sealed,
    read: FenceRead,
    versions: Versions | None = None,
) -> Sealed | SinkReply:
    """Seal ``decision`` as the job's one terminal decision, if its fence holds the live
    lease; the decision that holds (``decision``, or one sealed before under the same
    fence) or the rejection. A conflict (the history moved since ``read``) reads the
    history again and judges again."""
    job_id = order.job.id
    for _ in range(_SEAL_TRIES):
        verdict = judge(read, decision.fence, order, versions)
        if verdict is not None:
            return verdict
        if await store.seal(job_id, decision, read.history):
            return decision
        read = FenceRead(await store.read_history(job_id), read.live)
    raise RuntimeError(f"could not seal the settle of {job_id}: too much contention")


async def commit(
    js: JetStreamContext, store: LeaseStore, success: Success, policy: CommitPolicy = CommitPolicy()
) -> SinkReply:
    """Commit ``success`` once per idempotency key, only from the live lease's holder,
    and only if the job has not been settled another way."""
    decision: Sealed = SealedCommit(fence=success.fence, result=_record(success))
    if policy.leases:
        read = await read_fence(store, success.order.job.id)
        verdict = await seal(store, success.order, decision, read, success.versions)
        if isinstance(verdict, SinkReply):
            return verdict
        decision = verdict
    return await land(js, decision, dedupe=policy.dedupe)


def _record(success: Success) -> CommittedResult:
    order = success.order
    return CommittedResult(
        job_id=order.job.id,
        target=order.target,
        url=order.job.url,
        key=order.key,
        handler=order.job.handler,
        worker=success.worker,
        attempt=success.attempt,
        duration_s=success.duration_s,
        output=success.output,
        versions=success.versions,
        identity=success.identity,
        fence=success.fence,
    )
