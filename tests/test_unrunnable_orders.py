"""A work order whose key is no idempotency key (a space, a wildcard, empty, too long).

The leaser refuses every lease for such a key as malformed, so the worker naked it and
asked again: found by tests/test_fuzz_wire.py, 111 refused lease calls in 30 s for six
orders, each to go on until ``fleet.max_deliver`` ran out. The worker now keeps it on
``jf.rejected`` (``malformed-work-order``, with its bytes) before any lease, as it does an
order naming another target (tests/test_order_target_mismatch.py), and ends it. Real
servers: nats-server, a target simulator, scheduler, leaser, sink and one worker.
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
from jetfleet.unrunnable_orders import unrunnable
from tests.conftest import wait_for
from tests.queueing.helpers import queue_settings, target
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)
HOME = "home"
BAD_KEYS = ("a b", "*", "a..b", "", "k" * 300)


def _order(key: str, url: str = "http://127.0.0.1:1/x") -> WorkOrder:
    job = Job(id="bad-key", url=url)
    return WorkOrder(job=job, target=HOME, key=key, max_attempts=3, timeout_s=5.0)


@pytest.mark.parametrize("key", BAD_KEYS)
def test_an_order_with_a_key_the_leaser_refuses_is_unrunnable(key: str) -> None:
    objection = unrunnable(_order(key), subjects.work(HOME, "normal"))
    assert objection is not None and objection[0] == "malformed-work-order"
    assert "is not an idempotency key" in objection[1]


def test_an_order_with_a_derived_key_on_its_own_subject_is_runnable() -> None:
    assert unrunnable(_order("u-" + "0" * 40), subjects.work(HOME, "bulk")) is None


@pytest.fixture
async def env(
    nats_url: str, redis_url: str
) -> AsyncIterator[tuple[InProcessStack, JetStreamContext, TargetSimulator]]:
    async with TargetSimulator(SimulatorConfig()) as site:
        stack = InProcessStack(
            queue_settings(nats_url, redis_url, {HOME: target(site.base_url)}, concurrency=2)
        )
        await stack.start(workers=1)
        try:
            yield stack, stack.connections[0].jetstream(), site
        finally:
            await stack.stop()


async def test_an_order_with_a_bad_key_is_kept_unrun_and_ended(
    env: tuple[InProcessStack, JetStreamContext, TargetSimulator],
) -> None:
    stack, js, site = env
    order = _order("a b*", site.base_url + "/page/1")
    data = msgspec.json.encode(order)
    await publish_durably(js, subjects.work(HOME, "normal"), data, msg_id="bad-key")

    async def kept() -> bool:
        return await count_messages(js, subjects.STREAM_REJECTED, "jf.rejected.>") == 1

    await wait_for(kept, 30, "the order kept on jf.rejected")
    (msg,) = [m async for m in read_stream(js, subjects.STREAM_REJECTED, "jf.rejected.>")]
    rejection = msgspec.json.decode(msg.data, type=Rejection)
    assert msg.subject == subjects.rejected(HOME)
    assert rejection.reason == "malformed-work-order", rejection
    assert "'a b*' is not an idempotency key" in rejection.message, rejection.message
    assert "was not run" in rejection.message
    assert rejection.raw == data

    async def gone_from_work() -> bool:
        return (await js.stream_info(subjects.STREAM_WORK)).state.messages == 0

    await wait_for(gone_from_work, 10, "the order terminated")
    assert site.counts()["total"] == 0  # never run
    assert stack.leaser is not None
    refused = stack.leaser.responder.refused
    assert refused.get(subject=subjects.LEASE, reason="malformed") == 0  # never asked
