"""Review finding 2: deliveries that never spend an attempt must not hammer a target
nor use up ``max_deliver`` while the job could still run.

The first test runs the whole stack (nats-server, redis-server, the simulator as the
target); the others check the pacing rule docs/dead-letters.md states.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from jetfleet.ops.dead_letters import list_dead_letters
from jetfleet.settings import Settings, min_max_deliver, validate
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.worker.hand_back_pace import TARGET_BUSY_S, HandBackPace
from tests.conftest import make_settings, wait_for
from tests.queueing.helpers import dead, delivered, queue_settings, submit_paths, target
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(120)


def smallest_backstop(settings: Settings) -> Settings:
    fleet = msgspec.structs.replace(settings.fleet, max_deliver=min_max_deliver(settings))
    settings = msgspec.structs.replace(settings, fleet=fleet)
    validate(settings)
    return settings


async def test_finding2_a_retry_after_of_zero_backs_off_and_never_dead_letters_the_job(
    nats_url: str, redis_url: str
) -> None:
    # Before the fix: 24 requests in 0.26 s, then dead-lettered deliveries-exhausted.
    async with TargetSimulator(SimulatorConfig()) as sim:
        targets = {"slow": target(sim.base_url, max_attempts=1)}
        settings = smallest_backstop(queue_settings(nats_url, redis_url, targets, concurrency=2))
        stack = InProcessStack(settings)
        await stack.start(workers=1)
        js = stack.connections[0].jetstream()
        try:
            await submit_paths(js, settings, "slow", ["/ratelimited/0?retry_after=0"], "ra0")

            async def requests(n: int) -> bool:
                return int(sim.counts()["total"]) >= n

            await wait_for(lambda: requests(1), 30, "the first request")
            first = asyncio.get_running_loop().time()
            # Waits of 0.25, 0.5, 1 and 2 s at least come before the fifth request.
            await wait_for(lambda: requests(5), 40, "the fifth request")
            took = asyncio.get_running_loop().time() - first
            assert took >= 3.5, f"5 requests in {took:.2f} s: the target is hammered"
            assert sim.max_in_any_window(1.0) <= 3
            assert await dead(js, "slow") == 0
            assert await delivered(js, "slow") < settings.fleet.max_deliver // 2
        finally:
            await stack.stop()


async def test_finding2_many_jobs_answered_retry_after_zero_see_a_backing_off_target(
    nats_url: str, redis_url: str
) -> None:
    # Ten jobs, one target that answers every request 429 with Retry-After: 0: this
    # worker's hold on the target grows with its blocks in a row, so the requests thin
    # out (0, 0, 0.5, 1.5, 3.5 s ...), whichever job is the probe.
    async with TargetSimulator(SimulatorConfig()) as sim:
        targets = {"slow": target(sim.base_url, max_attempts=1)}
        settings = smallest_backstop(queue_settings(nats_url, redis_url, targets, concurrency=2))
        stack = InProcessStack(settings)
        await stack.start(workers=1)
        js = stack.connections[0].jetstream()
        try:
            paths = [f"/ratelimited/{n}?retry_after=0" for n in range(10)]
            await submit_paths(js, settings, "slow", paths, "ra0-many")

            async def requests(n: int) -> bool:
                return int(sim.counts()["total"]) >= n

            await wait_for(lambda: requests(1), 30, "the first request")
            first = asyncio.get_running_loop().time()
            await wait_for(lambda: requests(6), 40, "the sixth request")
            took = asyncio.get_running_loop().time() - first
            assert took >= 3.0, f"6 requests in {took:.2f} s: the target is hammered"
            assert sim.max_in_any_window(1.0) <= 4
            assert await dead(js, "slow") == 0
        finally:
            await stack.stop()


async def test_finding2_a_job_blocked_for_ever_ends_expired_at_its_max_age_not_by_the_backstop(
    nats_url: str, redis_url: str
) -> None:
    # max_deliver at its minimum (24) and a 10 s max age: the paced hand-backs spread the
    # deliveries over the max age, so the job ends `expired`, as a job nobody could run
    # for that long should. Before the fix: `deliveries-exhausted` within a second.
    async with TargetSimulator(SimulatorConfig()) as sim:
        targets = {"slow": target(sim.base_url, max_attempts=1, max_age_s=MAX_AGE_S)}
        settings = smallest_backstop(queue_settings(nats_url, redis_url, targets, concurrency=2))
        stack = InProcessStack(settings)
        await stack.start(workers=1)
        js = stack.connections[0].jetstream()
        try:
            await submit_paths(js, settings, "slow", ["/ratelimited/0?retry_after=0"], "aged")

            async def is_dead() -> bool:
                return await dead(js, "slow") == 1

            await wait_for(is_dead, 60, "the job's dead letter")
            [entry] = await list_dead_letters(js)
            assert entry.letter.reason == "expired", entry.letter.detail
            # Under half its deliveries spent by its max age, so they would last it
            # twice over. With the 20 s max age this test had, the bound was all 24 not
            # spent in 20 s; half of them in half the time bounds the same rate.
            assert await delivered(js, "slow") < settings.fleet.max_deliver // 2
        finally:
            await stack.stop()


MAX_AGE_S = 10.0


def pace_for(max_deliver: int, max_age_s: float, max_attempts: int = 1) -> HandBackPace:
    base = make_settings(
        "nats://127.0.0.1:1",
        "redis://127.0.0.1:1",
        {"t": target("http://127.0.0.1:1/", max_attempts=max_attempts, max_age_s=max_age_s)},
    )
    fleet = msgspec.structs.replace(base.fleet, max_deliver=max_deliver)
    return HandBackPace(msgspec.structs.replace(base, fleet=fleet), random.Random(8))


@pytest.mark.parametrize(
    ("max_deliver", "max_age_s", "attempts"),
    [(24, 3600.0, 1), (1000, 7 * 24 * 3600.0, 3), (1000, 60.0, 5), (10_000, 86400.0, 2)],
)
def test_finding2_hand_backs_that_spend_no_attempt_outlast_the_jobs_max_age(
    max_deliver: int, max_age_s: float, attempts: int
) -> None:
    # A job refused for ever (held, blocked, at its cap) on its spare deliveries: the
    # waits add up to more than its max age, so `expired` ends it, not the backstop.
    pace = pace_for(max_deliver, max_age_s, attempts)
    spare = pace.spare("t")
    assert sum(pace.growing_s("t", n) for n in range(1, spare + 1)) >= max_age_s
    busy = [pace.target_busy_s("t", n) for n in range(1, spare + 1)]
    assert sum(busy) >= max_age_s
    assert pace.growing_s("t", 1) < 0.5  # a passing refusal costs little


def test_finding2_a_target_busy_wait_is_no_longer_for_an_old_delivery_than_a_fresh_one() -> None:
    pace = pace_for(1000, 7 * 24 * 3600.0)
    fresh = [pace.target_busy_s("t", 1) for _ in range(200)]
    old = [pace.target_busy_s("t", 200) for _ in range(200)]
    for waits in (fresh, old):
        assert min(waits) >= TARGET_BUSY_S * 2 / 3
        assert max(waits) <= TARGET_BUSY_S * 4 / 3
