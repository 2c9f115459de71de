"""Priority tiers (DESIGN.md section 2, worker TierSlots): a high-priority job waits at
most about one running job's duration behind a saturating bulk load, and bulk keeps its
reserved share while high floods the worker.

Real servers: a fresh nats-server, the simulator as the target (every job fetches
``/slow/N?delay=0.5``, a known duration), scheduler + leaser + sink + one worker with
concurrency 4 in this process. Start times come from the ``queueing.timed`` handler
(``http.get`` with its start noted), so they are the moments the worker began each job.
A job is "available" from the moment the scheduler routes it to its work subject (seen by
a plain subscription on ``jf.work.demo.>``); the admission delay before that is printed
but is not the worker's to answer for.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import pairwise

import msgspec
import pytest
from jetfleet.schemas import Job, WorkOrder
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from jetfleet.client import resolve_url, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.results import iter_results
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from tests.conftest import wait_for
from tests.queueing.helpers import TIMED_HANDLER, TIMINGS, queue_settings, target
from tests.stack import InProcessStack

TARGET = "demo"
CONCURRENCY = 4
JOB_S = 0.5  # every job is one /slow request of this long
SLACK_S = 0.5  # lease grant, fetch round trips and a long-poll's edge on a busy 2-core box


@dataclass
class TierEnv:
    settings: Settings
    stack: InProcessStack
    js: JetStreamContext
    routed: dict[str, float]
    """Job id -> when its work order appeared on the work subject (first time)."""

    def jobs(self, tier: str, first: int, count: int, prefix: str) -> list[Job]:
        return [
            Job(
                id=f"{prefix}-{n}",
                url=resolve_url(self.settings, TARGET, f"/slow/{n}?delay={JOB_S}"),
                handler=TIMED_HANDLER,
                tier=tier,  # type: ignore[arg-type]
            )
            for n in range(first, first + count)
        ]

    async def submit(self, jobs: list[Job]) -> float:
        """Publish the jobs; returns the moment just before."""
        at = time.monotonic()
        results = await submit_jobs(self.js, self.settings, TARGET, jobs)
        assert all(r.published and r.rejection is None for r in results), results[:3]
        return at


@pytest.fixture
async def env(nats_url: str, redis_url: str, simulator: TargetSimulator) -> AsyncIterator[TierEnv]:
    settings = queue_settings(
        nats_url, redis_url, {TARGET: target(simulator.base_url)}, concurrency=CONCURRENCY
    )
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    observer = await connect_nats(settings.nats, "tiers-observer")
    routed: dict[str, float] = {}
    decoder = msgspec.json.Decoder(WorkOrder)

    async def note(msg: Msg) -> None:
        routed.setdefault(decoder.decode(msg.data).job.id, time.monotonic())

    watch: Subscription = await observer.subscribe(f"jf.work.{TARGET}.>", cb=note)
    TIMINGS.clear()
    try:
        yield TierEnv(settings, stack, observer.jetstream(), routed)
    finally:
        await watch.unsubscribe()
        await stack.stop()
        await observer.close()
        TIMINGS.clear()


async def test_high_priority_jobs_start_within_one_job_duration_under_saturating_bulk_load(
    env: TierEnv,
) -> None:
    bulk = env.jobs("bulk", 0, 200, "bulk")
    await env.submit(bulk)

    async def bulk_saturates() -> bool:
        return TIMINGS.running("bulk") >= CONCURRENCY - 1 and TIMINGS.finished("bulk") >= 2

    # Bulk borrows the idle slots: (nearly) every slot runs a bulk job.
    await wait_for(bulk_saturates, 30, "bulk jobs running in (nearly) every slot")

    # (job, seconds from routed to started, seconds of admission, bulk running then)
    waits: list[tuple[str, float, float, int]] = []

    async def run_high(jobs: list[Job]) -> None:
        running_bulk = TIMINGS.running("bulk")
        submitted = await env.submit(jobs)

        async def all_started() -> bool:
            return all(TIMINGS.first_start(j.id) is not None for j in jobs)

        await wait_for(all_started, 10, f"high jobs {[j.id for j in jobs]} to start")
        for job in jobs:
            start = TIMINGS.first_start(job.id)
            assert start is not None and job.id in env.routed
            available = env.routed[job.id]
            waits.append((job.id, start - available, available - submitted, running_bulk))

    # One at a time, each submitted while bulk holds the slots (never during a high run).
    for n in range(6):
        await wait_for(bulk_saturates, 30, "bulk to fill the slots again")
        await run_high(env.jobs("high", 1000 + n, 1, f"high-{n}"))
    # Then as many at once as the worker has high-reserved slots (2 of 4): each of them
    # gets one of the next slots bulk frees.
    await wait_for(bulk_saturates, 30, "bulk to fill the slots again")
    await run_high(env.jobs("high", 2000, 2, "high-burst"))

    bulk_left = len(bulk) - TIMINGS.finished("bulk")
    print(
        "\nhigh waits behind bulk, routed -> started (s): "
        + ", ".join(f"{w:.2f}" for _, w, _, _ in waits)
        + "; admission (s): "
        + ", ".join(f"{a:.2f}" for _, _, a, _ in waits)
        + f"; bulk running when submitted: {[b for _, _, _, b in waits]}; bulk left {bulk_left}"
    )
    assert bulk_left > 0, "bulk ran out: the high jobs were not measured under saturation"
    late = [(j, round(w, 2)) for j, w, _, _ in waits if w > JOB_S + SLACK_S]
    assert not late, f"high jobs waited longer than one bulk job ({JOB_S} s) + {SLACK_S} s: {late}"

    high_ids = {job_id for job_id, _, _, _ in waits}

    async def high_committed() -> bool:
        done = {r.job_id async for r in iter_results(env.js, TARGET)}
        return high_ids <= done

    await wait_for(high_committed, 30, "the high jobs committed")


async def test_bulk_is_not_starved_by_high(env: TierEnv) -> None:
    high = env.jobs("high", 0, 60, "high")
    bulk = env.jobs("bulk", 1000, 6, "bulk")
    await env.submit(high)

    async def high_saturates() -> bool:
        return TIMINGS.running("high") >= 2 and TIMINGS.finished("high") >= 4

    await wait_for(high_saturates, 30, "high jobs filling the worker")
    await env.submit(bulk)

    async def bulk_done() -> bool:
        return TIMINGS.finished("bulk") == len(bulk)

    await wait_for(bulk_done, 30, "the bulk jobs to run while high is flooded")
    bulk_starts = sorted(a.start for a in TIMINGS.started("bulk"))
    high_left = len(high) - len({a.job_id for a in TIMINGS.started("high")})
    print(
        f"\nbulk ran {len(bulk)} jobs while high still had {high_left} of {len(high)} to "
        f"start; bulk start gaps (s): "
        + ", ".join(f"{b - a:.2f}" for a, b in pairwise(bulk_starts))
    )
    # Every bulk job ran while high still had a backlog: bulk's reserved slot is its own.
    assert high_left > 0, "high ran dry before bulk finished: high never saturated the worker"
    # And it ran steadily, about one job at a time on its reserved slot, not in a burst
    # at the end: no gap between bulk starts much longer than one job plus a fetch wait.
    gaps = [b - a for a, b in pairwise(bulk_starts)]
    assert max(gaps) <= JOB_S + env.settings.fleet.long_poll_s + SLACK_S, gaps


async def test_bulk_alone_borrows_every_idle_slot_of_the_worker(env: TierEnv) -> None:
    # Only bulk has work: the high and normal slots are idle, so bulk may borrow them all
    # (tier_slots.py: "Each tier ... may borrow idle ones") and the worker runs at its
    # full concurrency: 24 jobs of 0.5 s on 4 slots take about 3 s, not 6.
    jobs = env.jobs("bulk", 0, 24, "alone")
    began = await env.submit(jobs)

    async def all_done() -> bool:
        return TIMINGS.finished("bulk") == len(jobs)

    await wait_for(all_done, 30, "the bulk jobs to run")
    elapsed = time.monotonic() - began
    edges = sorted(
        [(a.start, 1) for a in TIMINGS.attempts] + [(a.end or 0.0, -1) for a in TIMINGS.attempts]
    )
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    ideal = len(jobs) / CONCURRENCY * JOB_S
    print(
        f"\nbulk alone: {len(jobs)} jobs in {elapsed:.2f} s (ideal {ideal:.1f} s), "
        f"at most {most} of {CONCURRENCY} slots running bulk"
    )
    assert most == CONCURRENCY, (
        f"bulk never ran in every slot (at most {most} of {CONCURRENCY}) although the other "
        "tiers had no work: idle tiers keep slots"
    )
    assert elapsed <= ideal * 1.3 + SLACK_S, (
        f"{len(jobs)} bulk jobs took {elapsed:.2f} s; {CONCURRENCY} slots would take {ideal:.1f} s"
    )
