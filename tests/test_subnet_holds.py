"""The subnet-hold scripts (jetfleet/subnet_holds.py) against a real redis-server: one
worker of a subnet holds a target, others of the subnet wait, other subnets do not, and
the hold passes on as soon as the owner's last job lets go (or its lease time runs out)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from jetfleet.inflight_caps import CapsUnavailable
from jetfleet.subnet_holds import OWN_ONLY, SubnetHolds, canonical_subnet
from tests.conftest import wait_for

NET = "10.1.0.0/24"
TTL_S = 30.0


@pytest.fixture
def holds(redis_client: aioredis.Redis) -> SubnetHolds:
    return SubnetHolds(redis_client)


async def test_one_worker_of_a_subnet_holds_a_target_and_others_of_it_are_refused(
    holds: SubnetHolds,
) -> None:
    assert await holds.take("shop", "j1", "w-a1", NET, TTL_S) == "taken"
    assert await holds.take("shop", "j2", "w-a1", NET, TTL_S) == "taken"  # same worker: more
    left = await holds.take("shop", "j3", "w-a2", NET, TTL_S)
    assert isinstance(left, float) and TTL_S - 1 < left <= TTL_S
    # Another subnet, another target, or no conflict: held beside it.
    assert await holds.take("shop", "j4", "w-b1", "10.2.0.0/24", TTL_S) == "taken"
    assert await holds.take("blog", "j5", "w-a2", NET, TTL_S) == "taken"


async def test_a_take_says_whether_it_made_the_hold_or_found_it(holds: SubnetHolds) -> None:
    # A grant made again (or another ask of the same worker and job) finds the member:
    # it is not that ask's to drop when it leads to no lease.
    assert await holds.take("shop", "j1", "w-a1", NET, TTL_S) == "taken"
    assert await holds.take("shop", "j1", "w-a1", NET, TTL_S) == "kept"


async def test_own_only_lets_in_only_a_worker_that_holds_the_target_for_the_subnet(
    holds: SubnetHolds,
) -> None:
    # After an outage: nobody of the subnet holds it, so nobody new is let in...
    assert await holds.take("shop", "j1", "w-a2", NET, TTL_S, own_only=True) == OWN_ONLY
    # ...until a running job's renewal restores its holder's hold (not own-only)...
    assert await holds.take("shop", "j0", "w-a1", NET, TTL_S) == "taken"
    # ...after which its worker's new grants hold it too, and others wait as ever.
    assert await holds.take("shop", "j2", "w-a1", NET, TTL_S, own_only=True) == "taken"
    assert isinstance(await holds.take("shop", "j1", "w-a2", NET, TTL_S, own_only=True), float)
    assert await holds.take("shop", "j3", "w-b1", "10.2.0.0/24", TTL_S) == "taken"


async def test_the_hold_passes_on_when_the_owners_last_job_lets_go(holds: SubnetHolds) -> None:
    await holds.take("shop", "j1", "w-a1", NET, TTL_S)
    await holds.take("shop", "j2", "w-a1", NET, TTL_S)
    await holds.drop("shop", "j1")
    assert isinstance(await holds.take("shop", "j3", "w-a2", NET, TTL_S), float)  # j2 holds
    await holds.drop("shop", "j2")
    assert await holds.take("shop", "j3", "w-a2", NET, TTL_S) == "taken"
    # A renewal of a job whose hold was dropped does not bring it back.
    assert await holds.keep("shop", "j2", "w-a1", NET, TTL_S) is False
    assert isinstance(await holds.take("shop", "j6", "w-a1", NET, TTL_S), float)


async def _redis_s(client: aioredis.Redis) -> float:
    seconds, micros = await client.time()
    return seconds + micros / 1e6


async def test_a_hold_runs_out_with_its_lease_time_unless_kept(
    holds: SubnetHolds, redis_client: aioredis.Redis
) -> None:
    started = await _redis_s(redis_client)
    await holds.take("shop", "j1", "w-a1", NET, 0.3)
    await holds.take("shop", "j2", "w-a1", NET, 0.3)
    assert await holds.keep("shop", "j2", "w-a1", NET, 3.0)

    async def past_j1s_time() -> bool:
        return await _redis_s(redis_client) > started + 0.35

    await wait_for(past_j1s_time, 5, "j1's hold to run out by Redis's clock")
    # j1's ran out; j2's was kept, so the subnet's target is still w-a1's.
    assert isinstance(await holds.take("shop", "j3", "w-a2", NET, TTL_S), float)
    await holds.drop("shop", "j2")
    assert await holds.take("shop", "j3", "w-a2", NET, TTL_S) == "taken"


async def test_an_ask_that_led_to_no_lease_drops_only_its_own_hold(holds: SubnetHolds) -> None:
    await holds.take("shop", "j1", "w-a1", NET, TTL_S)
    await holds.take("shop", "j1", "w-b1", "10.2.0.0/24", TTL_S)  # a rival ask, same job
    await holds.drop_member("shop", "j1", "w-b1", "10.2.0.0/24")
    assert isinstance(await holds.take("shop", "j2", "w-a2", NET, TTL_S), float)  # w-a1's stays


def test_a_subnet_is_written_one_way() -> None:
    assert canonical_subnet(" 10.1.0.0/24 ") == "10.1.0.0/24"
    assert canonical_subnet("2001:DB8::/64") == "2001:db8::/64"
    with pytest.raises(ValueError):
        canonical_subnet("10.1.0.5/24")


async def test_redis_unreachable_fails_closed() -> None:
    client = aioredis.from_url("redis://127.0.0.1:1", socket_connect_timeout=0.5)
    try:
        with pytest.raises(CapsUnavailable):
            await SubnetHolds(client).take("shop", "j1", "w-a1", NET, TTL_S)
    finally:
        await client.aclose()
