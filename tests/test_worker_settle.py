"""The worker gives a job back promptly when it cannot settle it, never leaving it to
the ack wait: the sink failing, the sink unreachable, and a drain while every slot is
held by a job that hangs. Real servers; the sink is stopped or stood in for."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
from jetfleet.schemas import HandlerOutput, NoopOutput, SinkReply
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.worker import Worker
from jetfleet.worker.handlers import HandlerContext, handler
from jetfleet.worker.runtime import HAND_BACK_MAX_S, MIN_REFUSAL_DELAY_S
from tests.conftest import make_settings, sim_target, wait_for
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(90)
ACK_WAIT_S = 30.0
HANG = asyncio.Event()


@handler("test.hang")
async def hang(ctx: HandlerContext) -> HandlerOutput:
    await HANG.wait()
    return NoopOutput()


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """A long ack wait, so a prompt redelivery cannot be the ack wait's; 5 attempts."""
    target = msgspec.structs.replace(sim_target(simulator), max_attempts=5)
    return make_settings(
        nats_url, redis_url, {"demo": target}, ack_wait_s=ACK_WAIT_S, handlers=("test.hang",)
    )


async def test_a_sink_error_gives_the_job_back_at_once_and_spends_the_attempt(
    settings: Settings, nc: NatsClient, stack: InProcessStack, store: LeaseStore
) -> None:
    assert stack.sink is not None
    await stack.sink.drain(5.0)
    errors: list[int] = []

    async def fail(msg: Msg) -> None:
        errors.append(1)
        await nc.publish(msg.reply, msgspec.json.encode(SinkReply(status="error", detail="x")))

    stand_in = await nc.subscribe(f"{subjects.SINK_REPORT}.*", queue=subjects.QUEUE_SINK, cb=fail)
    await nc.flush()
    [job] = jobs_for("demo", settings, ["/page/1"])
    await submit_jobs(nc.jetstream(), settings, "demo", [job])

    async def failed_twice() -> bool:
        return len(errors) >= 2

    # Twice within a third of the ack wait: the worker gave the job back itself.
    await wait_for(failed_twice, ACK_WAIT_S / 3, "the job to be run again after a sink error")
    await stack.start_sink()
    await stand_in.unsubscribe()

    async def committed() -> bool:
        return (await stack.status()).totals.committed == 1

    await wait_for(committed, ACK_WAIT_S / 3, "the job to commit once the sink is back")
    assert (await stack.status()).totals.dead == 0
    # A sink error may be the job's own, so each one spent an attempt.
    assert (await store.highest_fence(job.id)).grants >= 3
    assert stack.workers[0].stats["sink-error"] >= 2


async def test_an_unreachable_sink_is_sent_the_same_report_again_and_the_page_fetched_once(
    settings: Settings,
    nc: NatsClient,
    stack: InProcessStack,
    store: LeaseStore,
    simulator: TargetSimulator,
) -> None:
    assert stack.sink is not None
    await stack.sink.drain(5.0)
    # One attempt only: had the outage spent it, the job would end dead-lettered.
    [job] = jobs_for("demo", settings, ["/page/2"], max_attempts=1)
    await submit_jobs(nc.jetstream(), settings, "demo", [job])
    worker = stack.workers[0]

    async def asked_twice() -> bool:
        return worker.stats["sink-unreachable"] >= 2

    await wait_for(asked_twice, ACK_WAIT_S / 2, "the report to be sent twice")
    await stack.start_sink()

    async def committed() -> bool:
        return (await stack.status()).totals.committed == 1

    await wait_for(committed, ACK_WAIT_S / 2, "the job to commit once the sink is back")
    assert (await stack.status()).totals.dead == 0
    assert (await store.highest_fence(job.id)).grants == 1
    # Held (lease renewed) over the outage, never given back to run again.
    assert simulator.counts()["by_path_kind"] == {"page": 1}


async def test_drain_returns_and_gives_back_a_hung_job_while_every_slot_is_busy(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    one_slot = msgspec.structs.replace(
        settings, worker=msgspec.structs.replace(settings.worker, concurrency=1)
    )
    worker_nc = await connect_nats(settings.nats, "w-hang")
    worker = Worker(one_slot, worker_nc, "w-hang")
    await worker.start()
    try:
        jobs = jobs_for("demo", settings, ["/page/3", "/page/4"], handler="test.hang")
        await submit_jobs(nc.jetstream(), settings, "demo", jobs)

        async def one_leased() -> bool:
            return any([await store.live(j.id) is not None for j in jobs])

        await wait_for(one_leased, 10, "the first job to be running")
        # The pull loop now waits for the only slot, which the hung job holds.
        await asyncio.wait_for(worker.drain(timeout_s=1.0), timeout=10)
        assert [await store.live(j.id) for j in jobs] == [None, None]
        # A deploy's drain does not spend the attempt of the job it interrupted.
        assert [(await store.highest_fence(j.id)).grants for j in jobs] == [0, 0]
    finally:
        await worker_nc.close()


async def test_a_refusal_about_the_job_backs_off_to_one_ask_per_two_seconds(
    settings: Settings, nc: NatsClient
) -> None:
    # A job pinned to an identity no worker has is refused wrong-identity (retry after
    # 0) on every delivery; its nak delay doubles per delivery up to HAND_BACK_MAX_S.
    worker = Worker(settings, nc, "w-pin")

    def delay(deliveries: int) -> float:
        delivery = SimpleNamespace(metadata=SimpleNamespace(num_delivered=deliveries))
        return worker._growing_delay(delivery)  # type: ignore[arg-type]

    for n in range(1, 12):
        low = min(HAND_BACK_MAX_S, MIN_REFUSAL_DELAY_S * 2 ** (n - 1)) / 2
        assert low <= delay(n) <= 2 * low
    assert min(delay(40) for _ in range(100)) >= HAND_BACK_MAX_S / 2


async def test_a_job_pinned_to_an_identity_nobody_has_is_asked_more_slowly_at_first(
    settings: Settings, nc: NatsClient, stack: InProcessStack
) -> None:
    assert stack.leaser is not None
    answers = stack.leaser.answers
    [job] = jobs_for("demo", settings, ["/page/5"], pin_identity="nobody")
    await submit_jobs(nc.jetstream(), settings, "demo", [job])
    refusals: list[float] = []
    loop = asyncio.get_running_loop()

    async def refused(times: int) -> bool:
        count = sum(
            n for labels, n in answers.values.items() if dict(labels)["reason"] == "wrong-identity"
        )
        refusals.extend([loop.time()] * (count - len(refusals)))
        return count >= times

    await wait_for(lambda: refused(6), 30, "six wrong-identity refusals")
    # Naks of at least 0.25, 0.25, 0.5, 1 and 1 s (half of 0.25 s doubling, jittered):
    # at a fixed 0.25 s, as before, six refusals took 1.25 s.
    assert refusals[5] - refusals[0] >= 3.0 - 0.1
    totals = (await stack.status()).totals
    assert totals.queued + totals.leased == 1 and totals.dead == 0  # waiting, not lost
