"""Target isolation (DESIGN.md sections 1-2: one subject family per target "so one target's
backlog or ban cannot stall another"; no single target failing may become a fleet-wide
incident): a target whose every request hangs must not change another target's
throughput by more than 10 %.

Real servers: a fresh nats-server, two simulators (one per target: ``healthy`` answers
pages after a fixed 50 ms, ``hanging`` never answers ``/hang/N``), scheduler + leaser +
sink + one worker that pulls both targets, in this process. Throughput is compared by
counts: the time the worker takes to commit the same K healthy jobs without and then with
a backlog of hanging jobs on the other target, as a ratio.

Run twice: with each target on consumers of its own, and with both targets beyond
``fleet.dedicated_targets``, hashed into different partitions (docs/topology.md: within
one partition, isolation is weaker by design).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from jetfleet.schemas import Job
from nats.js import JetStreamContext

from jetfleet.connection import connect_nats
from jetfleet.settings import Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.work_lanes import LaneMap, partition_of
from tests.conftest import wait_for
from tests.queueing.helpers import committed, queue_settings, submit_paths, target
from tests.stack import InProcessStack

HEALTHY, HANGING = "healthy", "hanging"
CONCURRENCY = 8
LATENCY_S = 0.05  # every healthy page takes this long at the target
HANG_TIMEOUT_S = 5.0  # a hanging request is given up after this (then retried)
K = 400  # healthy jobs per measurement: several seconds of work at full speed
MAX_SLOWDOWN = 1.10


@dataclass
class IsolationEnv:
    settings: Settings
    stack: InProcessStack
    js: JetStreamContext
    healthy: TargetSimulator
    hanging: TargetSimulator

    async def submit(self, target_name: str, paths: list[str], prefix: str) -> list[Job]:
        return await submit_paths(self.js, self.settings, target_name, paths, prefix)

    async def time_to_commit(
        self, count: int, prefix: str, first_page: int, budget_s: float
    ) -> float:
        """Seconds from submitting ``count`` new healthy pages to all of them committed;
        fails with the count reached when that takes more than ``budget_s``."""
        before = await committed(self.js, HEALTHY)
        began = time.monotonic()
        await self.submit(HEALTHY, [f"/page/{first_page + n}" for n in range(count)], prefix)

        async def done() -> bool:
            return await committed(self.js, HEALTHY) >= before + count

        try:
            await wait_for(done, budget_s, f"{count} healthy commits")
        except AssertionError:
            reached = await committed(self.js, HEALTHY) - before
            raise TooSlow(reached, count, budget_s) from None
        return time.monotonic() - began


class TooSlow(AssertionError):
    """Fewer than the K jobs committed within the time budget."""

    def __init__(self, reached: int, count: int, budget_s: float) -> None:
        super().__init__(f"only {reached} of {count} healthy jobs committed in {budget_s:.1f} s")
        self.reached = reached
        self.count = count
        self.budget_s = budget_s


def layout(name: str) -> dict[str, object]:
    """Fleet settings placing the two targets on their own consumers, or in two
    different hashed partitions."""
    if name == "dedicated":
        return {}
    partitions = 3
    assert partition_of(HEALTHY, partitions) != partition_of(HANGING, partitions)
    return {"dedicated_targets": 0, "target_partitions": partitions}


@pytest.fixture(params=["dedicated", "partitioned"])
async def env(
    nats_url: str, redis_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[IsolationEnv]:
    async with (
        TargetSimulator(SimulatorConfig(latency_s=LATENCY_S)) as healthy,
        TargetSimulator(SimulatorConfig()) as hanging,
    ):
        targets = {
            HEALTHY: target(healthy.base_url),
            # Same caps as the healthy target; retried for long enough to hang all along.
            HANGING: target(hanging.base_url, timeout_s=HANG_TIMEOUT_S, max_attempts=20),
        }
        settings = queue_settings(
            nats_url, redis_url, targets, concurrency=CONCURRENCY, **layout(request.param)
        )
        lanes = LaneMap(settings)
        assert lanes.lane_of(HEALTHY) != lanes.lane_of(HANGING)
        stack = InProcessStack(settings)
        await stack.start(workers=1)  # one worker, pulling both targets
        observer = await connect_nats(settings.nats, "isolation-observer")
        try:
            yield IsolationEnv(settings, stack, observer.jetstream(), healthy, hanging)
        finally:
            await stack.stop()
            await observer.close()


async def test_a_hanging_target_does_not_change_another_targets_throughput_by_more_than_10_percent(
    env: IsolationEnv,
) -> None:
    # Warm up (connections, consumers bound), then the baseline with the other target idle.
    # Each side is the mean of two runs: run-to-run noise here is about +-6 %.
    await env.time_to_commit(80, "warm", 0, 30)
    alone = [await env.time_to_commit(K, f"alone{r}", 10_000 * (r + 1), 30) for r in range(2)]
    alone_s = sum(alone) / len(alone)

    # Now a backlog on the hanging target: more hanging jobs than the worker has slots,
    # each holding its request open until the timeout, then retried.
    await env.submit(HANGING, [f"/hang/{n}" for n in range(4 * CONCURRENCY)], "hang")

    async def hanging_is_pulled() -> bool:
        return int(env.hanging.counts()["total"]) >= 1

    await wait_for(hanging_is_pulled, 30, "the worker to start on the hanging target")
    beside: list[float] = []
    for r in range(2):
        budget_s = max(3 * alone_s, 10.0)
        try:
            beside.append(await env.time_to_commit(K, f"beside{r}", 50_000 + 10_000 * r, budget_s))
        except TooSlow as slow:
            rate_alone, rate_beside = K / alone_s, slow.reached / slow.budget_s
            raise AssertionError(
                f"beside a hanging target the healthy target committed {slow.reached} of {K} "
                f"jobs in {slow.budget_s:.1f} s ({rate_beside:.1f}/s) against {rate_alone:.1f}/s "
                f"alone: throughput fell by {100 * (1 - rate_beside / rate_alone):.0f} % "
                f"({env.hanging.counts()['total']} hanging requests)"
            ) from None
    beside_s = sum(beside) / len(beside)
    hang_requests = env.hanging.counts()["total"]
    ratio = beside_s / alone_s
    print(
        f"\nisolation: {K} healthy jobs in {[round(t, 2) for t in alone]} s alone, "
        f"{[round(t, 2) for t in beside]} s beside a "
        f"hanging target ({hang_requests} hanging requests): ratio {ratio:.3f}"
    )
    assert hang_requests >= 1
    assert ratio <= MAX_SLOWDOWN, (
        f"the healthy target's throughput fell by {100 * (1 - 1 / ratio):.0f} % beside a "
        f"hanging target ({alone_s:.2f} s -> {beside_s:.2f} s for {K} jobs)"
    )
