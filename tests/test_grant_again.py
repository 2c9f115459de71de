"""A grant found again (the same delivery asking again after its answer was late) while
the leaser replica that made it has not yet recorded it: the attempt number must count
that grant, once, whichever of the two records it first."""

from __future__ import annotations

from jetfleet.schemas.lease import LeaseRecord
from nats.aio.client import Client as NatsClient

from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings
from tests.leasing import ask, granted, order_for
from tests.stack import InProcessStack

DELIVERY = "$JS.ACK.JF_WORK.work-demo-normal.1.2.2.0.0"


async def test_a_grant_asked_again_before_its_record_landed_reports_its_own_attempt(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/1")
    first = await granted(client, ask(order, worker="w-a"))
    assert first.attempt == 1 and await client.release(order.job.id, first.fence)

    # The test plays a leaser replica that made the second grant (its create landed) and
    # stalled before recording it; the worker stopped waiting and asks again.
    read = await store.read_history(order.job.id)
    record = LeaseRecord(
        job_id=order.job.id, target=order.target, worker="w-a", reply_subject=DELIVERY
    )
    fence = await store.create(record, settings.fleet.lease_ttl_s)
    assert fence is not None
    again = await granted(client, ask(order, worker="w-a", reply_subject=DELIVERY))
    # Before the fix: attempt 1 (the count read before the stalled record landed), so a
    # job granted again after its last attempt could run once more than max_attempts.
    assert (again.fence, again.attempt) == (fence, 2)

    # The stalled replica's record lands late: still one grant for that fence.
    recorded = await store.record_grant(order.job.id, fence, read)
    assert (recorded.fence, recorded.grants) == (fence, 2)
    assert (await store.highest_fence(order.job.id)).grants == 2

    # And the next grant is the third attempt.
    assert await client.release(order.job.id, fence)
    assert (await granted(client, ask(order, worker="w-b"))).attempt == 3
