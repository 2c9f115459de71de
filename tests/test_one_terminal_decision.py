"""Item 2 of issue 8: one terminal decision per job, whatever lands late.

The sink's write of a result or a dead letter can land long after its fence check (its
publish retries run for up to about 35 s). Meanwhile an operator's quarantine revokes the
lease and another worker is granted the job. These tests hold the first sink's publish
on the wire (a real TCP relay in front of the real nats-server), let the second holder
try, then let the publish through, or drop it as a sink that dies mid-write would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats
import pytest
from jetfleet.schemas import (
    AttemptRecord,
    Failure,
    LeaseAlreadyDone,
    LeaseGrant,
    LeaseRefusal,
    NoopOutput,
    SinkReply,
    Success,
    WorkOrder,
)
from jetfleet.schemas.lease import QuarantineRecord, QuarantineReply, QuarantineSet
from jetfleet.services.sink.commit import CommitPolicy, commit
from jetfleet.services.sink.dead_letter import dead_letter
from nats.aio.client import Client as NatsClient
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings
from tests.conftest import admin_url, wait_for
from tests.faults.publish_gate import PublishGate
from tests.leasing import VERSIONS, ask, granted, order_for, report, report_failure
from tests.stack import InProcessStack
from tests.test_unrunnable import publish_advisory

pytestmark = pytest.mark.timeout(90)
_encoder = msgspec.json.Encoder()


def _success(order: WorkOrder, fence: int, worker: str) -> Success:
    return Success(
        order=order,
        worker=worker,
        attempt=1,
        duration_s=0.01,
        output=NoopOutput(),
        versions=VERSIONS,
        fence=fence,
    )


def _failure(order: WorkOrder, fence: int, worker: str) -> Failure:
    attempt = AttemptRecord(
        attempt=1, worker=worker, fence=fence, outcome="permanent", reason="not-found"
    )
    return Failure(
        order=order,
        worker=worker,
        reason="not-found",
        history=[attempt],
        versions=VERSIONS,
        fence=fence,
    )


@dataclass
class SlowSink:
    """A sink replica whose connection holds its first publish on ``prefix``."""

    gate: PublishGate
    nc: NatsClient
    store: LeaseStore

    async def settle(self, report: Success | Failure) -> SinkReply:
        """Drive the sink's own paths (commit, dead letter) over the slow connection."""
        if isinstance(report, Success):
            return await commit(self.nc.jetstream(), self.store, report, CommitPolicy())
        return await dead_letter(self.nc, self.store, report, CommitPolicy())


async def _slow_sink(settings: Settings, prefix: str) -> AsyncIterator[SlowSink]:
    gate = PublishGate(settings.nats.url, prefix)
    url = admin_url(await gate.start())  # the proxy passes the admin's login through
    nc = await nats.connect(servers=[url], name="slow-sink", allow_reconnect=False)
    try:
        yield SlowSink(gate, nc, await LeaseStore.open(nc.jetstream()))
    finally:
        gate.release()
        await gate.cut()
        await nc.close()


@pytest.fixture
async def slow_dlq_sink(settings: Settings, nc: NatsClient) -> AsyncIterator[SlowSink]:
    async for sink in _slow_sink(settings, "jf.dlq."):
        yield sink


@pytest.fixture
async def slow_results_sink(settings: Settings, nc: NatsClient) -> AsyncIterator[SlowSink]:
    async for sink in _slow_sink(settings, "jf.results."):
        yield sink


async def _revoke(nc: NatsClient, worker: str, target: str) -> list[str]:
    """An operator quarantines ``worker`` on ``target``: its leases are revoked."""
    command = QuarantineSet(
        record=QuarantineRecord(scope="worker", name=worker, target=target, reason="test")
    )
    answer = await nc.request(subjects.QUARANTINE, _encoder.encode(command), timeout=5.0)
    reply = msgspec.json.decode(answer.data, type=QuarantineReply)
    assert reply.ok, reply
    return reply.revoked


async def _has_letter(nc: NatsClient, order: WorkOrder) -> bool:
    subject = subjects.dead_letter(order.target, order.job.id)
    try:
        await nc.jetstream().get_msg(subjects.STREAM_DLQ, subject=subject)
    except NotFoundError:
        return False
    return True


async def _has_result(nc: NatsClient, order: WorkOrder) -> bool:
    subject = subjects.result_key(order.target, order.key)
    try:
        await nc.jetstream().get_msg(subjects.STREAM_RESULTS, subject=subject)
    except NotFoundError:
        return False
    return True


SecondHolder = Callable[[NatsClient, WorkOrder, int], Awaitable[SinkReply]]


async def _second_holder_commits(nc: NatsClient, order: WorkOrder, fence: int) -> SinkReply:
    return await report(nc, order, fence, "w-b")


async def _second_holder_fails(nc: NatsClient, order: WorkOrder, fence: int) -> SinkReply:
    return await report_failure(nc, order, fence, "w-b")


@pytest.mark.parametrize(
    ("first", "second"),
    [("dead letter", "commit"), ("commit", "dead letter")],
)
async def test_item2_a_late_write_after_a_revoke_and_a_second_holder_leaves_one_decision(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    slow_dlq_sink: SlowSink,
    slow_results_sink: SlowSink,
    first: str,
    second: str,
) -> None:
    """w-a's sink confirms its fence, then its write hangs on the wire; w-a is quarantined
    (its sealed job's lease is left alone), w-b asks for the job and, if granted, settles
    it the other way;
    then w-a's write lands. The job must end committed or dead, never both."""
    client = LeaseClient(nc)
    order = order_for(settings, "/page/item2")
    fence_a = (await granted(client, ask(order, worker="w-a"))).fence
    if first == "dead letter":
        slow, late = slow_dlq_sink, slow_dlq_sink.settle(_failure(order, fence_a, "w-a"))
        finish: SecondHolder = _second_holder_commits
    else:
        slow, late = slow_results_sink, slow_results_sink.settle(_success(order, fence_a, "w-a"))
        finish = _second_holder_fails
    first_answer = asyncio.ensure_future(late)
    await asyncio.wait_for(slow.gate.holding.wait(), 20.0)

    # The job is sealed already (the sink seals before it writes): a revoke leaves a
    # sealed job's lease alone and lists nothing, and w-b is answered from the seal.
    assert await _revoke(nc, "w-a", order.target) == []
    second_grant = await client.grant(ask(order, worker="w-b"))
    second_answer = None
    if isinstance(second_grant, LeaseGrant):
        second_answer = await finish(nc, order, second_grant.fence)
    slow.gate.release()
    answer = await asyncio.wait_for(first_answer, 60.0)

    letter, result = await _has_letter(nc, order), await _has_result(nc, order)
    assert not (letter and result), (
        f"job ended both dead-lettered and committed: w-a's {first} answered "
        f"{answer.status}, w-b was answered {second_grant} then {second_answer}"
    )
    # The first decision, sealed before the revoke, is the one that holds.
    assert (letter, result) == ((True, False) if first == "dead letter" else (False, True))
    expected = LeaseRefusal if first == "dead letter" else LeaseAlreadyDone
    assert isinstance(second_grant, expected), second_grant


@pytest.mark.parametrize("kind", ["dead letter", "commit"])
@pytest.mark.parametrize("completed_by", ["the next grant", "the report sent again"])
async def test_item2_a_sink_dying_between_its_seal_and_its_write_strands_nothing(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    slow_dlq_sink: SlowSink,
    slow_results_sink: SlowSink,
    kind: str,
    completed_by: str,
) -> None:
    """The sink decides, then dies before its record is written (its held publish is
    dropped). Whoever meets the job next (the leaser on the redelivery, or another sink
    replica answering the worker's retried report) writes that same decision's record,
    so the job still ends dead-lettered (or committed), once."""
    client = LeaseClient(nc)
    order = order_for(settings, "/page/item2-crash")
    fence = (await granted(client, ask(order, worker="w-a"))).fence
    report_: Success | Failure
    if kind == "dead letter":
        slow, report_ = slow_dlq_sink, _failure(order, fence, "w-a")
    else:
        slow, report_ = slow_results_sink, _success(order, fence, "w-a")
    dying = asyncio.ensure_future(slow.settle(report_))
    await asyncio.wait_for(slow.gate.holding.wait(), 20.0)
    dying.cancel()
    await slow.gate.cut()  # the held publish never reaches the server

    if completed_by == "the next grant":
        # The worker gave up on the sink and released the lease; the job is redelivered.
        assert await client.release(order.job.id, fence, refund=True) is True
        reply = await client.grant(ask(order, worker="w-b"))
        if kind == "dead letter":
            assert isinstance(reply, LeaseRefusal) and reply.reason == "dead-lettered", reply
        else:
            assert isinstance(reply, LeaseAlreadyDone), reply
    else:
        answer = await (
            report_failure(nc, order, fence, "w-a")
            if kind == "dead letter"
            else report(nc, order, fence, "w-a")
        )
        # The dead sink's write never reached the server: this is the first one.
        assert answer.status == ("dead-lettered" if kind == "dead letter" else "committed")
    await wait_for(
        lambda: _has_letter(nc, order) if kind == "dead letter" else _has_result(nc, order),
        10.0,
        f"the {kind} of the dead sink's decision",
    )
    assert not await (_has_result(nc, order) if kind == "dead letter" else _has_letter(nc, order))


async def test_item2_the_backstop_lands_a_stranded_seal_rather_than_a_dead_letter(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    slow_results_sink: SlowSink,
) -> None:
    """The job was sealed committed by a sink that died before writing the result; then
    its deliveries ran out (max_deliver). The backstop must end it the way it was
    decided, committed, not write a dead letter beside a result that may still land."""
    js = nc.jetstream()
    order = order_for(settings, "/page/93")
    seq = (await js.publish(subjects.work("demo", "normal"), _encoder.encode(order))).seq
    client = LeaseClient(nc)
    fence = (await granted(client, ask(order, worker="w-a"))).fence
    dying = asyncio.ensure_future(slow_results_sink.settle(_success(order, fence, "w-a")))
    await asyncio.wait_for(slow_results_sink.gate.holding.wait(), 20.0)
    dying.cancel()
    await slow_results_sink.gate.cut()
    assert await client.release(order.job.id, fence) is True  # the worker died too

    await publish_advisory(nc, seq)

    async def removed() -> bool:
        return (await js.stream_info(subjects.STREAM_WORK)).state.messages == 0

    await wait_for(removed, 20.0, "the backstop to end the exhausted job")
    assert (await _has_result(nc, order), await _has_letter(nc, order)) == (True, False)
