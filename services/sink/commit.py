"""The one commit function. Every result reaches the world through here.

Checks, in order (docs/commit.md explains each crash point):

1. fence: the report's fence must be >= the highest fence ever granted for the job;
   otherwise ``rejected:fenced-out``;
2. lease: the job's lease must be live (server-clock TTL) under exactly this fence;
   missing -> ``rejected:lease-expired``, another fence -> ``rejected:fenced-out``;
3. key: the result is published to ``jf.results.<target>.<key>`` with
   ``Nats-Expected-Last-Subject-Sequence: 0``, an atomic put-if-absent. The result record
   IS the idempotency key, so "key written but result lost" (or the reverse) cannot
   happen: one write, durable once the stream acks it. A second commit of the same key
   answers ``suppressed:duplicate-key``.

Between check 2 and the write the lease may expire and be granted again; the new holder's
commit then meets the key and is suppressed, so there is still one side effect.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
from jetfleet.schemas import CommittedResult, SinkReply, Success
from nats.js import JetStreamContext
from nats.js.errors import APIError

from jetfleet import subjects
from jetfleet.js_errors import is_wrong_last_sequence
from jetfleet.lease_store import LeaseStore
from jetfleet.publish import publish_durably
from jetfleet.results import committed_job

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class CommitPolicy:
    """How strict the commit is. Both true in production."""

    leases: bool = True
    """Check fence and lease (false: the foundation's direct path, a benchmark baseline)."""
    dedupe: bool = True
    """Refuse a second commit of the same key (false only to demonstrate why it exists)."""


async def check_fence(store: LeaseStore, job_id: str, fence: int) -> SinkReply | None:
    """None when ``fence`` holds the job's live lease; else the rejection to answer.

    Both reads go at once: whichever a grant racing them lands between, one of the two
    rejections below catches it (a newer grant raises the highest fence and replaces the
    live lease), so their order adds no safety, only a round trip.
    """
    highest, live = await asyncio.gather(store.highest_fence(job_id), store.live(job_id))
    if fence < highest.fence:
        return SinkReply(
            status="rejected:fenced-out", detail=f"fence {fence} < highest granted {highest.fence}"
        )
    if live is None:
        return SinkReply(
            status="rejected:lease-expired",
            detail=f"no live lease for fence {fence} (server clock)",
        )
    if live.fence != fence:
        return SinkReply(
            status="rejected:fenced-out", detail=f"live lease has fence {live.fence}, not {fence}"
        )
    return None


async def commit(
    js: JetStreamContext, store: LeaseStore, success: Success, policy: CommitPolicy = CommitPolicy()
) -> SinkReply:
    """Commit ``success`` once per idempotency key, only from the live lease's holder."""
    order = success.order
    if policy.leases:
        refusal = await check_fence(store, order.job.id, success.fence)
        if refusal is not None:
            return refusal
    record = CommittedResult(
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
    payload = _encoder.encode(record)
    subject = subjects.result_key(order.target, order.key)
    if not policy.dedupe:
        ack = await publish_durably(js, subject, payload, msg_id=None)
        return SinkReply(status="committed", detail=str(ack.seq))
    try:
        # Put-if-absent on the key's subject; the msg id also turns a re-sent commit
        # (a lost ack, a retried publish) into a duplicate inside the stream's window.
        ack = await publish_durably(
            js,
            subject,
            payload,
            msg_id=f"res-{order.key}",
            headers={"Nats-Expected-Last-Subject-Sequence": "0"},
        )
    except APIError as exc:
        if is_wrong_last_sequence(exc):
            return await _suppressed(js, order.target, order.key)
        raise
    if ack.duplicate:
        return await _suppressed(js, order.target, order.key)
    return SinkReply(status="committed", detail=str(ack.seq))


async def _suppressed(js: JetStreamContext, target: str, key: str) -> SinkReply:
    holder = await committed_job(js, target, key)
    return SinkReply(status="suppressed:duplicate-key", detail=key, committed_by=holder or "")
