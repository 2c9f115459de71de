"""Targets beyond ``fleet.dedicated_targets`` share hashed partitions (issue 4: "one
consumer per target, or per hashed target partition beyond a configurable count").

Real servers: a fresh nats-server per test, the session redis-server (the leaser keeps
partitioned targets' in-flight places there), the simulator as every target.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis
from jetfleet.schemas import Job, LeaseGrant, LeaseRefusal
from jetfleet.schemas.lease import LeaseRelease, LeaseRenew
from jetfleet.services.leaser import Leaser
from nats.aio.client import Client as NatsClient
from nats.js import api as js_api

import jetfleet.cli.main as cli_main
from jetfleet import subjects
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import free_port
from jetfleet.errors import ConfigError
from jetfleet.inflight_caps import COUNT_BATCH, POOL_SIZE, InFlightCaps
from jetfleet.lease_store import LeaseStore
from jetfleet.rate_cells import RateCells
from jetfleet.redis_topology import MAX_POOL_SIZE, close_redis, pool_size_for
from jetfleet.settings import Settings, validate
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.topology import declare
from jetfleet.work_lanes import PARTITION_HEADROOM, LaneMap, partition_of
from tests.conftest import make_settings, wait_for
from tests.leasing import ask, order_for
from tests.queueing.helpers import (
    TIMED_HANDLER,
    TIMINGS,
    committed,
    queue_settings,
    submit_paths,
    target,
)
from tests.stack import InProcessStack

# Distinct pages for every batch: the targets share one simulator, and the same URL is
# the same work (one idempotency key).
_PAGES = itertools.count(1)


def names_in_partitions(partitions: int, per_partition: int, prefix: str = "site") -> list[str]:
    """Target names that fill every partition with ``per_partition`` members."""
    found: dict[int, list[str]] = {k: [] for k in range(partitions)}
    n = 0
    while any(len(v) < per_partition for v in found.values()):
        name = f"{prefix}-{n}"
        members = found[partition_of(name, partitions)]
        if len(members) < per_partition:
            members.append(name)
        n += 1
    return [name for k in sorted(found) for name in found[k]]


def fleet_of(
    nats_url: str, redis_url: str, base_url: str, names: list[str], **fleet: object
) -> Settings:
    return make_settings(nats_url, redis_url, {n: target(base_url) for n in names}, **fleet)


# -- the lane map (pure) -------------------------------------------------------------


def test_the_first_declared_targets_get_lanes_of_their_own_and_the_rest_are_hashed() -> None:
    names = ["big-a", "big-b", *names_in_partitions(3, 2)]
    settings = fleet_of(
        "nats://x:1", "redis://x:1", "http://t/", names, dedicated_targets=2, target_partitions=3
    )
    lanes = LaneMap(settings)
    assert [lane.name for lane in lanes.lanes] == ["big-a", "big-b", "P0", "P1", "P2"]
    assert not lanes.is_shared("big-a") and lanes.lane_of("big-a").targets == ("big-a",)
    for name in names[2:]:
        lane = lanes.lane_of(name)
        assert lane.shared and lane.name == f"P{partition_of(name, 3)}"
        assert name in lane.targets
        assert subjects.work(name, "bulk") in lane.filters("bulk")
    # A partition may hold the sum of its members' caps; each member is capped by the
    # leaser. Partition lane names are uppercase, so no target name can collide.
    assert lanes.lane_of(names[2]).max_in_flight == PARTITION_HEADROOM * 2 * 64
    assert not subjects.TARGET_NAME_RE.match("P0")
    # A worker of one partitioned target pulls its whole partition.
    assert [lane.name for lane in lanes.lanes_for([names[2], "big-b"])] == ["big-b", "P0"]
    with pytest.raises(ConfigError, match="unknown target"):
        lanes.lanes_for(["nope"])


def test_the_hash_is_stable_across_processes() -> None:
    # crc32, not hash(): every service and worker must agree on a target's partition.
    assert [partition_of(n, 16) for n in ("demo", "shop", "news-1")] == [0, 2, 13]


def test_partition_settings_are_validated() -> None:
    base = fleet_of("nats://x:1", "redis://x:1", "http://t/", ["a"])
    for fleet in ({"target_partitions": 0}, {"dedicated_targets": -1}):
        bad = msgspec.structs.replace(base, fleet=msgspec.structs.replace(base.fleet, **fleet))
        with pytest.raises(ConfigError, match=next(iter(fleet))):
            validate(bad)


# -- topology --------------------------------------------------------------------------


async def _work_consumers(nc: NatsClient) -> dict[str, frozenset[str]]:
    infos = await nc.jetstream().consumers_info(subjects.STREAM_WORK)
    return {
        i.name: frozenset(i.config.filter_subjects or [i.config.filter_subject or ""])
        for i in infos
    }


def _expected(settings: Settings) -> dict[str, frozenset[str]]:
    return {
        lane.consumer(tier): frozenset(lane.filters(tier))
        for lane in LaneMap(settings).lanes
        for tier in subjects.TIERS
    }


async def test_declare_makes_one_consumer_per_tier_per_lane(nats_url: str, redis_url: str) -> None:
    names = ["own", *names_in_partitions(2, 3)]
    settings = fleet_of(
        nats_url, redis_url, "http://127.0.0.1:9/", names, dedicated_targets=1, target_partitions=2
    )
    nc = await connect_nats(settings.nats, "test")
    try:
        assert await declare(nc.jetstream(), settings) == []
        consumers = await _work_consumers(nc)
        # 7 targets, 3 lanes: 9 consumers instead of 21.
        assert consumers == _expected(settings) and len(consumers) == 9
        # Declaring again changes nothing and reports no drift.
        assert await declare(nc.jetstream(), settings) == []
        assert await _work_consumers(nc) == consumers
    finally:
        await nc.close()


async def test_a_target_named_like_another_targets_tier_consumer_keeps_it(
    nats_url: str, redis_url: str
) -> None:
    # "work-shop-high" is shop's high-tier consumer, and also what a pre-tier jetfleet
    # named shop-high's; the clean-up of the latter must not delete the former.
    settings = fleet_of(nats_url, redis_url, "http://127.0.0.1:9/", ["shop", "shop-high"])
    nc = await connect_nats(settings.nats, "test")
    try:
        js = nc.jetstream()
        assert await declare(js, settings) == []
        before = await js.consumer_info(subjects.STREAM_WORK, "work-shop-high")
        assert await declare(js, settings) == []
        after = await js.consumer_info(subjects.STREAM_WORK, "work-shop-high")
        assert after.created == before.created
    finally:
        await nc.close()


# -- running ---------------------------------------------------------------------------


@pytest.fixture
async def slow_site() -> AsyncIterator[TargetSimulator]:
    async with TargetSimulator(SimulatorConfig(latency_s=0.15)) as sim:
        yield sim


async def _submit(
    nc: NatsClient, settings: Settings, name: str, count: int, first_page: int
) -> list[Job]:
    # Distinct pages per target: the targets share one simulator, and the same URL is
    # the same work (one idempotency key).
    paths = [f"/page/{first_page + n}" for n in range(count)]
    return await submit_paths(nc.jetstream(), settings, name, paths, name, handler=TIMED_HANDLER)


async def _all_committed(nc: NatsClient, names: list[str], each: int) -> bool:
    return all([await committed(nc.jetstream(), n) >= each for n in names])


def _most_at_once(prefix: str) -> int:
    """The most attempts of one target's jobs that ran at the same moment (handler
    intervals lie inside lease intervals, so this is at most the leases held at once)."""
    edges = []
    for attempt in TIMINGS.attempts:
        if attempt.job_id.startswith(prefix + "-") and attempt.end is not None:
            edges += [(attempt.start, 1), (attempt.end, -1)]
    most = running = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        running += step
        most = max(most, running)
    return most


async def test_each_partitioned_target_is_capped_fleet_wide_and_everything_commits(
    nats_url: str, redis_url: str, slow_site: TargetSimulator, redis_client: aioredis.Redis
) -> None:
    cap, each = 2, 24
    names = names_in_partitions(1, 3, prefix="capped")
    targets = {n: target(slow_site.base_url, max_in_flight=cap) for n in names}
    settings = queue_settings(
        nats_url,
        redis_url,
        targets,
        concurrency=8,
        dedicated_targets=0,
        target_partitions=1,
        # Long leases: a place can only be free at the end because it was given back.
        lease_ttl_s=20.0,
        ack_wait_s=30.0,
    )
    stack = InProcessStack(settings)
    await stack.start(workers=2)  # 16 slots on the one partition, for 3 x 2 places
    nc = await connect_nats(settings.nats, "observer")
    TIMINGS.clear()
    try:
        for i, name in enumerate(names):
            await _submit(nc, settings, name, each, 1000 * i)

        async def one_target_full() -> bool:
            status = await stack.status()
            return any(status.targets[n].leased == cap for n in names)

        await wait_for(one_target_full, 30, "status to show a partitioned target at its cap")
        await wait_for(lambda: _all_committed(nc, names, each), 90, "every job committed")

        # A result is stored before its worker acks the work message: the last acks may
        # still be on their way when the last result is read.
        async def all_acked() -> bool:
            status = await stack.status()
            return status.conserved and all(status.targets[n].queued == 0 for n in names)

        await wait_for(all_acked, 10, "every committed job's work message acked")
        status = await stack.status()
        assert status.conserved, status
        for name in names:
            counts = status.targets[name]
            assert (counts.committed, counts.queued, counts.dead) == (each, 0, 0), counts
            most = _most_at_once(name)
            # Never above the cap, across both workers; and the cap was really used.
            assert most <= cap, f"{name}: {most} at once, cap {cap}"
            assert most == cap, f"{name}: at most {most} at once; the cap {cap} was never used"
        assert stack.leaser is not None
        busy = sum(
            v for k, v in stack.leaser.answers.values.items() if ("reason", "target-busy") in k
        )
        assert busy > 0, "the leaser never had to refuse: the test did not reach the cap"
        handed_back = sum(
            w.hand_backs.get(worker=w.worker_id, target=n, reason="target-busy")
            for w in stack.workers
            for n in names
        )
        assert handed_back == busy  # every refusal shows on the workers' /metrics

        # Every place is freed when its job settles (by the sink), not left to expire with
        # its lease (20 s here): the next jobs find the target empty.
        async def places_freed() -> bool:
            return all([await redis_client.zcard(f"jf:inflight:{n}") == 0 for n in names])

        await wait_for(places_freed, 5, "every place freed")
    finally:
        await stack.stop()
        await nc.close()


async def test_queued_jobs_follow_their_target_when_it_moves_between_lanes(
    nats_url: str, redis_url: str, simulator: TargetSimulator, redis_client: aioredis.Redis
) -> None:
    base = simulator.base_url
    first = fleet_of(nats_url, redis_url, base, ["alpha", "beta"], dedicated_targets=2)
    # Jobs queue on the targets' own consumers; nobody pulls them yet.
    stack = InProcessStack(first)
    await stack.start(workers=0)
    nc = await connect_nats(first.nats, "observer")
    try:
        for name in ("alpha", "beta"):
            await _submit_plain(nc, first, name, 15, "before")
        await wait_for(lambda: _queued(stack, 30), 30, "30 jobs queued")
        await stack.stop()

        # Now both are partitioned, with a new target beside them. A service starting
        # with the new settings changes nothing and reports the move as drift...
        second = fleet_of(
            nats_url,
            redis_url,
            base,
            ["alpha", "beta", "gamma"],
            dedicated_targets=0,
            target_partitions=1,
        )
        before = await _work_consumers(nc)
        stack = InProcessStack(second)
        await stack.start(workers=0)
        assert await _work_consumers(nc) == before
        drifts = await declare(nc.jetstream(), second)
        assert {d.what for d in drifts} == {
            f"consumer JF_WORK/work-{t}-{tier}"
            for t in ("alpha", "beta")
            for tier in subjects.TIERS
        }
        # ...until the operator applies it (`jetfleet topology apply`): the dedicated
        # consumers go, the partition is made, and the queued jobs go through it.
        await declare(nc.jetstream(), second, update=True)
        assert await _work_consumers(nc) == _expected(second)
        await _submit_plain(nc, second, "gamma", 15, "before")
        await stack.add_worker("w-0")
        await wait_for(
            lambda: _all_committed(nc, ["alpha", "beta", "gamma"], 15),
            60,
            "the jobs queued before the move committed",
        )
        # And back again, with jobs queued in the partition at the time.
        await stack.stop()
        stack = InProcessStack(second)
        await stack.start(workers=0)
        for name in ("alpha", "beta", "gamma"):
            await _submit_plain(nc, second, name, 10, "after")
        await wait_for(lambda: _queued(stack, 30), 30, "30 more jobs queued")
        await stack.stop()
        third = fleet_of(nats_url, redis_url, base, ["alpha", "beta", "gamma"], dedicated_targets=3)
        await declare(nc.jetstream(), third, update=True)
        stack = InProcessStack(third)
        await stack.start(workers=1)
        assert await _work_consumers(nc) == _expected(third)
        await wait_for(
            lambda: _all_committed(nc, ["alpha", "beta", "gamma"], 25),
            60,
            "the jobs queued in the partition committed",
        )
        status = await stack.status()
        assert status.conserved and status.totals.committed == 75, status
    finally:
        await stack.stop()
        await nc.close()


async def _submit_plain(
    nc: NatsClient, settings: Settings, name: str, count: int, prefix: str
) -> None:
    first = next(_PAGES) * 1000
    paths = [f"/page/{first + n}" for n in range(count)]
    await submit_paths(nc.jetstream(), settings, name, paths, f"{prefix}-{name}")


async def _queued(stack: InProcessStack, count: int) -> bool:
    return (await stack.status()).totals.queued == count


async def test_a_partition_consumer_is_made_again_when_its_members_change(
    nats_url: str, redis_url: str
) -> None:
    names = names_in_partitions(1, 2)
    before = fleet_of(
        nats_url, redis_url, "http://127.0.0.1:9/", names, dedicated_targets=0, target_partitions=1
    )
    after = fleet_of(
        nats_url,
        redis_url,
        "http://127.0.0.1:9/",
        [*names, "late"],
        dedicated_targets=0,
        target_partitions=1,
    )
    nc = await connect_nats(before.nats, "test")
    js = nc.jetstream()
    try:
        await declare(js, before)
        made = await js.consumer_info(subjects.STREAM_WORK, "work-P0-normal")
        # A plain declare (any service's start) reports the change and leaves it.
        drifts = await declare(js, after)
        assert "consumer JF_WORK/work-P0-normal: filter_subjects is" in "\n".join(map(str, drifts))
        unchanged = await js.consumer_info(subjects.STREAM_WORK, "work-P0-normal")
        assert unchanged.created == made.created
        await declare(js, after, update=True)  # jetfleet topology apply
        remade = await js.consumer_info(subjects.STREAM_WORK, "work-P0-normal")
        assert set(remade.config.filter_subjects or []) == {
            subjects.work(n, "normal") for n in [*names, "late"]
        }
        # Made again (a new consumer starts from the stream's first message), not
        # widened in place (which would skip the new member's older messages).
        assert remade.created != made.created
        assert remade.config.deliver_policy == js_api.DeliverPolicy.ALL
    finally:
        await nc.close()


async def test_a_worker_of_one_partitioned_target_serves_its_whole_partition(
    nats_url: str, redis_url: str, simulator: TargetSimulator, redis_client: aioredis.Redis
) -> None:
    names = names_in_partitions(1, 3, prefix="mate")
    settings = fleet_of(
        nats_url, redis_url, simulator.base_url, names, dedicated_targets=0, target_partitions=1
    )
    stack = InProcessStack(settings)
    await stack.start(workers=0)
    nc = await connect_nats(settings.nats, "observer")
    try:
        from jetfleet.worker import Worker

        worker = Worker(settings, await stack._connect("w"), "w", targets=[names[0]])
        await worker.start()
        stack.workers.append(worker)
        assert worker.targets == tuple(sorted(names))
        for name in names:
            await _submit_plain(nc, settings, name, 5, "mate")
        await wait_for(lambda: _all_committed(nc, names, 5), 30, "every member's jobs")
    finally:
        await stack.stop()
        await nc.close()


# -- the leaser's cap, call by call ----------------------------------------------------


async def _leaser(settings: Settings) -> tuple[Leaser, NatsClient]:
    nc = await connect_nats(settings.nats, "leaser")
    await declare(nc.jetstream(), settings)
    leaser = Leaser(settings, nc)
    await leaser.start()
    return leaser, nc


async def test_the_leaser_gives_a_partitioned_target_max_in_flight_places_exactly(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    targets = {"small": target("http://127.0.0.1:9/", max_in_flight=2)}
    settings = make_settings(nats_url, redis_url, targets, dedicated_targets=0)
    leaser, nc = await _leaser(settings)
    try:
        orders = [order_for(settings, f"/page/{n}", target="small") for n in range(3)]
        first, second = [await leaser.handle(ask(o)) for o in orders[:2]]
        assert isinstance(first, LeaseGrant) and isinstance(second, LeaseGrant)
        third = await leaser.handle(ask(orders[2]))
        assert isinstance(third, LeaseRefusal) and third.reason == "target-busy", third
        assert "targets.small.max_in_flight" in third.detail
        # A renewal keeps the place (and never takes a second one).
        renew = LeaseRenew(job_id=orders[0].job.id, fence=first.fence)
        assert isinstance(await leaser.handle(renew), LeaseGrant)
        assert await redis_client.zcard("jf:inflight:small") == 2
        # Releasing one frees its place at once.
        release = LeaseRelease(job_id=orders[0].job.id, fence=first.fence)
        assert isinstance(await leaser.handle(release), LeaseGrant)
        assert isinstance(await leaser.handle(ask(orders[2])), LeaseGrant)
    finally:
        await leaser.drain(5.0)
        await nc.close()


async def test_without_redis_no_target_gets_a_grant(
    nats_url: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    # Declaration order decides: "big" comes first, so it keeps its own lane.
    targets = {"big": target("http://127.0.0.1:9/"), "small": target("http://127.0.0.1:9/")}
    settings = make_settings(nats_url, unreachable, targets, dedicated_targets=1)
    with caplog.at_level(logging.WARNING, logger="jetfleet.services.leaser.service"):
        leaser, nc = await _leaser(settings)
    assert "no lease is granted until it does" in caplog.text
    store = await LeaseStore.open(nc.jetstream())
    try:
        # Fails closed for every target, its own lane or a partition's: the in-flight
        # cap counts across tiers in Redis, so without Redis no lease (and the worker
        # hands the job back, to ask again in a second).
        for name, page in (("big", "/page/1"), ("small", "/page/2")):
            order = order_for(settings, page, target=name)
            reply = await leaser.handle(ask(order))
            assert isinstance(reply, LeaseRefusal) and reply.reason == "caps-unavailable", reply
            assert reply.retry_after_s >= 1.0
            assert await store.live(order.job.id) is None
    finally:
        await leaser.drain(5.0)
        await nc.close()


def test_topology_lanes_prints_which_consumers_carry_which_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = names_in_partitions(2, 2, prefix="blog")
    config = tmp_path / "jetfleet.toml"
    body = "[fleet]\ndedicated_targets = 1\ntarget_partitions = 2\n"
    for name in ["shop", *names]:
        body += f'[targets.{name}]\nbase_url = "https://{name}.example/"\n'
    config.write_text(body)
    assert cli_main.main(["--config", str(config), "topology", "lanes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["lane"], r["shared"], sorted(r["targets"])) for r in rows] == [
        ("shop", False, ["shop"]),
        ("P0", True, sorted(names[:2])),
        ("P1", True, sorted(names[2:])),
    ]
    assert rows[1]["consumers"] == ["work-P0-high", "work-P0-normal", "work-P0-bulk"]
    assert cli_main.main(["--config", str(config), "topology", "lanes"]) == 0
    text = capsys.readouterr().out
    assert "own lane" in text and f"partition of 2 (caps by the leaser): {names[0]}" in text


async def test_a_member_at_its_cap_with_a_backlog_does_not_hold_up_its_partition_mates(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    # Same partition: "busy" may run 2 at once against a slow site and has a backlog;
    # "mate" is submitted behind it. By counts: the mate's jobs must all commit while
    # most of the busy member's backlog still waits for its cap.
    names = names_in_partitions(1, 2, prefix="pair")
    busy, mate = names
    backlog, mates = 60, 20
    async with (
        TargetSimulator(SimulatorConfig(latency_s=0.3)) as slow,
        TargetSimulator(SimulatorConfig()) as fast,
    ):
        targets = {
            busy: target(slow.base_url, max_in_flight=2),
            mate: target(fast.base_url, max_in_flight=16),
        }
        settings = queue_settings(
            nats_url, redis_url, targets, concurrency=8, dedicated_targets=0, target_partitions=1
        )
        stack = InProcessStack(settings)
        await stack.start(workers=1)
        nc = await connect_nats(settings.nats, "observer")
        try:
            await _submit(nc, settings, busy, backlog, 0)

            async def busy_started() -> bool:
                return await committed(nc.jetstream(), busy) >= 2

            await wait_for(busy_started, 30, "the busy member to commit its first jobs")
            await _submit(nc, settings, mate, mates, 1000)
            await wait_for(lambda: _all_committed(nc, [mate], mates), 60, "the mate's jobs")
            busy_done = await committed(nc.jetstream(), busy)
            assert busy_done < backlog // 2, (
                f"the mate's {mates} jobs finished only after {busy_done} of the busy member's "
                f"{backlog} (2 at a time): the partition was held up behind it"
            )
            await wait_for(lambda: _all_committed(nc, [busy], backlog), 120, "the backlog")
            assert (await stack.status()).conserved
        finally:
            await stack.stop()
            await nc.close()


async def test_a_burst_of_grants_waits_for_redis_connections_instead_of_refusing(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    # More grants at once than the leaser keeps Redis connections (a leaser sized for
    # 128 calls in hand has 128): each waits its turn (never "caps-unavailable", which
    # would also leave places to expire). With redis-py's default pool, which refuses
    # past its size, 128 of these 256 grants were refused ("Too many connections";
    # checked).
    burst = 2 * POOL_SIZE
    # A rate no burst of grants can reach: this is about connections, not permits.
    targets = {"wide": target("http://127.0.0.1:9/", max_in_flight=burst, rate=1e6)}
    settings = make_settings(
        nats_url, redis_url, targets, dedicated_targets=0, service_concurrency=POOL_SIZE
    )
    leaser, nc = await _leaser(settings)
    try:
        orders = [order_for(settings, f"/page/{n}", target="wide") for n in range(burst)]
        replies = await asyncio.gather(*(leaser.handle(ask(o)) for o in orders))
        refused = [r for r in replies if not isinstance(r, LeaseGrant)]
        assert refused == [], refused[:3]
        assert await redis_client.zcard("jf:inflight:wide") == burst
    finally:
        await leaser.drain(5.0)
        await nc.close()


@pytest.mark.parametrize("connect", [InFlightCaps.connect, RateCells.connect])
async def test_a_service_has_a_redis_connection_for_every_call_it_may_have_in_hand(
    redis_url: str, connect: Callable[[str, int], InFlightCaps | RateCells]
) -> None:
    # A leaser (or ratelimit replica) at its full fleet.service_concurrency, every call
    # holding a connection at once: each gets one. A pool of 128 made the others wait
    # (at most 1 s) for one of those to come back: refused, with Redis healthy (384 of
    # these 512; checked).
    callers = Settings().fleet.service_concurrency
    made = connect(redis_url, callers)
    assert isinstance(made.client, aioredis.Redis)
    pool = made.client.connection_pool
    held = await asyncio.gather(
        *(pool.get_connection() for _ in range(callers)),  # type: ignore[no-untyped-call]
        return_exceptions=True,
    )
    try:
        refused = [c for c in held if isinstance(c, BaseException)]
        assert refused == [], f"{len(refused)} of {callers} refused: {refused[:2]}"
    finally:
        for connection in held:
            if not isinstance(connection, BaseException):
                await pool.release(connection)
        await close_redis(made.client)


def test_more_work_consumers_than_nats_server_allows_on_a_stream_is_refused() -> None:
    names = [f"t{i}" for i in range(400)]
    settings = fleet_of("nats://x:1", "redis://x:1", "http://t/", names, dedicated_targets=400)
    with pytest.raises(ConfigError, match=r"set fleet\.dedicated_targets to at most 317"):
        validate(settings)
    fits = fleet_of("nats://x:1", "redis://x:1", "http://t/", names, dedicated_targets=317)
    validate(fits)
    assert 3 * len(LaneMap(fits).lanes) <= 1000


async def test_place_counts_drop_expired_places_and_batch_many_targets(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    caps = InFlightCaps.connect(redis_url)
    try:
        names = [f"many-{n}" for n in range(COUNT_BATCH + 20)]  # two counting calls
        for n, name in enumerate(names[:30]):
            for job in range(n % 3 + 1):
                assert await caps.take(name, f"job-{job}", cap=5, ttl_s=30.0)
        # A place whose lease ran out (by Redis's clock) no longer counts.
        assert await caps.take("many-0", "short", cap=5, ttl_s=0.05)
        await wait_for(_redis_time_passed(redis_client, 0.1), 5, "Redis's clock to move on")
        counts = await caps.counts(names)
        assert counts["many-0"] == 1 and counts["many-1"] == 2 and counts["many-2"] == 3
        assert sum(counts.values()) == sum(n % 3 + 1 for n in range(30))
        assert counts[names[-1]] == 0 and len(counts) == len(names)
    finally:
        await caps.close()


def _redis_time_passed(client: aioredis.Redis, seconds: float) -> Callable[[], Awaitable[bool]]:
    started: list[float] = []

    async def passed() -> bool:
        now_s, now_us = await client.time()
        now = now_s + now_us / 1e6
        started[:0] = [] if started else [now]
        return now - started[0] >= seconds

    return passed


async def test_a_late_renewal_does_not_bring_back_a_freed_place_or_cut_one_short(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    caps = InFlightCaps.connect(redis_url)
    try:
        assert await caps.take("late", "done", cap=1, ttl_s=30.0) == "taken"
        await caps.drop("late", "done")
        # A renewal that was in flight when the job settled lands after the free.
        assert await caps.keep("late", "done", ttl_s=30.0) is False
        assert (await caps.counts(["late"]))["late"] == 0
        assert await caps.take("late", "next", cap=1, ttl_s=30.0) == "taken"  # it is free
        # A keep (or take) with a shorter lease never shortens a place.
        await caps.keep("late", "next", ttl_s=0.05)
        assert await caps.take("late", "other", cap=1, ttl_s=0.05) == "full"
        assert await caps.take("late", "next", cap=1, ttl_s=0.05) == "kept"
        await wait_for(_redis_time_passed(redis_client, 0.2), 5, "Redis's clock to move on")
        assert (await caps.counts(["late"]))["late"] == 1
    finally:
        await caps.close()


async def test_a_running_jobs_place_lost_with_redis_comes_back_with_its_next_renewal(
    nats_url: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    # Redis restarted empty: the places of jobs still running are gone. Their renewals
    # put them back, so new grants cannot fill the cap again beside them; a settled or
    # released job's place stays freed.
    targets = {"small": target("http://127.0.0.1:9/", max_in_flight=2)}
    settings = make_settings(nats_url, redis_url, targets)
    leaser, nc = await _leaser(settings)
    try:
        orders = [order_for(settings, f"/page/{n}", target="small") for n in range(3)]
        grants = [await leaser.handle(ask(o)) for o in orders[:2]]
        assert all(isinstance(g, LeaseGrant) for g in grants), grants
        await redis_client.delete("jf:inflight:small")  # as after a restart that lost it
        first = grants[0]
        assert isinstance(first, LeaseGrant)
        renewed = await leaser.handle(LeaseRenew(job_id=orders[0].job.id, fence=first.fence))
        assert isinstance(renewed, LeaseGrant)

        async def restored() -> bool:
            return await redis_client.zscore("jf:inflight:small", orders[0].job.id) is not None

        await wait_for(restored, 5, "the renewed job's place to come back")
        # Released, the job's place goes, and a renewal arriving late does not restore it.
        await leaser.handle(LeaseRelease(job_id=orders[0].job.id, fence=first.fence))
        assert await redis_client.zscore("jf:inflight:small", orders[0].job.id) is None
    finally:
        await leaser.drain(5.0)
        await nc.close()


def test_a_services_redis_pool_follows_its_concurrency_between_128_and_2048() -> None:
    assert pool_size_for(POOL_SIZE, 0) == POOL_SIZE
    assert pool_size_for(POOL_SIZE, 512) == 512
    # fleet.service_concurrency may be 100,000: each connection is a file descriptor.
    assert pool_size_for(POOL_SIZE, 100_000) == MAX_POOL_SIZE == 2048
