"""The backstop lands a job's sealed commit whose key another job committed first, and
records the job as that commit's duplicate, so it is still counted (I3)."""

from __future__ import annotations

import msgspec
import pytest
from jetfleet.schemas import CommittedResult, Duplicate, NoopOutput, WorkOrder
from jetfleet.schemas.lease import SealedCommit

from jetfleet import subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.leader_reads import last_message
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.status import fleet_status
from jetfleet.settlement import land
from jetfleet.simulator import TargetSimulator
from tests.leasing import VERSIONS
from tests.test_unrunnable import (
    dead_reasons,
    publish_advisory,
    running,
    unrunnable_settings,
    wait_queued,
)

pytestmark = pytest.mark.timeout(120)


def _result(order: WorkOrder, fence: int) -> CommittedResult:
    return CommittedResult(
        job_id=order.job.id,
        target=order.target,
        url=order.job.url,
        key=order.key,
        handler=order.job.handler,
        worker="w-gone",
        attempt=1,
        duration_s=0.01,
        output=NoopOutput(),
        versions=VERSIONS,
        fence=fence,
    )


async def test_backstop_records_a_duplicate_for_a_sealed_commit_another_job_beat_to_the_key(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=0) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        jobs = jobs_for("demo", settings, ["/page/same", "/page/same"])  # one key
        await submit_jobs(js, settings, "demo", jobs)
        await wait_queued(nc, 2, "both work orders")
        info = await js.stream_info(subjects.STREAM_WORK)
        orders = {}
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            stored = await js.get_msg(subjects.STREAM_WORK, seq=seq, direct=False)
            orders[seq] = msgspec.json.decode(stored.data or b"", type=WorkOrder)
        (seq_a, a), (seq_b, b) = sorted(orders.items())
        assert a.key == b.key
        store = await LeaseStore.open(js)
        # B committed the key, and its worker acked B.
        sealed_b = SealedCommit(fence=5, result=_result(b, 5))
        assert await store.seal(b.job.id, sealed_b, await store.read_history(b.job.id))
        assert (await land(js, sealed_b)).status == "committed"
        await js.delete_msg(subjects.STREAM_WORK, seq_b)
        # A ran too; its sink sealed and landed it (suppressed, committed by B), but A's
        # worker died before recording the duplicate and acking, on its last delivery.
        sealed_a = SealedCommit(fence=7, result=_result(a, 7))
        assert await store.seal(a.job.id, sealed_a, await store.read_history(a.job.id))
        reply = await land(js, sealed_a)
        assert reply.status == "suppressed:duplicate-key" and reply.committed_by == b.job.id
        await publish_advisory(nc, seq_a)

        await wait_queued(nc, 0, "A's work order removed by the backstop")
        assert await dead_reasons(nc) == {}
        stored_dup = await last_message(
            js, subjects.STREAM_DUPLICATES, subjects.duplicates(a.target)
        )
        assert stored_dup is not None, "no duplicate recorded for A"
        record = msgspec.json.decode(stored_dup.data or b"", type=Duplicate)
        assert (record.job_id, record.committed_by) == (a.job.id, b.job.id)
        totals = (await fleet_status(js, settings)).totals
        # Two submissions, both settled by B's commit: B committed, A its duplicate.
        assert (totals.submitted, totals.committed, totals.dead) == (2, 2, 0), totals
