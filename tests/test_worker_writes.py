"""A worker writes no stream: a job another job's commit settled is recorded by the leaser
(before ``already-done``) or the sink (before ``suppressed:duplicate-key``), and an
undecodable work order is kept by the sink from the worker's ``Malformed`` report
(docs/commit.md#duplicates, docs/dead-letters.md#malformed-work-orders)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import pytest
from jetfleet.schemas import Duplicate, LeaseReply, Rejection, SinkReply
from jetfleet.schemas.lease import LeaseAlreadyDone, LeaseRefusal
from jetfleet.schemas.report import Malformed
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.connection import connect_nats
from jetfleet.lease_client import LeaseClient
from jetfleet.ops.status import confirmed_status
from jetfleet.settings import NatsSettings, Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import read_stream
from jetfleet.topology import declare
from jetfleet.worker import Worker
from tests.conftest import wait_for
from tests.leasing import ask, grant_fence, order_for, report
from tests.queueing.helpers import committed, queue_settings, submit_paths, target
from tests.stack import InProcessStack
from tests.test_presence_writes import WORKER_PUBLISH, GuardedNats

# The guarded worker's direct writes are refused on purpose (and asserted).
pytestmark = pytest.mark.expects_refusals

TARGET = "demo"
# The guarded worker user may not write these streams (the permissions table of #11).
assert not any(s.startswith(("jf.duplicates", "jf.rejected")) for s in WORKER_PUBLISH)


@dataclass
class Fleet:
    settings: Settings
    stack: InProcessStack
    server: GuardedNats

    @property
    def admin(self) -> JetStreamContext:
        return self.stack.connections[0].jetstream()

    async def as_worker(self, name: str) -> NatsClient:
        nc = await connect_nats(NatsSettings(url=self.server.url_of("worker")), name)
        self.stack.connections.append(nc)  # closed with the stack
        return nc

    async def start_worker(self, name: str) -> Worker:
        worker = Worker(self.settings, await self.as_worker(name), name)
        await worker.start()
        self.stack.workers.append(worker)
        return worker


@pytest.fixture
async def fleet(redis_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    """Services on the admin user; workers (started by each test) on the guarded one."""
    server = GuardedNats(tmp_path / "nats").start()
    try:
        async with TargetSimulator(SimulatorConfig()) as sim:
            settings = queue_settings(
                server.url_of("admin"), redis_url, {TARGET: target(sim.base_url)}, concurrency=2
            )
            # This server has its own two users, not the session's bundle.
            settings = msgspec.structs.replace(
                settings, nats=NatsSettings(url=server.url_of("admin"))
            )
            stack = InProcessStack(settings)
            await stack.start(workers=0)
            try:
                yield Fleet(settings, stack, server)
            finally:
                await stack.stop()
    finally:
        server.stop()


async def _duplicates(js: JetStreamContext) -> list[Duplicate]:
    return [
        msgspec.json.decode(m.data, type=Duplicate)
        async for m in read_stream(js, subjects.STREAM_DUPLICATES, subjects.duplicates(TARGET))
    ]


async def _rejections(js: JetStreamContext) -> list[Rejection]:
    return [
        msgspec.json.decode(m.data, type=Rejection)
        async for m in read_stream(js, subjects.STREAM_REJECTED, subjects.rejected(TARGET))
    ]


def _violations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage().lower()
    ]


async def test_a_worker_that_may_not_write_streams_still_gets_a_duplicate_job_counted(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    worker = await fleet.start_worker("w-dup")
    await submit_paths(fleet.admin, fleet.settings, TARGET, ["/page/1"], "first")

    async def one_commit() -> bool:
        return await committed(fleet.admin, TARGET) == 1

    await wait_for(one_commit, 20, "the first job to commit")
    # The same unit of work again, as another job: its grant finds the key committed.
    await submit_paths(fleet.admin, fleet.settings, TARGET, ["/page/1"], "again")

    async def recorded() -> bool:
        return [d.job_id for d in await _duplicates(fleet.admin)] == ["again-0"]

    await wait_for(recorded, 20, "the second job's duplicate record")
    [dup] = await _duplicates(fleet.admin)
    assert (dup.committed_by, dup.via) == ("first-0", "already-done")
    assert worker.stats["already-done"] == 1
    status = await confirmed_status(fleet.admin, fleet.settings)
    assert status.conserved, status
    assert status.totals.committed == 2, "the duplicate counts as committed"
    assert await committed(fleet.admin, TARGET) == 1, "one side effect"
    assert _violations(caplog) == [], "the worker used a subject outside its permissions"


async def test_the_sink_records_a_suppressed_duplicate_before_it_answers(fleet: Fleet) -> None:
    nc = await fleet.as_worker("w-race")
    leases = LeaseClient(nc)
    # Two jobs of one unit of work, both granted before either commits (a race).
    first = order_for(fleet.settings, "/page/2")
    second = order_for(fleet.settings, "/page/2")
    assert first.key == second.key
    fences = [await grant_fence(leases, order, "w-race") for order in (first, second)]
    assert (await report(nc, first, fences[0], "w-race")).status == "committed"
    reply = await report(nc, second, fences[1], "w-race")
    assert reply.status == "suppressed:duplicate-key" and reply.committed_by == first.job.id
    # Stored before the answer came: no wait.
    [dup] = await _duplicates(fleet.admin)
    assert (dup.job_id, dup.committed_by, dup.via) == (second.job.id, first.job.id, "suppressed")
    # The same report again (an answer lost) is answered alike and recorded once.
    assert (await report(nc, second, fences[1], "w-race")).status == reply.status
    assert len(await _duplicates(fleet.admin)) == 1


async def _ask_lease(nc: NatsClient, fleet: Fleet, job: str, path: str) -> LeaseReply:
    # Longer than a worker waits: the leaser tries its record for a few seconds.
    order = order_for(fleet.settings, path, id=job)
    request = msgspec.json.encode(ask(order, worker="w-patient"))
    answer = await nc.request(subjects.LEASE, request, timeout=20.0)
    return msgspec.json.decode(answer.data, type=LeaseReply)


async def test_the_leaser_answers_busy_while_the_duplicate_record_cannot_be_stored(
    fleet: Fleet,
) -> None:
    nc = await fleet.as_worker("w-patient")
    leases = LeaseClient(nc)
    first = order_for(fleet.settings, "/page/3")
    assert (await report(nc, first, await grant_fence(leases, first, "w"), "w")).status == (
        "committed"
    )
    await fleet.admin.delete_stream(subjects.STREAM_DUPLICATES)  # the record cannot land
    reply = await _ask_lease(nc, fleet, "second", "/page/3")
    assert isinstance(reply, LeaseRefusal) and reply.reason == "busy", reply
    assert "duplicate record was not stored" in reply.detail
    await declare(fleet.admin, fleet.settings)  # the stream is back
    reply = await _ask_lease(nc, fleet, "second", "/page/3")
    assert isinstance(reply, LeaseAlreadyDone) and reply.committed_by == first.job.id, reply
    assert [d.job_id for d in await _duplicates(fleet.admin)] == ["second"]


async def test_a_worker_that_may_not_write_streams_still_gets_a_malformed_order_kept(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    garbage = b'{"job": "not a work order"'
    ack = await fleet.admin.publish(subjects.work(TARGET, "normal"), garbage)
    await fleet.start_worker("w-bad")

    async def gone() -> bool:
        info = await fleet.admin.stream_info(subjects.STREAM_WORK)
        return info.state.messages == 0

    await wait_for(gone, 20, "the malformed order to be terminated")
    [kept] = await _rejections(fleet.admin)
    assert kept.reason == "malformed-work-order"
    assert (kept.subject, kept.raw, kept.raw_size) == (
        subjects.work(TARGET, "normal"),
        garbage,
        len(garbage),
    )
    assert "could not be decoded" in kept.message
    assert ack.seq >= 1
    assert _violations(caplog) == [], "the worker used a subject outside its permissions"


async def _report_malformed(nc: NatsClient, report: Malformed) -> SinkReply:
    answer = await nc.request(
        subjects.sink_report(TARGET), msgspec.json.encode(report), timeout=10.0
    )
    return msgspec.json.decode(answer.data, type=SinkReply)


async def test_a_malformed_report_keeps_only_an_undecodable_order_the_stream_holds(
    fleet: Fleet,
) -> None:
    nc = await fleet.as_worker("w-forger")
    subject = subjects.work(TARGET, "normal")
    good = order_for(fleet.settings, "/page/4")
    good_seq = (await fleet.admin.publish(subject, msgspec.json.encode(good))).seq
    bad_seq = (await fleet.admin.publish(subject, b"\xff not json")).seq

    def malformed(seq: int, on: str = subject, raw: bytes = b"") -> Malformed:
        return Malformed(worker="w-forger", subject=on, stream_seq=seq, error="x", raw=raw)

    forged = {
        "a real job's order": malformed(good_seq),
        "no such message": malformed(bad_seq + 100),
        "another subject": malformed(bad_seq, on=subjects.work(TARGET, "bulk")),
        "other bytes": malformed(bad_seq, raw=b"something else"),
    }
    for what, forgery in forged.items():
        reply = await _report_malformed(nc, forgery)
        assert reply.status == "error", (what, reply)
        assert reply.detail.startswith("malformed-order report refused:"), (what, reply)
    # Another target's work on this target's subject is refused before any read.
    elsewhere = malformed(bad_seq, on=subjects.work("other", "normal"))
    assert (await _report_malformed(nc, elsewhere)).status == "error"
    assert await _rejections(fleet.admin) == []
    # The real one is kept, once however often it is reported, with the stored bytes.
    for _ in range(2):
        reply = await _report_malformed(nc, malformed(bad_seq, raw=b"\xff not"))
        assert reply.status == "kept:malformed-work-order", reply
    [kept] = await _rejections(fleet.admin)
    assert kept.raw == b"\xff not json" and kept.subject == subject
    with pytest.raises(nats.errors.TimeoutError):  # and the worker cannot write it itself
        await nc.jetstream(timeout=1.0).publish(subjects.rejected(TARGET), b"forged")
