"""A work order whose body names another target than the work subject it came on.

The lease is granted for the subject's target, so the sink (which trusts only what the
leaser granted) refuses its report ``rejected:not-granted``; left for redelivery, such a
job ran again and again (up to ``fleet.max_deliver`` deliveries) and ended nowhere for
hours. The worker refuses it before any lease or request: kept on ``jf.rejected`` with
its bytes and terminated. Real servers: nats-server, a target simulator, scheduler,
leaser, sink and one worker in this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
from jetfleet.schemas import Job, Rejection, WorkOrder
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.publish import publish_durably
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import count_messages, read_stream
from tests.conftest import wait_for
from tests.queueing.helpers import committed, dead, queue_settings, target
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)
HOME, OTHER = "home", "other"


@pytest.fixture
async def env(
    nats_url: str, redis_url: str
) -> AsyncIterator[tuple[InProcessStack, JetStreamContext, TargetSimulator]]:
    async with TargetSimulator(SimulatorConfig()) as site:
        targets = {HOME: target(site.base_url), OTHER: target(site.base_url)}
        stack = InProcessStack(queue_settings(nats_url, redis_url, targets, concurrency=2))
        await stack.start(workers=1)
        try:
            yield stack, stack.connections[0].jetstream(), site
        finally:
            await stack.stop()


async def test_an_order_naming_another_target_than_its_subject_is_rejected_unrun(
    env: tuple[InProcessStack, JetStreamContext, TargetSimulator],
) -> None:
    stack, js, site = env
    # Straight onto home's work subject, as any NATS client could: its body says other.
    job = Job(id="crossed", url=site.base_url + "/page/1")
    order = WorkOrder(job=job, target=OTHER, key="crossed-key", max_attempts=3, timeout_s=5.0)
    await publish_durably(
        js, subjects.work(HOME, "normal"), msgspec.json.encode(order), msg_id="crossed"
    )

    async def kept() -> bool:
        return await count_messages(js, subjects.STREAM_REJECTED, "jf.rejected.>") == 1

    await wait_for(kept, 30, "the crossed order kept on jf.rejected")
    (msg,) = [m async for m in read_stream(js, subjects.STREAM_REJECTED, "jf.rejected.>")]
    rejection = msgspec.json.decode(msg.data, type=Rejection)
    assert msg.subject == subjects.rejected(HOME)
    assert rejection.reason == "work-order-target-mismatch", rejection
    assert OTHER in rejection.message and HOME in rejection.message, rejection.message
    assert rejection.raw == msgspec.json.encode(order)

    async def gone_from_work() -> bool:
        return (await js.stream_info(subjects.STREAM_WORK)).state.messages == 0

    await wait_for(gone_from_work, 10, "the crossed order terminated")
    # Never leased, never run, never reported: nothing at the site, nothing settled.
    assert site.counts()["total"] == 0
    assert stack.workers[0].stats["rejected:not-granted"] == 0
    assert await committed(js, OTHER) == 0 and await committed(js, HOME) == 0
    assert await dead(js, OTHER) == 0 and await dead(js, HOME) == 0
