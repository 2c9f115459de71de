"""Review finding 4: a drain while the leaser stalls must not spend the attempt of a job
that never ran.

The worker asks for a lease, the leaser stalls (every call waits, in order, as in a GC
pause or a SIGSTOP), the worker is drained and gives the job back. When the leaser
resumes it still makes the grant the worker stopped waiting for: unless that grant is
undone, the next delivery is refused ``held`` until its TTL, and its grant counts as a
second attempt, so a one-attempt job ends ``attempts-exhausted`` without a request.
Real nats-server, redis-server, leaser, sink and simulator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from jetfleet.schemas.lease import LeaseRelease, LeaseRenew, LeaseReply, LeaseRequest
from jetfleet.services.leaser import Leaser
from nats.aio.client import Client as NatsClient

from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.worker import Worker
from tests.conftest import make_settings, sim_target, wait_for
from tests.queueing.helpers import committed, dead
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(90)


class StallingLeaser(Leaser):
    """The real leaser, whose calls all wait, in arrival order, until ``resume``."""

    def __init__(self, settings: Settings, nc: NatsClient) -> None:
        super().__init__(settings, nc)
        self.resume = asyncio.Event()
        self.grant_asks = 0
        self._in_order = asyncio.Lock()

    async def handle(self, call: LeaseRequest | LeaseRenew | LeaseRelease) -> LeaseReply:
        if isinstance(call, LeaseRequest):
            self.grant_asks += 1
        async with self._in_order:
            await self.resume.wait()
            return await super().handle(call)


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    one_attempt = msgspec.structs.replace(sim_target(simulator), max_attempts=1)
    return make_settings(nats_url, redis_url, {"demo": one_attempt})


@pytest.fixture
async def stalling(settings: Settings, services: InProcessStack) -> AsyncIterator[StallingLeaser]:
    assert services.leaser is not None
    await services.leaser.drain(2.0)
    leaser = StallingLeaser(settings, await connect_nats(settings.nats, "stalling-leaser"))
    await leaser.start()
    services.leaser = leaser  # the stack drains it at the end
    services.connections.append(leaser.nc)
    yield leaser
    leaser.resume.set()


async def test_finding4_a_drain_while_the_leaser_stalls_does_not_spend_the_jobs_attempt(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    stalling: StallingLeaser,
    simulator: TargetSimulator,
) -> None:
    one_slot = msgspec.structs.replace(
        settings, worker=msgspec.structs.replace(settings.worker, concurrency=1)
    )
    first = Worker(one_slot, await connect_nats(settings.nats, "w-first"), "w-first")
    await first.start()
    js = nc.jetstream()
    await submit_jobs(js, settings, "demo", jobs_for("demo", settings, ["/page/4"]))

    async def asked(n: int) -> bool:
        return stalling.grant_asks >= n

    await wait_for(lambda: asked(1), 20, "the first worker's lease ask")
    drain = asyncio.create_task(first.drain(timeout_s=0.2))

    async def gave_up() -> bool:
        # Fixed: the worker asks once more before it gives the job back; before the fix
        # it naked at once and the drain ended.
        return stalling.grant_asks >= 2 or drain.done()

    await wait_for(gave_up, 20, "the drain to give up on the lease")
    stalling.resume.set()
    await asyncio.wait_for(drain, 20)
    await first.nc.close()

    await services.add_worker("w-second")

    async def ended() -> bool:
        return await committed(js, "demo") + await dead(js, "demo") >= 1

    await wait_for(ended, 40, "the job to end")
    # Before the fix: dead-lettered attempts-exhausted, and the target never asked.
    assert (await committed(js, "demo"), await dead(js, "demo")) == (1, 0)
    assert simulator.counts()["total"] == 1
