"""A settled job's place and every subnet hold it has are freed at once, in one Redis
round trip (the sink's path on every settle), and nothing of another job goes with
them. On real redis-server."""

from __future__ import annotations

import redis.asyncio as aioredis

from jetfleet import inflight_caps, subnet_holds
from jetfleet.settings import Settings
from jetfleet.target_places import TargetPlaces


async def test_free_drops_the_settled_jobs_place_and_every_subnet_hold_and_nothing_else(
    settings: Settings, redis_client: aioredis.Redis
) -> None:
    target = next(iter(settings.targets))
    places = TargetPlaces(settings)
    assert places._free_settled is not None  # the one-round-trip path is the one tested
    try:
        for job in ("job-a", "job-b"):
            assert await places.take(target, job, cap=10) == "taken"
        # job-a asked from two subnets (a retry elsewhere), job-b from a third.
        assert await places.hold_subnet(target, "job-a", "w-1", "10.0.1.0/24") == "taken"
        assert await places.hold_subnet(target, "job-a", "w-3", "10.0.3.0/24") == "taken"
        assert await places.hold_subnet(target, "job-b", "w-2", "10.0.2.0/24") == "taken"
        await places.free(target, "job-a")
        left_places = await redis_client.zrange(inflight_caps.KEY_PREFIX + target, 0, -1)
        left_holds = await redis_client.zrange(subnet_holds.KEY_PREFIX + target, 0, -1)
        assert left_places == [b"job-b"]
        assert left_holds == [subnet_holds.member("job-b", "w-2", "10.0.2.0/24").encode()]
        assert (await places.counts())[target] == 1
    finally:
        await places.close()
