"""Politeness as the target sees it: the simulator counts what arrives, so these checks
do not trust the fleet's own counters. A dedicated target's ``max_in_flight`` (the
server's ``max_ack_pending`` of its tier's consumer, fleet-wide) bounds the requests it
is handling at once; every request carries the configured User-Agent.

Real servers: a fresh nats-server, scheduler + leaser + sink + two workers in process.
"""

from __future__ import annotations

import pytest

from jetfleet.connection import connect_nats
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.work_lanes import LaneMap
from tests.conftest import wait_for
from tests.queueing.helpers import committed, queue_settings, submit_paths, target
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(120)

CAP = 3
JOBS = 30
SLOW_S = 0.3


async def test_a_dedicated_targets_max_in_flight_caps_the_requests_the_target_handles_at_once(
    nats_url: str, redis_url: str
) -> None:
    async with TargetSimulator(SimulatorConfig()) as site:
        settings = queue_settings(
            nats_url, redis_url, {"capped": target(site.base_url, max_in_flight=CAP)}, 8
        )
        assert not LaneMap(settings).lane_of("capped").shared
        stack = InProcessStack(settings)
        await stack.start(workers=2)  # 16 slots for 3 places: the cap is what binds
        observer = await connect_nats(settings.nats, "observer")
        try:
            js = observer.jetstream()
            paths = [f"/slow/{n}?delay={SLOW_S}" for n in range(JOBS)]
            await submit_paths(js, settings, "capped", paths, "capped", handler="http.get")

            async def all_committed() -> bool:
                return await committed(js, "capped") == JOBS

            await wait_for(all_committed, 90, f"{JOBS} slow jobs committed")
        finally:
            await stack.stop()
            await observer.close()
        counts = site.counts()
    print(f"\ncap {CAP}: the target saw at most {counts['max_in_flight']} at once")
    assert counts["by_path_kind"] == {"slow": JOBS}
    most = counts["max_in_flight"]["slow"]
    assert most <= CAP, f"the target handled {most} requests at once, cap {CAP}"
    assert most == CAP, f"at most {most} at once: the cap {CAP} was never reached"


async def test_every_request_carries_the_fleets_user_agent_or_the_targets_own(
    nats_url: str, redis_url: str
) -> None:
    own_agent = "jetfleet-tests-special (+ops@example.org)"
    async with (
        TargetSimulator(SimulatorConfig()) as plain_site,
        TargetSimulator(SimulatorConfig()) as own_site,
    ):
        targets = {
            "plain": target(plain_site.base_url),
            "own": target(own_site.base_url, user_agent=own_agent),
        }
        settings = queue_settings(nats_url, redis_url, targets, 8)
        stack = InProcessStack(settings)
        await stack.start(workers=1)
        observer = await connect_nats(settings.nats, "observer")
        try:
            js = observer.jetstream()
            for name in targets:
                paths = [f"/page/{n}" for n in range(10)]
                await submit_paths(js, settings, name, paths, name, handler="http.get")

            async def all_committed() -> bool:
                return all([await committed(js, name) == 10 for name in targets])

            await wait_for(all_committed, 60, "every page committed")
        finally:
            await stack.stop()
            await observer.close()
        assert plain_site.counts()["by_user_agent"] == {settings.fleet.user_agent: 10}
        assert own_site.counts()["by_user_agent"] == {own_agent: 10}
    assert settings.fleet.user_agent.startswith("jetfleet-tests")
