"""Review findings 5 and 7 (part): what a worker does with a delivery once it cannot know (or
knows it does not) hold the job's lease any more.

Real nats-server and redis-server; the sink and the leaser are stopped mid-job so the
worker's calls go unanswered. Every ack, nak and term is observed on the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.connection import connect_nats
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import count_messages
from tests.conftest import make_settings, sim_target, wait_for
from tests.stack import InProcessStack
from tests.test_lost_lease import (
    ACK_WAIT_S,
    CANCELLED,
    ENTERED,
    GATES,
    TTL_S,
    AckWire,
    RecordingWorker,
    is_set,
    kinds,
    not_empty,
    publish_job,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    return make_settings(
        nats_url,
        redis_url,
        {"demo": sim_target(simulator)},
        lease_ttl_s=TTL_S,
        ack_wait_s=ACK_WAIT_S,
        handlers=("test.gate",),
    )


@pytest.fixture
async def wire(nc: NatsClient) -> AckWire:
    listening = AckWire()
    await listening.listen(nc)
    return listening


@pytest.fixture
async def worker(settings: Settings, services: InProcessStack) -> AsyncIterator[RecordingWorker]:
    one_slot = msgspec.structs.replace(
        settings, worker=msgspec.structs.replace(settings.worker, concurrency=1)
    )
    started = RecordingWorker(one_slot, await connect_nats(settings.nats, "w-a"), "w-a")
    await started.start()
    yield started
    GATES["w-a"].set()
    await started.drain(5.0)
    await started.nc.close()


async def stop_sink_and_leaser(services: InProcessStack) -> None:
    """Drain both (no responders from now on); the stack's stop skips them."""
    assert services.sink is not None and services.leaser is not None
    await services.sink.drain(2.0)
    await services.leaser.drain(2.0)
    services.sink = services.leaser = None


async def test_finding5_a_worker_that_counts_its_lease_lost_never_naks_an_unanswered_release(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    worker: RecordingWorker,
    wire: AckWire,
) -> None:
    # The handler is done, but neither the sink nor the leaser answers: the keeper counts
    # the lease lost after a TTL, the report gives up, the release goes unanswered.
    await publish_job(settings, nc)
    await wait_for(is_set(ENTERED["w-a"]), 20, "the handler to start")
    await stop_sink_and_leaser(services)
    GATES["w-a"].set()
    await wait_for(not_empty(worker.finished), 20, "the worker to be done with the delivery")
    await wire.everything_sent_by(worker)
    assert worker.stats["sink-unanswered"] == 1
    [(_, reply)] = worker.deliveries[:1]
    # Before the fix a -NAK followed, which JetStream applies to whichever delivery is
    # current; only the keeper's +WPI from before the stop may be there.
    assert set(kinds(wire.on(reply))) <= {"+WPI"}


async def test_finding5_a_worker_whose_leaser_goes_silent_counts_its_lease_lost_at_the_ttl(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    worker: RecordingWorker,
) -> None:
    # A leaser that takes calls and never answers: a renewal times out only after the
    # lease client's 3 s. The keeper must not wait that long past the TTL, or the ack wait
    # (only a second above the TTL) runs out on a handler that still runs.
    await publish_job(settings, nc)
    await wait_for(is_set(ENTERED["w-a"]), 20, "the handler to start")
    assert services.leaser is not None
    await services.leaser.drain(2.0)
    services.leaser = None
    await nc.subscribe(subjects.LEASE, queue="leaser", cb=_swallow)
    await nc.flush()
    silent_at = asyncio.get_running_loop().time()
    await wait_for(is_set(CANCELLED["w-a"]), 10, "the handler to be cancelled")
    took = asyncio.get_running_loop().time() - silent_at
    # The last renewal answered was sent before the silence: lost within a TTL of it.
    # Before the fix: 3 to 3.7 s (the renewal's own timeout came first).
    assert took < TTL_S + 0.6, f"lease counted lost {took:.2f} s after the leaser fell silent"


async def _swallow(msg: Msg) -> None:
    """A leaser that never answers."""


async def test_finding7_a_report_the_sink_never_takes_is_given_back_after_the_patience(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    wire: AckWire,
    store: LeaseStore,
) -> None:
    # The sink is away for good: the worker does not keep the lease, its slot and the
    # pending place for ever, but gives the job back, its attempt refunded.
    patient = msgspec.structs.replace(
        settings,
        worker=msgspec.structs.replace(settings.worker, concurrency=1, report_patience_s=2.0),
    )
    worker = RecordingWorker(patient, await connect_nats(settings.nats, "w-p"), "w-p")
    await worker.start()
    try:
        order = await publish_job(settings, nc)
        await wait_for(is_set(ENTERED["w-p"]), 20, "the handler to start")
        assert services.sink is not None
        await services.sink.drain(2.0)
        services.sink = None
        GATES["w-p"].set()
        await wait_for(not_empty(worker.finished), 20, "the worker to give the job back")
        await wire.everything_sent_by(worker)
        [(_, reply)] = worker.deliveries[:1]
        assert kinds(wire.on(reply))[-1] == "-NAK"
        assert worker.stats["sink-gave-up"] == 1
        assert (await store.highest_fence(order.job.id)).grants == 0  # refunded
        # The sink is back: the job runs again and commits.
        await services.start_sink()

        async def committed() -> bool:
            return (
                await count_messages(
                    nc.jetstream(), subjects.STREAM_RESULTS, subjects.results("demo")
                )
                == 1
            )

        await wait_for(committed, 30, "the job to commit once the sink is back")
    finally:
        GATES["w-p"].set()
        await worker.drain(5.0)
        await worker.nc.close()
