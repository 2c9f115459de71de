"""The leaser's subnet holds (one worker per egress subnet and target) where a grant goes
wrong: an ask that fails or is cancelled after taking, an ask that finds the holder's
hold, a release beside a newer holder, and Redis lost and back. The real leaser and
ratelimit over a real nats-server; a real redis-server (one of its own where it dies)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import LeaseRequest, WorkOrder
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.dev.embedded import EmbeddedRedis
from jetfleet.lease_client import LeaseClient
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.subnet_holds import OWN_ONLY
from jetfleet.target_places import TargetPlaces
from tests.conftest import make_settings, sim_target, wait_for
from tests.leasing import ask, granted, order_for, refused
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)

NET = "10.1.0.0/24"
OTHER_NET = "10.2.0.0/24"


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    return make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})


def subnet_ask(
    order: WorkOrder, worker: str, subnet: str = NET, sends_request: bool = False
) -> LeaseRequest:
    request = ask(order, worker=worker, sends_request=sends_request)
    return msgspec.structs.replace(request, subnet=subnet)


async def test_an_ask_cancelled_in_a_later_check_frees_its_place_and_subnet_hold(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    assert services.leaser is not None and services.ratelimit is not None
    # A permit asked at grant (a worker from before permits moved) that nobody answers:
    # the ask is cancelled while it waits, after it took a place and the subnet hold.
    await services.ratelimit.drain()
    services.ratelimit = None  # drained: the stack's stop must not drain it again
    asked = asyncio.Event()

    async def silent(_: Msg) -> None:
        asked.set()

    await nc.subscribe(subjects.RATELIMIT, cb=silent)
    await nc.flush()
    order = order_for(settings, "/page/1")
    grant = asyncio.create_task(
        services.leaser.grant(subnet_ask(order, "w-a1", sends_request=True))
    )

    async def waiting_for_its_permit() -> bool:
        return asked.is_set()

    await wait_for(waiting_for_its_permit, 10, "the grant to ask for its permit")
    grant.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await grant
    assert await services.leaser.places.counts() == {"demo": 0}
    # Another worker of the subnet is granted at once, not one lease TTL later.
    await granted(LeaseClient(nc), subnet_ask(order_for(settings, "/page/2"), "w-a2"))


async def test_an_ask_refused_after_finding_the_holders_hold_leaves_it(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    assert services.leaser is not None and services.ratelimit is not None
    places = services.leaser.places
    order = order_for(settings, "/page/3")
    # Another ask of this worker and job holds the target for the subnet (it is being
    # granted); this ask then finds no rate permit (the ratelimit service is gone).
    assert await places.hold_subnet("demo", order.job.id, "w-a1", NET) == "taken"
    await services.ratelimit.drain()
    services.ratelimit = None  # drained: the stack's stop must not drain it again
    reply = await refused(LeaseClient(nc), subnet_ask(order, "w-a1", sends_request=True))
    assert reply.reason == "ratelimit-unavailable"
    # The holder's hold stays: another worker of the subnet is still kept out.
    assert isinstance(await places.hold_subnet("demo", "job-2", "w-a2", NET), float)


async def test_a_released_lease_drops_only_its_own_holders_hold(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    assert services.leaser is not None
    places = services.leaser.places
    client = LeaseClient(nc)
    order = order_for(settings, "/page/4")
    first = await granted(client, subnet_ask(order, "w-a1"))
    # The job's next holder, of another subnet, took its hold before the first
    # holder's release freed what was its own (they race; here in that order).
    assert await places.hold_subnet("demo", order.job.id, "w-b1", OTHER_NET) == "taken"
    assert await client.release(order.job.id, first.fence) is True
    assert await places.hold_subnet("demo", "job-2", "w-a2", NET) == "taken"  # w-a1's went
    assert isinstance(await places.hold_subnet("demo", "job-3", "w-b2", OTHER_NET), float)


async def test_after_redis_lost_its_holds_a_subnets_target_goes_back_to_its_running_holder(
    tmp_path: Path, nats_url: str, simulator: TargetSimulator
) -> None:
    redis = EmbeddedRedis(tmp_path / "redis").start()
    settings = make_settings(nats_url, redis.url, {"demo": sim_target(simulator)})
    places = TargetPlaces(settings)
    try:
        assert await places.hold_subnet("demo", "job-a", "w-a1", NET) == "taken"
        port = redis.port
        redis.stop()
        # The running job's renewal cannot reach Redis (the job goes on)...
        assert await places.keep_subnet("demo", "job-a", "w-a1", NET) is True
        # ...and Redis comes back without its data.
        redis = EmbeddedRedis(tmp_path / "redis").start(port=port)

        async def answers() -> bool:
            return await places.reachable()

        await wait_for(answers, 10, "redis to answer again")
        # Another worker of the subnet is not let in while the holder may restore...
        assert await places.hold_subnet("demo", "job-b", "w-a2", NET) == OWN_ONLY
        # ...its running job's next renewal finds its hold gone and puts it back...
        assert await places.keep_subnet("demo", "job-a", "w-a1", NET) is False
        restored = await places.hold_subnet("demo", "job-a", "w-a1", NET, restore=True)
        assert restored == "taken"
        # ...and from then on it is the holder's, as before the outage.
        assert await places.hold_subnet("demo", "job-c", "w-a1", NET) == "taken"
        assert isinstance(await places.hold_subnet("demo", "job-b", "w-a2", NET), float)
        # Other subnets were never held back.
        assert await places.hold_subnet("demo", "job-d", "w-b1", OTHER_NET) == "taken"
    finally:
        await places.close()
        redis.stop()
