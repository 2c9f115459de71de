"""Target isolation (DESIGN.md sections 1-2: one subject family per target "so one target's
backlog or ban cannot stall another"; no single target failing may become a fleet-wide
incident): a target whose every request hangs must not change another target's
throughput by more than 10 %.

Real servers: a fresh nats-server, two simulators (one per target: ``healthy`` answers
pages after a fixed 50 ms, ``hanging`` never answers ``/hang/N``), scheduler + leaser +
sink + one worker that pulls both targets, in this process. Throughput is compared by
counts: the time the worker takes to commit K healthy jobs with the other target idle
and with the other target's every slot held by a hanging request, as the ratio of the
medians of ``RUNS`` runs of each, interleaved (idle, hanging, idle, ...) so that the
machine's own drift (other processes on a busy 2-core host) falls on both sides alike.
Each hanging spell is a backlog of hanging jobs (more than the worker has slots) with one
attempt each, whose requests hang for longer than any run; after the run the simulator
releases them (504) until every one has dead-lettered, so the next idle run really is
idle.

Run twice: with each target on consumers of its own, and with both targets beyond
``fleet.dedicated_targets``, hashed into different partitions (docs/topology.md: within
one partition, isolation is weaker by design).
"""

from __future__ import annotations

import statistics
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
from tests.queueing.helpers import committed, dead, queue_settings, submit_paths, target
from tests.stack import InProcessStack

HEALTHY, HANGING = "healthy", "hanging"
CONCURRENCY = 8
LATENCY_S = 0.05  # every healthy page takes this long at the target
HANG_TIMEOUT_S = 60.0  # longer than any run: the slots hang all through it
K = 400  # healthy jobs per measurement: several seconds of work at full speed
MAX_SLOWDOWN = 1.10
RUNS = 5  # of each kind, interleaved; the medians are compared
SPELL = 4 * CONCURRENCY  # hanging jobs per spell: the slots full, a backlog behind them
LEASE_TTL_S = 10.0


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
            # One attempt each: a spell of hanging jobs ends (dead-lettered) by itself.
            HANGING: target(hanging.base_url, timeout_s=HANG_TIMEOUT_S, max_attempts=1),
        }
        settings = queue_settings(
            nats_url,
            redis_url,
            targets,
            concurrency=CONCURRENCY,
            # Leases longer than the tests' 3 s: everything here shares one event loop,
            # and on a loaded machine a renewal late by 3 s lost a hanging job's lease,
            # whose request (still hanging at the target) was then sent again: more
            # hanging requests than slots, which this test does not measure.
            lease_ttl_s=LEASE_TTL_S,
            ack_wait_s=2 * LEASE_TTL_S,
            **layout(request.param),
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


async def start_hanging_spell(env: IsolationEnv, spell: int) -> int:
    """Fill the hanging target's slots (and its queue behind them); the jobs submitted."""
    await env.submit(HANGING, [f"/hang/{spell * 1000 + n}" for n in range(SPELL)], f"hang{spell}")

    async def slots_hanging() -> bool:
        return env.hanging.in_flight("hang") == CONCURRENCY

    try:
        await wait_for(slots_hanging, 60, f"all {CONCURRENCY} hanging slots in use")
    except AssertionError as exc:
        # Say where the spell's jobs are, so a failure here can be told apart: not
        # leased (queue, places), leased but not sent (worker), or already over.
        raise AssertionError(
            f"{exc}: spell {spell}, {env.hanging.in_flight('hang')} hanging at the target, "
            f"{env.hanging.counts()['total']} hanging requests so far, "
            f"{await dead(env.js, HANGING)} hanging jobs dead-lettered; the worker's "
            f"counts: {dict(env.stack.workers[0].stats)}"
        ) from None
    return SPELL


async def end_hanging_spell(env: IsolationEnv, submitted: int) -> None:
    """Release the hanging requests as they come until every hanging job so far has
    dead-lettered (one attempt each) and nothing hangs."""

    async def over() -> bool:
        env.hanging.release_hung()
        return await dead(env.js, HANGING) == submitted and env.hanging.in_flight() == 0

    await wait_for(over, 60, "the hanging spell to end")


async def test_a_hanging_target_does_not_change_another_targets_throughput_by_more_than_10_percent(
    env: IsolationEnv,
) -> None:
    await env.time_to_commit(80, "warm", 0, 30)  # connections, consumers bound
    alone: list[float] = []
    beside: list[float] = []
    hanging_jobs = 0
    for r in range(RUNS):
        # Pages of their own per run: the same URL again would be the same work.
        alone.append(await env.time_to_commit(K, f"alone{r}", 100_000 + 10_000 * r, 30))
        hanging_jobs += await start_hanging_spell(env, r)
        budget_s = max(3 * statistics.median(alone), 10.0)
        try:
            beside.append(await env.time_to_commit(K, f"beside{r}", 200_000 + 10_000 * r, budget_s))
        except TooSlow as slow:
            rate_alone, rate_beside = K / statistics.median(alone), slow.reached / slow.budget_s
            raise AssertionError(
                f"beside a hanging target the healthy target committed {slow.reached} of {K} "
                f"jobs in {slow.budget_s:.1f} s ({rate_beside:.1f}/s) against {rate_alone:.1f}/s "
                f"alone: throughput fell by {100 * (1 - rate_beside / rate_alone):.0f} % "
                f"({env.hanging.counts()['total']} hanging requests)"
            ) from None
        # The slots were still all hanging when the run ended: it was measured beside them.
        assert env.hanging.in_flight("hang") == CONCURRENCY, env.hanging.in_flight("hang")
        await end_hanging_spell(env, hanging_jobs)
    alone_s, beside_s = statistics.median(alone), statistics.median(beside)
    hang_requests = env.hanging.counts()["total"]
    # Each run beside the hanging target against the run alone just before it: a stack
    # that slows as its streams grow slows both runs of a pair alike, which a ratio of
    # the two medians would count as the hanging target's doing.
    ratio = statistics.median(b / a for a, b in zip(alone, beside, strict=True))
    print(
        f"\nisolation: {K} healthy jobs in {[round(t, 2) for t in alone]} s alone, "
        f"{[round(t, 2) for t in beside]} s beside a hanging target, interleaved "
        f"({hang_requests} hanging requests): median of the pairs' ratios {ratio:.3f}, "
        f"ratio of medians {beside_s / alone_s:.3f}"
    )
    assert hang_requests == hanging_jobs  # one attempt each, none run twice
    assert ratio <= MAX_SLOWDOWN, (
        f"the healthy target's throughput fell by {100 * (1 - 1 / ratio):.0f} % beside a "
        f"hanging target (median {alone_s:.2f} s -> {beside_s:.2f} s for {K} jobs)"
    )
