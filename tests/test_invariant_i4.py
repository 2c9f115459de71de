"""I4, rate caps hold at the target, counted by the target (DESIGN.md section 3; issue 9).

A target capped at R requests/s with burst B must never see more than R + B requests in
any sliding 1 s window, nor more than R x 10 + B in any 10 s window, whatever the number
of workers, retries, requeues after a quarantine, or restarts of the leaser or of Redis;
and while it is backlogged the fleet must use at least 90 % of the cap. The same holds
for the fleet aggregate cap over several targets, counted at their simulators together.

Every count here is taken at the simulators (``TargetSimulator.arrivals``: each request's
arrival on this process's monotonic clock), never from jetfleet's own metrics.

Real servers: a fresh nats-server per test, redis-server (the session's, flushed, or one
of the test's own where Redis is killed), the ratelimit service, scheduler, leaser, sink
and several workers in this process (tests/stack.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from jetfleet.schemas.lease import QuarantineRecord, QuarantineSet
from nats.js import JetStreamContext

from jetfleet.cli.quarantine_commands import send as send_quarantine
from jetfleet.dev.embedded import EmbeddedRedis
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.status import confirmed_status
from jetfleet.settings import Settings, TargetSettings
from jetfleet.simulator import Arrival, SimulatorConfig, TargetSimulator, most_in_any_window
from tests.conftest import start_redis, wait_for
from tests.queueing.helpers import committed, dead, queue_settings, submit_paths, target
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(120)

RATE = 8.0
BURST = 2
OBSERVE_S = 20.0
"""How long traffic is watched at the target: the issue's 20 s."""
WORKERS = 3
CONCURRENCY = 8  # 3 x 8 = 24 slots for a target that allows 8 requests/s
UTILISATION = 0.9
CAPPED = "capped"


def capped_target(sim: TargetSimulator, **overrides: object) -> TargetSettings:
    """A target on ``sim`` capped at RATE/s with burst BURST; generous concurrency, so
    the rate is what binds."""
    values: dict[str, object] = {"rate": RATE, "burst": BURST, "max_in_flight": 64}
    values.update(overrides)
    return target(sim.base_url, **values)


@dataclass(frozen=True)
class Figures:
    """What the target saw: the largest 1 s and 10 s windows, and the share of the cap
    used over the observed span."""

    most_1s: int
    most_10s: int
    utilisation: float

    def __str__(self) -> str:
        return (
            f"largest 1 s window {self.most_1s}, largest 10 s window {self.most_10s}, "
            f"utilisation {self.utilisation:.1%}"
        )


def figures(stamps: list[float], rate: float, start: float, span_s: float) -> Figures:
    """The windows over every stamp, and the requests in ``[start, start + span_s)``
    against ``rate * span_s``."""
    used = sum(1 for at in stamps if start <= at < start + span_s)
    return Figures(
        most_in_any_window(stamps, 1.0),
        most_in_any_window(stamps, 10.0) if stamps else 0,
        used / (rate * span_s),
    )


def assert_within_caps(seen: Figures, rate: float, burst: int, what: str) -> None:
    assert seen.most_1s <= rate + burst, f"{what}: {seen} (cap {rate:g}/s, burst {burst})"
    assert seen.most_10s <= rate * 10 + burst, f"{what}: {seen} (cap {rate:g}/s, burst {burst})"


def stamps_of(arrivals: list[Arrival]) -> list[float]:
    return [a.at for a in arrivals]


async def first_arrival(sim: TargetSimulator, timeout_s: float = 30.0) -> float:
    """When the target saw its first request (waits for one)."""

    async def any_arrived() -> bool:
        return bool(sim.arrivals())

    await wait_for(any_arrived, timeout_s, "the first request at the target")
    return sim.arrivals()[0].at


async def watch_until(moment: float) -> None:
    """Let traffic flow until ``moment`` (monotonic): the observation window itself, not
    a wait standing in for a condition."""
    await asyncio.sleep(max(0.0, moment - time.monotonic()))


@contextlib.asynccontextmanager
async def running(settings: Settings, workers: int = WORKERS) -> AsyncIterator[InProcessStack]:
    stack = InProcessStack(settings)
    await stack.start(workers=workers)
    try:
        yield stack
    finally:
        await stack.stop()


def js_of(stack: InProcessStack) -> JetStreamContext:
    return stack.connections[0].jetstream()


async def submit_pages(
    stack: InProcessStack, target_name: str, paths: list[str], prefix: str
) -> None:
    await submit_paths(js_of(stack), stack.settings, target_name, paths, prefix, handler="http.get")


async def test_I4_a_targets_cap_holds_at_the_target_over_20_s_of_backlog_and_is_used(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    backlog = int(RATE * OBSERVE_S * 1.5)  # more than the 20 s can take
    async with TargetSimulator(SimulatorConfig()) as site:
        settings = queue_settings(nats_url, redis_url, {CAPPED: capped_target(site)}, CONCURRENCY)
        async with running(settings) as stack:
            js = js_of(stack)
            await submit_pages(stack, CAPPED, [f"/page/{n}" for n in range(backlog)], "bl")
            start = await first_arrival(site)
            await watch_until(start + OBSERVE_S)
            observed = site.arrivals()

            # Then the rest of the backlog, by now jobs refused and handed back a few
            # times each: still backlogged, so still the cap's rate.
            async def all_committed() -> bool:
                return await committed(js, CAPPED) == backlog

            await wait_for(all_committed, 60, f"the {backlog} jobs committed")
            arrivals = site.arrivals()
    observed = [a for a in observed if a.at < start + OBSERVE_S]
    seen = figures(stamps_of(observed), RATE, start, OBSERVE_S)
    span_s = arrivals[-1].at - start + 1 / RATE
    whole = figures(stamps_of(arrivals), RATE, start, span_s)
    print(
        f"\nI4 cap {RATE:g}/s burst {BURST}, {WORKERS * CONCURRENCY} slots, first 20 s: "
        f"{seen}; the whole backlog of {backlog} ({span_s:.1f} s): {whole}"
    )
    assert len(observed) < backlog, "the backlog ran out: utilisation would not be measured"
    assert_within_caps(whole, RATE, BURST, "a backlog of 30 s at the cap")
    assert seen.utilisation >= UTILISATION, f"the fleet left the cap unused: {seen}"
    assert whole.utilisation >= UTILISATION, f"the backlog's tail left the cap unused: {whole}"


STORM_LATENCY_S = 1.0
"""Every answer takes this long, so each worker holds leases in flight when the
quarantine revokes them."""
QUARANTINE_AT_S = 6.0
LEASER_RESTART_AT_S = 12.0


@pytest.mark.timeout(260)
async def test_I4_the_cap_holds_through_a_retry_storm_a_quarantine_requeue_and_a_leaser_restart(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    # Every job's first request fails with a retryable 500 and its retry succeeds: half
    # of all requests fail, and every retry must pay for its own permit.
    backlog = int(RATE * OBSERVE_S * 0.65)  # two requests each: 26 s at the cap
    paths = [f"/error/{n}?times=1" for n in range(backlog)]
    async with TargetSimulator(SimulatorConfig(latency_s=STORM_LATENCY_S)) as site:
        targets = {CAPPED: capped_target(site, max_attempts=5)}
        settings = queue_settings(nats_url, redis_url, targets, CONCURRENCY)
        async with running(settings) as stack:
            await submit_pages(stack, CAPPED, paths, "storm")
            start = await first_arrival(site)
            await watch_until(start + QUARANTINE_AT_S)
            store = await LeaseStore.open(js_of(stack))
            quarantined_worker = stack.workers[0].worker_id

            async def mid_request() -> bool:
                # The worker holds a lease whose first request (the 500) the target is
                # still answering (each takes STORM_LATENCY_S): then the quarantine has
                # one to revoke and requeue.
                now = time.monotonic()
                first_at: dict[str, float] = {}
                for a in site.arrivals():
                    first_at.setdefault(a.path, a.at)
                recent = {path for path, at in first_at.items() if now - 0.8 < at <= now}
                held = {
                    f"/error/{live.record.job_id.rsplit('-', 1)[1]}"
                    for live in await store.all_live()
                    if live.record.worker == quarantined_worker
                }
                return bool(recent & held)

            await wait_for(mid_request, 10, "worker 0 in the middle of a request")
            # Quarantining a worker revokes its leases in flight and requeues their
            # jobs at once: their second requests must fit under the cap too.
            record = QuarantineRecord(
                scope="worker", name=stack.workers[0].worker_id, target=CAPPED, reason="i4"
            )
            quarantined_at = time.monotonic()
            reply = await send_quarantine(settings, QuarantineSet(record=record))
            await watch_until(start + LEASER_RESTART_AT_S)
            leaser = stack.leaser
            assert leaser is not None
            await leaser.drain(5.0)
            await stack.start_leaser()
            restarted_at = time.monotonic()
            await watch_until(start + OBSERVE_S)
            observed = site.arrivals()
            assert reply.ok, reply
            # The revoked jobs whose first request (the 500) was still being answered
            # (each takes STORM_LATENCY_S): not committed, so they must be asked again.
            # A revoked lease can also be a committed job's that had not gone yet (its
            # second request, the 200, answered just before the revoke): not counted.
            revoked = {f"/error/{job_id.rsplit('-', 1)[1]}" for job_id in reply.revoked}
            first_at: dict[str, float] = {}
            for a in site.arrivals():
                first_at.setdefault(a.path, a.at)
            requeued = {
                path
                for path, at in first_at.items()
                if quarantined_at - STORM_LATENCY_S < at <= quarantined_at and path in revoked
            }
            assert requeued, f"the quarantine revoked nothing in flight: {reply}"

            # A requeued job waits its turn among the backlog's: the caps are checked
            # up to its second request, whenever that comes.
            async def requeued_asked_again() -> bool:
                later = {a.path for a in site.arrivals() if a.at > quarantined_at}
                return requeued <= later

            # A bound, not a speed: a clean-clone CI run once saw four revoked jobs not
            # asked again within 40 s, when a job the quarantined worker fetched went
            # back with a delay growing with its deliveries. Such a job now goes back
            # at a target-busy job's flat pace (runtime._elsewhere_delay); the bound
            # stays generous, since a requeued job waits its turn behind the backlog.
            await wait_for(requeued_asked_again, 150, f"the revoked jobs asked again {requeued}")
            arrivals = site.arrivals()
    observed = [a for a in observed if a.at < start + OBSERVE_S]
    seen = figures(stamps_of(observed), RATE, start, OBSERVE_S)
    whole = figures(stamps_of(arrivals), RATE, start, OBSERVE_S)
    failed = len({a.path for a in observed})  # each path's first request is its 500
    around_quarantine = [a.at for a in observed if quarantined_at <= a.at < quarantined_at + 3]
    around_restart = [a.at for a in observed if restarted_at - 1 <= a.at < restarted_at + 3]
    print(
        f"\nI4 retry storm ({failed} of {len(observed)} requests failed), quarantine "
        f"revoking {len(reply.revoked)} lease(s), leaser restart: {seen} (first 20 s); "
        f"{len(arrivals)} requests until the requeued ones: {whole.most_1s} in 1 s, "
        f"{whole.most_10s} in 10 s; after the "
        f"quarantine {most_in_any_window(around_quarantine, 1.0)} in 1 s, around the "
        f"restart {most_in_any_window(around_restart, 1.0)} in 1 s"
    )
    assert failed >= 0.4 * len(observed), "not a retry storm: too few requests failed"
    assert [a for a in observed if a.at > restarted_at], "nothing sent after the restart"
    assert_within_caps(whole, RATE, BURST, "retry storm, quarantine requeue, leaser restart")


FLEET_RATE = 10.0
FLEET_BURST = 2
FLEET_TARGETS = 5
FLEET_OBSERVE_S = 12.0


async def test_I4_the_fleet_aggregate_cap_holds_across_five_targets_counted_together(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    # Each target alone would allow 8/s, 40/s together: the fleet's 10/s is what binds.
    backlog = int(FLEET_RATE * FLEET_OBSERVE_S)  # per target: five times what can go
    async with contextlib.AsyncExitStack() as sites_stack:
        sites = [
            await sites_stack.enter_async_context(TargetSimulator(SimulatorConfig()))
            for _ in range(FLEET_TARGETS)
        ]
        targets = {f"t{n}": capped_target(site) for n, site in enumerate(sites)}
        settings = queue_settings(
            nats_url, redis_url, targets, 4, rate=FLEET_RATE, burst=FLEET_BURST
        )
        async with running(settings, workers=2) as stack:
            for name in targets:
                await submit_pages(stack, name, [f"/page/{n}" for n in range(backlog)], name)
            starts = [await first_arrival(site) for site in sites]
            start = min(starts)
            await watch_until(start + FLEET_OBSERVE_S)
            per_site = [site.arrivals() for site in sites]
    merged = sorted(
        a.at for arrivals in per_site for a in arrivals if a.at < start + FLEET_OBSERVE_S
    )
    seen = figures(merged, FLEET_RATE, start, FLEET_OBSERVE_S)
    shares = [sum(1 for a in arrivals if a.at < start + FLEET_OBSERVE_S) for arrivals in per_site]
    print(f"\nI4 fleet cap {FLEET_RATE:g}/s burst {FLEET_BURST} over 5 targets {shares}: {seen}")
    assert_within_caps(seen, FLEET_RATE, FLEET_BURST, "five targets together")
    assert seen.utilisation >= UTILISATION, f"the fleet left its aggregate cap unused: {seen}"


DAILY = 12
DAILY_JOBS = 20
DAILY_QUIET_S = 2.0
"""How long the target is watched after its budget is spent: nothing more may arrive."""


async def test_I4_the_daily_budget_stops_a_target_at_its_count_and_the_rest_stay_queued(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    async with TargetSimulator(SimulatorConfig()) as site:
        targets = {CAPPED: capped_target(site, rate=50.0, daily=DAILY)}
        settings = queue_settings(nats_url, redis_url, targets, CONCURRENCY)
        async with running(settings, workers=2) as stack:
            js = js_of(stack)
            await submit_pages(stack, CAPPED, [f"/page/{n}" for n in range(DAILY_JOBS)], "day")

            async def budget_spent() -> bool:
                return len(site.arrivals()) >= DAILY and await committed(js, CAPPED) >= DAILY

            await wait_for(budget_spent, 30, f"{DAILY} requests, the daily budget")
            await watch_until(time.monotonic() + DAILY_QUIET_S)
            status = await confirmed_status(js, settings)
            done, dead_letters = await committed(js, CAPPED), await dead(js, CAPPED)
        seen = len(site.arrivals())
    counts = status.targets[CAPPED]
    print(f"\nI4 daily budget {DAILY}: the target saw {seen}; status {counts}")
    assert seen == DAILY, f"the target saw {seen} requests, daily budget {DAILY}"
    assert (done, dead_letters) == (DAILY, 0)
    # The jobs beyond the budget wait for tomorrow's: still in the work stream, none lost.
    assert status.conserved, status
    assert counts.submitted == DAILY_JOBS and counts.committed == DAILY, counts
    assert counts.queued + counts.leased == DAILY_JOBS - DAILY, counts


RETRY_AFTER_S = 3
HOLD_START_TOLERANCE_S = 0.25
"""Requests whose permits were taken before the hold was placed may still arrive this
soon after the 429."""
RESUME_WITHIN_S = 1.5
HELD, OTHER = "held", "other"
OTHER_UTILISATION = 0.75
"""The other target's share of its cap kept during the hold. A hold that reached other
targets would leave it the permits already granted (near 0); over 3 s, 0.9 failed a
clean-clone CI run at 0.875 (21 of 24) on a loaded machine, one request short."""


async def test_I4_a_retry_after_holds_the_target_for_every_worker_and_no_other_target(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    backlog = int(RATE * 12)
    async with (
        TargetSimulator(SimulatorConfig()) as held_site,
        TargetSimulator(SimulatorConfig()) as other_site,
    ):
        targets = {HELD: capped_target(held_site), OTHER: capped_target(other_site)}
        settings = queue_settings(nats_url, redis_url, targets, CONCURRENCY)
        async with running(settings) as stack:
            pages = [f"/page/{n}" for n in range(backlog)]
            await submit_pages(stack, OTHER, pages, OTHER)
            await submit_pages(stack, HELD, pages, HELD)

            async def both_flowing() -> bool:
                return len(held_site.arrivals()) >= 2 * RATE and bool(other_site.arrivals())

            await wait_for(both_flowing, 30, "requests flowing to both targets")
            # Mid-run, whichever request comes next is told to wait 3 s.
            held_site.rate_limit_next(RETRY_AFTER_S)

            async def answered_429() -> bool:
                return any(a.kind == "ratelimited" for a in held_site.arrivals())

            await wait_for(answered_429, 10, "the 429 with Retry-After")
            at = next(a.at for a in held_site.arrivals() if a.kind == "ratelimited")

            async def resumed() -> bool:
                return held_site.arrivals()[-1].at >= at + RETRY_AFTER_S

            await wait_for(resumed, RETRY_AFTER_S + 10, "the held target asked again")
            await watch_until(at + RETRY_AFTER_S + RESUME_WITHIN_S)
            held_arrivals, other_arrivals = held_site.arrivals(), other_site.arrivals()
    during = [a for a in held_arrivals if at + HOLD_START_TOLERANCE_S < a.at < at + RETRY_AFTER_S]
    after = [a.at - at for a in held_arrivals if a.at >= at + RETRY_AFTER_S]
    other_during = [a for a in other_arrivals if at <= a.at < at + RETRY_AFTER_S]
    held_seen = figures(stamps_of(held_arrivals), RATE, at, RETRY_AFTER_S)
    other_seen = figures(stamps_of(other_arrivals), RATE, at, RETRY_AFTER_S)
    print(
        f"\nI4 Retry-After {RETRY_AFTER_S} s: {len(during)} requests during the hold, first "
        f"after it at +{min(after, default=float('nan')):.2f} s; held target: {held_seen}; "
        f"other target during the hold: {other_seen}"
    )
    assert not during, f"sent during the hold: {[(round(a.at - at, 2), a.path) for a in during]}"
    assert after and after[0] <= RETRY_AFTER_S + RESUME_WITHIN_S, f"did not resume: {after[:3]}"
    assert len(other_during) >= OTHER_UTILISATION * RATE * RETRY_AFTER_S, (
        f"other slowed: {other_seen}"
    )
    assert_within_caps(held_seen, RATE, BURST, "the held target, resuming")
    assert_within_caps(other_seen, RATE, BURST, "the other target")


REDIS_JOBS = 64
REDIS_UP_S = 4.0
REDIS_DOWN_S = 3.0
FAIL_CLOSED_TOLERANCE_S = 0.3
"""Requests already permitted when Redis died may still arrive this soon after."""
REDIS_RESUME_S = 5.0
"""Requests go again this soon after Redis is back (workers ask again within seconds)."""


async def test_I4_redis_killed_and_restarted_empty_lets_no_burst_through_and_loses_nothing(
    nats_url: str, tmp_path: Path
) -> None:
    first = start_redis(tmp_path / "redis-1")
    second: EmbeddedRedis | None = None
    try:
        async with TargetSimulator(SimulatorConfig()) as site:
            settings = queue_settings(nats_url, first.url, {CAPPED: capped_target(site)}, 8)
            async with running(settings) as stack:
                js = js_of(stack)
                paths = [f"/page/{n}" for n in range(REDIS_JOBS)]
                await submit_pages(stack, CAPPED, paths, "redis")
                start = await first_arrival(site)
                await watch_until(start + REDIS_UP_S)
                first.kill()
                killed_at = time.monotonic()
                await watch_until(killed_at + REDIS_DOWN_S)
                # Empty, where the old one was: every cell, hold and place is gone.
                second = start_redis(tmp_path / "redis-2", port=first.port)
                back_at = time.monotonic()

                async def all_committed() -> bool:
                    return await committed(js, CAPPED) == REDIS_JOBS

                await wait_for(all_committed, 90, f"all {REDIS_JOBS} jobs committed")
                drained_s = time.monotonic() - back_at
                status = await confirmed_status(js, settings)
                dead_letters = await dead(js, CAPPED)
            arrivals = site.arrivals()
    finally:
        first.stop()
        if second is not None:
            second.stop()
    stamps = stamps_of(arrivals)
    seen = figures(stamps, RATE, back_at, 5.0)
    down = [a for a in arrivals if killed_at + FAIL_CLOSED_TOLERANCE_S < a.at < back_at]
    resumed = [a.at - back_at for a in arrivals if a.at >= back_at]
    print(
        f"\nI4 Redis killed for {back_at - killed_at:.1f} s: {len(down)} requests while down, "
        f"first after +{min(resumed, default=float('nan')):.2f} s; {seen} (utilisation over "
        f"the 5 s after the restart); the rest committed {drained_s:.1f} s after it "
        f"({(REDIS_JOBS - sum(1 for a in arrivals if a.at < killed_at)) / RATE:.1f} s at the "
        f"cap); status {status.totals}"
    )
    assert not down, "requests went while Redis was down: the limiter must fail closed"
    assert resumed and resumed[0] <= REDIS_RESUME_S, f"did not resume: {resumed[:3]}"
    assert_within_caps(seen, RATE, BURST, "Redis killed and restarted empty")
    assert dead_letters == 0
    assert {a.path for a in arrivals} == set(paths), "a job was never requested"
    assert status.conserved, status
    totals = status.totals
    assert (totals.submitted, totals.committed, totals.queued, totals.leased) == (
        REDIS_JOBS,
        REDIS_JOBS,
        0,
        0,
    ), totals
