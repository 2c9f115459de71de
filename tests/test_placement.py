"""Issue 10, placement: region pins, one worker per egress subnet and target, and
activity windows, against real servers (a fresh nats-server, the session redis-server,
the simulator as the target) and the real scheduler, leaser, sink and workers."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
from pathlib import Path
from zoneinfo import ZoneInfo

import msgspec
import pytest
from jetfleet.schemas import CommittedResult, Job, Rejection, WorkOrder
from jetfleet.services.leaser import checks
from nats.aio.client import Client as NatsClient

import jetfleet.cli.main as cli_main
from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.settings_file import settings_toml
from jetfleet.ops.dead_letters import list_dead_letters
from jetfleet.ops.status import confirmed_status
from jetfleet.region_presence import RegionPresence
from jetfleet.results import iter_results
from jetfleet.server_clock import ServerClock
from jetfleet.settings import (
    IdentitySettings,
    Settings,
    TargetSettings,
    min_max_deliver,
    validate,
)
from jetfleet.simulator import TargetSimulator
from jetfleet.simulator.counters import Visit
from jetfleet.stream_reader import count_messages
from jetfleet.topology import declare
from jetfleet.worker import Worker
from tests.conftest import make_settings, sim_target, wait_for
from tests.stack import InProcessStack, running_stack

pytestmark = pytest.mark.timeout(180)

_PAGES = itertools.count(1)
SUBNET_A = "10.1.0.0/24"
SUBNET_B = "10.2.0.0/24"


def placement_settings(
    nats_url: str, redis_url: str, simulator: TargetSimulator, **target: object
) -> Settings:
    """One target, one attempt per job (a refusal that spent one would show), and the
    smallest backstop, so a job nobody may run ends within seconds."""
    fields = msgspec.structs.asdict(sim_target(simulator))
    fields.update({"max_attempts": 1, **target})
    settings = make_settings(nats_url, redis_url, {"demo": TargetSettings(**fields)})
    fleet = msgspec.structs.replace(settings.fleet, max_deliver=min_max_deliver(settings))
    settings = msgspec.structs.replace(settings, fleet=fleet)
    validate(settings)
    return settings


def pages(n: int, route: str = "page") -> list[str]:
    return [f"/{route}/{next(_PAGES)}" for _ in range(n)]


async def add_worker(
    stack: InProcessStack, worker_id: str, region: str = "", subnet: str = "", concurrency: int = 16
) -> Worker:
    """A worker of its own region and subnet (as ``worker.region``/``worker.subnet``)."""
    mine = msgspec.structs.replace(
        stack.settings.worker, region=region, subnet=subnet, concurrency=concurrency
    )
    settings = msgspec.structs.replace(stack.settings, worker=mine)
    nc = await connect_nats(settings.nats, worker_id)
    stack.connections.append(nc)
    worker = Worker(settings, nc, worker_id)
    await worker.start()
    stack.workers.append(worker)
    return worker


async def committed(nc: NatsClient) -> dict[str, CommittedResult]:
    return {r.job_id: r async for r in iter_results(nc.jetstream(), "demo")}


async def wait_committed(nc: NatsClient, n: int, timeout_s: float, what: str) -> None:
    js = nc.jetstream()

    async def done() -> bool:
        return await count_messages(js, subjects.STREAM_RESULTS, subjects.results("demo")) >= n

    await wait_for(done, timeout_s, what)


def refusals(stack: InProcessStack, reason: str) -> int:
    assert stack.leaser is not None
    values = stack.leaser.answers.values.items()
    return sum(n for labels, n in values if dict(labels)["reason"] == reason)


async def conserved(stack: InProcessStack) -> None:
    status = await confirmed_status(stack.connections[0].jetstream(), stack.settings, reads=20)
    assert status.conserved, status


# --- region pins ------------------------------------------------------------------------


async def test_region_pinned_jobs_run_only_on_workers_of_their_region(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = placement_settings(nats_url, redis_url, simulator)
    async with running_stack(settings) as stack:
        nc = stack.connections[0]
        await add_worker(stack, "w-eu", region="eu")
        await add_worker(stack, "w-us", region="us")
        eu = jobs_for("demo", settings, pages(12), pin_region="eu")
        us = jobs_for("demo", settings, pages(12), pin_region="us")
        free = jobs_for("demo", settings, pages(6))
        await submit_jobs(nc.jetstream(), settings, "demo", eu + us + free)

        await wait_committed(nc, 30, 60, "every job committed")
        results = await committed(nc)
        assert {results[j.id].worker for j in eu} == {"w-eu"}
        assert {results[j.id].worker for j in us} == {"w-us"}
        # Each region's jobs were offered to the other region's worker too (one pull
        # consumer): refused there, never run there, and no attempt spent by it.
        assert refusals(stack, "wrong-region") > 0
        assert {r.attempt for r in results.values()} == {1}
        assert simulator.counts()["total"] == 30
        await conserved(stack)


async def test_a_job_pinned_to_a_region_no_worker_serves_ends_dead_no_eligible_worker(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = placement_settings(nats_url, redis_url, simulator)
    async with running_stack(settings) as stack:
        nc = stack.connections[0]
        await add_worker(stack, "w-eu", region="eu")
        [job] = jobs_for("demo", settings, pages(1), pin_region="ap")
        [runnable] = jobs_for("demo", settings, pages(1), pin_region="eu")
        await submit_jobs(nc.jetstream(), settings, "demo", [job, runnable])

        async def dead() -> bool:
            return len(await list_dead_letters(nc.jetstream())) == 1

        await wait_for(dead, 90, "the dead letter of the job pinned to region ap")
        [entry] = await list_dead_letters(nc.jetstream())
        assert entry.letter.order.job.id == job.id
        assert entry.letter.reason == "no-eligible-worker"
        assert "region ap" in entry.letter.detail
        assert entry.letter.history == []  # never run, no attempt spent
        results = await committed(nc)
        assert list(results) == [runnable.id]
        assert simulator.counts()["total"] == 1
        await conserved(stack)


def hand_backs(worker: Worker, reason: str) -> int:
    return sum(
        n for labels, n in worker.hand_backs.values.items() if dict(labels)["reason"] == reason
    )


async def test_a_job_pinned_to_a_busy_region_waits_for_it_and_runs_there(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    # A max age of MAX_AGE_S: the hand-backs are paced to last it (a few seconds each),
    # where they were 2 s at most and used up the backstop in about half a minute.
    settings = placement_settings(nats_url, redis_url, simulator, max_age_s=MAX_AGE_S)
    async with running_stack(settings) as stack:
        nc = stack.connections[0]
        eu = await add_worker(stack, "w-eu", region="eu")
        # A worker of region ap runs, but is busy elsewhere: it announces its region
        # and takes none of this target's jobs.
        busy_ap = asyncio.create_task(
            RegionPresence(nc.jetstream()).announce("ap", settings.worker.claim_ttl_s)
        )
        try:
            [job] = jobs_for("demo", settings, pages(1), pin_region="ap")
            await submit_jobs(nc.jetstream(), settings, "demo", [job])

            async def waiting_for_ap() -> bool:
                return hand_backs(eu, "region-busy") >= 2

            await wait_for(waiting_for_ap, 60, "the job to wait for region ap's worker")
            assert hand_backs(eu, "no-eligible-worker") == 0
            assert await list_dead_letters(nc.jetstream()) == []
            await add_worker(stack, "w-ap", region="ap")  # it frees up
            # (w-eu stops: it could go on catching the job's redeliveries first, each
            # one more paced wait; that race is not what this test is about.)
            await eu.drain(5.0)
            stack.workers.remove(eu)
            await wait_committed(nc, 1, 30, "the job committed in region ap")
        finally:
            busy_ap.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await busy_ap
        [result] = (await committed(nc)).values()
        assert (result.job_id, result.worker, result.attempt) == (job.id, "w-ap", 1)
        assert await list_dead_letters(nc.jetstream()) == []
        await conserved(stack)


# Half a minute: a 2.5 s cap (hand_back_pace.py), so past its patience the job asks
# again every 2.5-3.1 s, and its 24 deliveries last over 40 s; the test's job
# runs in region ap well before its max age. (At a minute the cap was 6.25 s, each of
# those waits that much longer.)
MAX_AGE_S = 30.0


# --- one worker per subnet and target ---------------------------------------------------


def overlapping(first: list[Visit], second: list[Visit]) -> int:
    """How many pairs of requests, one from each list, were being served at once."""
    return sum(1 for a in first for b in second if a.began < b.ended and b.began < a.ended)


async def test_two_workers_of_one_subnet_never_serve_a_target_at_once(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = placement_settings(nats_url, redis_url, simulator)
    async with running_stack(settings) as stack:
        nc = stack.connections[0]
        # Three slots each, so the backlog outlasts the hand-over below.
        first = await add_worker(stack, "w-a1", subnet=SUBNET_A, concurrency=3)
        await add_worker(stack, "w-a2", subnet=SUBNET_A, concurrency=3)
        await add_worker(stack, "w-b1", subnet=SUBNET_B, concurrency=3)
        # Slow pages (0.3 s each), so requests of different workers would overlap.
        slow = [f"{path}?delay=0.3" for path in pages(60, "slow")]
        jobs = jobs_for("demo", settings, slow)
        await submit_jobs(nc.jetstream(), settings, "demo", jobs)

        await wait_committed(nc, 20, 60, "half the jobs committed")
        # Hand-over: once the subnet's owner stops, its last lease's end frees the
        # target for the other worker of the subnet.
        by_client = {v.client for v in simulator.visits()}
        owner = next(w for w in stack.workers if w.worker_id in by_client & {"w-a1", "w-a2"})
        await owner.drain(5.0)
        stack.workers.remove(owner)
        other = "w-a2" if owner is first else "w-a1"

        async def other_served() -> bool:
            return any(v.client == other for v in simulator.visits())

        await wait_for(other_served, 30, f"{other} to serve after {owner.worker_id} stopped")
        await wait_committed(nc, len(jobs), 90, "every job committed")

        visits = simulator.visits()
        a1 = [v for v in visits if v.client == "w-a1"]
        a2 = [v for v in visits if v.client == "w-a2"]
        b1 = [v for v in visits if v.client == "w-b1"]
        assert a1 and a2 and b1
        assert overlapping(a1, a2) == 0
        # Each worker of subnet A ran several requests at once, and the worker of
        # subnet B served beside them: the rule is per subnet, not a fleet-wide lock.
        # (A request overlaps itself: more pairs than requests means some at once.)
        assert overlapping(a1, a1) > len(a1) or overlapping(a2, a2) > len(a2)
        assert overlapping(a1 + a2, b1) > 0
        assert refusals(stack, "subnet-busy") > 0
        results = await committed(nc)
        assert {r.attempt for r in results.values()} == {1}  # refusals spent no attempt
        await conserved(stack)


async def test_a_worker_refused_for_its_subnet_holds_off_longer_each_time_in_a_row(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = placement_settings(nats_url, redis_url, simulator, timeout_s=30.0)
    async with running_stack(settings) as stack:
        nc = stack.connections[0]
        await add_worker(stack, "w-a1", subnet=SUBNET_A, concurrency=2)
        await add_worker(stack, "w-a2", subnet=SUBNET_A, concurrency=2)
        # Slow jobs: one worker of the subnet holds the target for several seconds (a
        # first round of its two slots, 5 s, outlasts the other's first two refusals,
        # 2 s apart); the other's two jobs, refused, run in a second round.
        jobs = jobs_for("demo", settings, [f"{p}?delay=5" for p in pages(4, "slow")])
        await submit_jobs(nc.jetstream(), settings, "demo", jobs)

        def refused_twice_in_a_row() -> Worker | None:
            # Three refusals in a row, each after the hold of the one before: refusals of
            # one fetched batch (within the same hold) are one (runtime._subnet_busy_wait).
            return next((w for w in stack.workers if w._subnet_busy.get("demo", 0) >= 2), None)

        async def one_refused_twice_in_a_row() -> bool:
            return refused_twice_in_a_row() is not None

        await wait_for(
            one_refused_twice_in_a_row, 30, "a worker refused subnet-busy twice in a row"
        )
        refused = refused_twice_in_a_row()
        assert refused is not None
        # 2 s, then 4 s (then at most two lease TTLs of 3 s, 6 s): each refusal in a row
        # holds it off longer, where it asked again every 2 s.
        assert refused.gate.held_for("demo") > checks.SUBNET_BUSY_RETRY_S
        await wait_committed(nc, len(jobs), 60, "every job committed")
        results = await committed(nc)
        assert {r.attempt for r in results.values()} == {1}


# --- activity windows -------------------------------------------------------------------


@pytest.mark.parametrize("zone", ["UTC", "Asia/Kolkata"])
async def test_a_target_outside_its_window_gets_nothing_and_its_backlog_drains_when_it_opens(
    nats_url: str, redis_url: str, simulator: TargetSimulator, zone: str
) -> None:
    loop = asyncio.get_running_loop()
    plain = placement_settings(nats_url, redis_url, simulator)
    probe = await connect_nats(plain.nats, "clock")
    try:
        await declare(probe.jetstream(), plain)  # the clock reads JF_WORK's info
        now = await ServerClock(probe).now()
    finally:
        await probe.close()
    assert now is not None
    opens_at = loop.time() + 8.0  # the same moment on this process's monotonic clock
    # Open 8 s from the server's now (in the zone's local hours), for an hour.
    opens = now.astimezone(ZoneInfo(zone)) + datetime.timedelta(seconds=8)
    closes = opens + datetime.timedelta(hours=1)
    span = f"{opens:%H:%M:%S}-{closes:%H:%M:%S}"
    settings = placement_settings(
        nats_url, redis_url, simulator, active_hours=(span,), timezone=zone
    )
    async with running_stack(settings) as stack:
        nc = stack.connections[0]
        await add_worker(stack, "w-0")
        jobs = jobs_for("demo", settings, pages(8))
        await submit_jobs(nc.jetstream(), settings, "demo", jobs)

        # Closed: refused, and the target is sent nothing, polled until a second before
        # the opening.
        await wait_for(lambda: _refused(stack), 15, "an outside-window refusal")
        while loop.time() < opens_at - 1.0:
            assert simulator.counts()["total"] == 0
            assert await committed(nc) == {}
            await asyncio.sleep(0.1)
        status = await stack.status()
        assert status.totals.queued + status.totals.leased == len(jobs)

        # Open: the backlog drains, each job in its first attempt.
        await wait_committed(nc, len(jobs), 30, "the backlog after the window opened")
        results = await committed(nc)
        assert {r.attempt for r in results.values()} == {1}
        assert simulator.counts()["total"] == len(jobs)
        assert (await list_dead_letters(nc.jetstream())) == []
        await conserved(stack)


async def test_a_closed_partition_members_jobs_stay_away_until_it_opens(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    # "closed" and "open" share one partition (one work lane): the lane keeps fetching
    # for "open", and "closed"'s jobs it fetches while held go back until the opening,
    # not for a paced hand-back each (that cost a delivery every few seconds).
    settings = placement_settings(nats_url, redis_url, simulator)
    open_target = settings.targets["demo"]
    now = datetime.datetime.now(datetime.UTC)
    span = f"{now + datetime.timedelta(hours=2):%H:%M}-{now + datetime.timedelta(hours=3):%H:%M}"
    closed_target = msgspec.structs.replace(open_target, active_hours=(span,), max_age_s=172800.0)
    fleet = msgspec.structs.replace(settings.fleet, dedicated_targets=0, target_partitions=1)
    settings = msgspec.structs.replace(
        settings, fleet=fleet, targets={"open": open_target, "closed": closed_target}
    )
    validate(settings)
    async with running_stack(settings) as stack:
        nc = stack.connections[0]
        worker = await add_worker(stack, "w-0", concurrency=4)
        closed = jobs_for("closed", settings, pages(12))
        await submit_jobs(nc.jetstream(), settings, "closed", closed)
        opened = jobs_for("open", settings, pages(40))
        await submit_jobs(nc.jetstream(), settings, "open", opened)

        def closed_hand_backs() -> int:
            values = worker.hand_backs.values.items()
            return sum(n for labels, n in values if dict(labels)["target"] == "closed")

        async def each_closed_job_back_once() -> bool:
            return closed_hand_backs() >= len(closed)

        await wait_for(each_closed_job_back_once, 30, "every closed job handed back")
        js = nc.jetstream()

        async def open_done() -> bool:
            return await count_messages(js, subjects.STREAM_RESULTS, subjects.results("open")) >= 40

        await wait_for(open_done, 60, "the open member's jobs committed")
        # While the lane went on fetching, no closed job came back a second time.
        assert closed_hand_backs() == len(closed)
        assert refusals(stack, "outside-window") >= 1


async def _refused(stack: InProcessStack) -> bool:
    return refusals(stack, "outside-window") > 0


# --- admission --------------------------------------------------------------------------


def test_admission_refuses_an_identity_pin_and_a_region_pin_that_can_never_agree(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    base = placement_settings(nats_url, redis_url, simulator)
    settings = msgspec.structs.replace(base, identities={"alice": IdentitySettings(region="eu")})
    url = base.targets["demo"].base_url + "page/1"

    def verdict(pin_identity: str = "", pin_region: str = "") -> WorkOrder | Rejection:
        job = Job(id="pinned-1", url=url, pin_identity=pin_identity, pin_region=pin_region)
        return admit("jf.submit.demo", msgspec.json.encode(job), settings)

    refused = verdict(pin_identity="alice", pin_region="us")
    assert isinstance(refused, Rejection)
    assert refused.reason == "unsatisfiable-pin"
    assert "identities.alice.region" in refused.message
    assert "drop one of the pins" in refused.message
    # Agreeing pins, one pin alone, or an identity whose region is not declared here:
    # admitted (whether a worker of a region runs cannot be known at admission).
    assert isinstance(verdict(pin_identity="alice", pin_region="eu"), WorkOrder)
    assert isinstance(verdict(pin_region="mars"), WorkOrder)
    assert isinstance(verdict(pin_identity="bob", pin_region="us"), WorkOrder)


async def test_jetfleet_submit_pins_jobs_to_a_region(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = placement_settings(nats_url, redis_url, simulator)
    config = tmp_path / "jetfleet.toml"
    config.write_text(settings_toml(settings))
    async with running_stack(settings) as stack:
        nc = stack.connections[0]
        await add_worker(stack, "w-eu", region="eu")
        await add_worker(stack, "w-us", region="us")
        argv = ["--config", str(config), "--stack", str(tmp_path / "none"), "submit", "demo"]
        argv += [*pages(6), "--pin-region", "us", "--json"]
        capsys.readouterr()
        assert await asyncio.to_thread(cli_main.main, argv) == 0
        ids = json.loads(capsys.readouterr().out)["submitted"]
        await wait_committed(nc, len(ids), 60, "the pinned jobs committed")
        results = await committed(nc)
        assert set(results) == set(ids)
        assert {r.worker for r in results.values()} == {"w-us"}


async def test_a_region_is_present_while_a_worker_of_it_announces_and_lapses_after(
    settings: Settings, nc: NatsClient
) -> None:
    announcing = asyncio.create_task(RegionPresence(nc.jetstream()).announce("eu", 2.0))
    try:

        async def eu_present() -> bool:
            return await RegionPresence(nc.jetstream()).present("eu")  # uncached

        await wait_for(eu_present, 10, "region eu announced")
        assert not await RegionPresence(nc.jetstream()).present("ap")
    finally:
        announcing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await announcing

    async def eu_gone() -> bool:
        return not await RegionPresence(nc.jetstream()).present("eu")

    # The last announcement lapses by the server's per-key TTL (2 s).
    await wait_for(eu_gone, 10, "region eu's announcement to lapse")
