"""I4 beyond one Redis (issue 14): the rate limiter on a Redis Cluster and on a
Sentinel-watched master, each losing its master mid-run.

Cluster: three masters with a replica each (every node loading the session's ACL),
three targets chosen so each lives on another master, and a fleet rate that binds
(three targets at 8/s against a fleet's 20/s). The master of one target that is not the
fleet's shard is killed; its replica is promoted in a few seconds. Counted at the
simulators: while that shard is down its target gets nothing (fail closed) and the
other two go on; no 1 s window of any target, nor of the fleet, goes more than one
burst above its cap (the issue's bound: replication is asynchronous, so a promoted
replica may lack the last permits' writes, and the failover's stalls in this one process
bunch up sends the permits spaced); no job is lost and every one commits.

Without replicas, a dead master's targets fail closed (no permit at all) while the other
masters' targets go on and status names the silent master; restarted empty, it gives
permits again, with no burst.

Sentinel: one master, one replica, one Sentinel; the master is killed and the limiter
follows the Sentinel to the promoted replica, with the same promises.

Real servers and services throughout: nats-server, redis-server (cluster nodes,
Sentinel), the ratelimit service, scheduler, leaser, sink and workers (tests/stack.py)
running ``http.get`` jobs against target simulators.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import redis.exceptions
from nats.js import JetStreamContext

from jetfleet.auth.bundle import Bundle
from jetfleet.auth.credentials import redis_url_for
from jetfleet.ops.limiter_state import limiter_state
from jetfleet.ops.status import confirmed_status
from jetfleet.rate_cells import (
    FLEET_TAG,
    Cell,
    RateCells,
    RateUnavailable,
    born_key,
    daily_key,
    fleet_cell_key,
    target_cell_key,
    target_tag,
)
from jetfleet.redis_topology import close_redis, connect_redis
from jetfleet.settings import RedisSettings, Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator, most_in_any_window
from tests.conftest import wait_for
from tests.queueing.helpers import committed, dead, queue_settings, submit_paths, target
from tests.redis_topologies import LoopbackCluster, LoopbackSentinel
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(120)

RATE = 8.0
BURST = 2
FLEET_RATE = 20.0
FLEET_BURST = 4
JOBS = 48
"""Per target: about 6 s at its rate, so the failover lands mid-run."""
RUN_BEFORE_KILL_S = 2.0
FAIL_CLOSED_TOLERANCE_S = 0.3
"""Requests already permitted when the master died may still arrive this soon after."""
PROMOTION_SEEN_LATE_S = 0.1
"""The promotion is polled: permits taken from the new master as soon as it serves may
arrive this long before the poll sees it."""


async def _submit(stack: InProcessStack, settings: Settings, name: str) -> list[str]:
    paths = [f"/page/{n}" for n in range(JOBS)]
    js = stack.connections[0].jetstream()
    await submit_paths(js, settings, name, paths, name, handler="http.get")
    return paths


async def _all_settled(js: JetStreamContext, names: list[str]) -> None:
    async def settled() -> bool:
        counts = [await committed(js, n) + await dead(js, n) for n in names]
        return all(c == JOBS for c in counts)

    await wait_for(settled, 90, f"all {JOBS} jobs of {names} committed or dead-lettered")


async def _spread_targets(cluster: LoopbackCluster) -> tuple[list[str], str]:
    """One target name per master, and the one to fail: not on the fleet tag's master
    (that one would stop every permit under the fleet rate until the failover)."""
    by_master: dict[int, str] = {}
    for n in range(200):
        name = f"site-{n}"
        master = await cluster.master_of(target_tag(name))
        by_master.setdefault(master.port, name)
    fleet_master = (await cluster.master_of(FLEET_TAG)).port
    assert len(by_master) == 3, by_master
    victim = next(name for port, name in by_master.items() if port != fleet_master)
    return sorted(by_master.values()), victim


async def test_I4_caps_hold_through_a_redis_cluster_master_failover_and_nothing_is_lost(
    nats_url: str, tmp_path: Path, auth_bundle: Bundle | None
) -> None:
    cluster = LoopbackCluster(tmp_path / "cluster", auth_bundle)
    try:
        await cluster.start()
        names, victim = await _spread_targets(cluster)
        async with contextlib.AsyncExitStack() as sims:
            sites = {
                name: await sims.enter_async_context(TargetSimulator(SimulatorConfig()))
                for name in names
            }
            targets = {
                name: target(site.base_url, rate=RATE, burst=BURST) for name, site in sites.items()
            }
            settings = queue_settings(
                nats_url, cluster.url, targets, 8, rate=FLEET_RATE, burst=FLEET_BURST
            )
            stack = InProcessStack(settings)
            await stack.start(workers=3)
            try:
                paths = {name: await _submit(stack, settings, name) for name in names}

                async def all_sent_some() -> bool:
                    # About RUN_BEFORE_KILL_S of the victim's traffic before its master dies.
                    return (
                        all(site.arrivals() for site in sites.values())
                        and len(sites[victim].arrivals()) >= RATE * RUN_BEFORE_KILL_S
                    )

                await wait_for(all_sent_some, 30, "the run before the kill")
                killed_at = time.monotonic()
                old, new, promoted_at = await cluster.fail_master(target_tag(victim))
                js = stack.connections[0].jetstream()
                await _all_settled(js, names)
                settled_s = time.monotonic() - promoted_at
                status = await confirmed_status(js, settings)
                dead_letters = {name: await dead(js, name) for name in names}
            finally:
                await stack.stop()
            arrivals = {name: site.arrivals() for name, site in sites.items()}
    finally:
        cluster.stop()

    windows = {
        name: most_in_any_window([a.at for a in seen], 1.0) for name, seen in arrivals.items()
    }
    merged = [a.at for seen in arrivals.values() for a in seen]
    fleet_window = most_in_any_window(merged, 1.0)
    down = (killed_at + FAIL_CLOSED_TOLERANCE_S, promoted_at - PROMOTION_SEEN_LATE_S)
    during = {
        name: sum(1 for a in seen if down[0] < a.at < down[1]) for name, seen in arrivals.items()
    }
    print(
        f"\nI4 cluster: killed master {old.port} of {victim}, {new.port} promoted after "
        f"{promoted_at - killed_at:.1f} s; requests while it was down {during}; largest 1 s "
        f"windows {windows} (cap {RATE:g} + {BURST}), fleet {fleet_window} "
        f"(cap {FLEET_RATE:g} + {FLEET_BURST}); all settled {settled_s:.1f} s after the "
        f"promotion; status {status.totals}"
    )
    assert during[victim] == 0, "the failed shard's target got requests: it must fail closed"
    assert all(during[n] > 0 for n in names if n != victim), "the other shards must go on"
    # The bound: the cap, and at most one burst above it through the failover.
    for name in names:
        allowed = RATE + 2 * BURST
        assert windows[name] <= allowed, f"{name}: {windows[name]} in 1 s (at most {allowed})"
    allowed = FLEET_RATE + 2 * FLEET_BURST
    assert fleet_window <= allowed, f"fleet: {fleet_window} in 1 s (at most {allowed})"
    assert dead_letters == dict.fromkeys(names, 0)
    for name in names:
        assert {a.path for a in arrivals[name]} == set(paths[name]), f"{name}: a job never sent"
    assert status.conserved, status
    assert (status.totals.committed, status.totals.queued, status.totals.leased) == (
        JOBS * len(names),
        0,
        0,
    ), status.totals


SENTINEL_TARGET = "sentinel-site"


async def test_I4_the_limiter_follows_sentinel_to_the_promoted_replica_with_caps_held(
    nats_url: str, tmp_path: Path, auth_bundle: Bundle | None
) -> None:
    watched = LoopbackSentinel(tmp_path / "sentinel", auth_bundle)
    try:
        await watched.start()
        old_port = await watched.master_port()
        async with TargetSimulator(SimulatorConfig()) as site:
            targets = {SENTINEL_TARGET: target(site.base_url, rate=RATE, burst=BURST)}
            settings = queue_settings(nats_url, watched.url, targets, 8)
            stack = InProcessStack(settings)
            await stack.start(workers=2)
            try:
                paths = await _submit(stack, settings, SENTINEL_TARGET)

                async def some_sent() -> bool:
                    return len(site.arrivals()) >= RATE * RUN_BEFORE_KILL_S

                await wait_for(some_sent, 30, "the run before the kill")
                killed_at = time.monotonic()
                promoted_at = await watched.fail_master()
                new_port = await watched.master_port()
                js = stack.connections[0].jetstream()
                await _all_settled(js, [SENTINEL_TARGET])
                status = await confirmed_status(js, settings)
                dead_letters = await dead(js, SENTINEL_TARGET)
            finally:
                await stack.stop()
            arrivals = site.arrivals()
    finally:
        watched.stop()
    stamps = [a.at for a in arrivals]
    window = most_in_any_window(stamps, 1.0)
    down = (killed_at + FAIL_CLOSED_TOLERANCE_S, promoted_at - PROMOTION_SEEN_LATE_S)
    during = sum(1 for at in stamps if down[0] < at < down[1])
    after = sum(1 for at in stamps if at >= promoted_at)
    print(
        f"\nI4 Sentinel: master {old_port} killed, {new_port} promoted after "
        f"{promoted_at - killed_at:.1f} s; {during} requests while down, {after} after; "
        f"largest 1 s window {window} (cap {RATE:g} + {BURST}); status {status.totals}"
    )
    assert new_port != old_port
    assert during == 0, "requests went while the master was down: the limiter must fail closed"
    assert after > 0, "the limiter did not follow the Sentinel to the new master"
    assert window <= RATE + 2 * BURST, f"{window} in 1 s (at most one burst above the cap)"
    assert dead_letters == 0
    assert {a.path for a in arrivals} == set(paths), "a job was never sent"
    assert status.conserved, status
    assert (status.totals.committed, status.totals.queued, status.totals.leased) == (JOBS, 0, 0)


async def test_a_dead_master_without_replica_fails_its_targets_closed_and_the_rest_go_on(
    tmp_path: Path, auth_bundle: Bundle | None
) -> None:
    cluster = LoopbackCluster(tmp_path / "cluster", auth_bundle, replicas=0)
    try:
        await cluster.start()
        names, victim = await _spread_targets(cluster)
        url = cluster.url
        if auth_bundle is not None:
            url = redis_url_for(url, auth_bundle.credentials["ratelimit"])
        cells = RateCells.connect(url)
        # Cells that never bind (one permit a microsecond, even in the no-burst span of
        # a fresh state): only the shards' answers decide here.
        fleet = Cell("fleet", fleet_cell_key(), 1e6, 100)
        try:

            def own(name: str, rate: float = 1e6) -> Cell:
                return Cell("target", target_cell_key(name, "target"), rate, 5)

            for name in names:
                assert (await cells.permit(name, [own(name), fleet], 0)).allowed
            dead = await cluster.master_of(target_tag(victim))
            dead.kill()
            for _ in range(3):
                with pytest.raises(RateUnavailable):
                    await cells.permit(victim, [own(victim), fleet], 0)
                for name in names:
                    if name != victim:
                        assert (await cells.permit(name, [own(name), fleet], 0)).allowed
            state = await limiter_state(Settings(redis=RedisSettings(url=cluster.url)))
            assert state.health == "failing-closed" and f":{dead.port}" in state.detail, state

            await cluster.restart(dead)
            # Back, empty: its target's cell starts full (no burst of what was refused):
            # at 10/s with a burst of 5, one now and the next 0.1 s later.
            assert (await cells.permit(victim, [own(victim, 10), fleet], 0)).allowed
            refused = await cells.permit(victim, [own(victim, 10), fleet], 0)
            assert refused.limit == "target" and refused.wait_s > 0.05, refused
            assert (
                await limiter_state(Settings(redis=RedisSettings(url=cluster.url)))
            ).health == "ok"

            # On a cluster the fleet's cell is a second script: when it refuses, the
            # target's part taken first is given back (cell and daily count).
            other = next(n for n in names if n != victim)
            roomy = Cell("target", target_cell_key(other, "roomy"), 0.01, 50)
            slow_fleet = Cell("fleet", fleet_cell_key(), 0.01, 1)
            await cells.client.delete(slow_fleet.key)  # its state at 1e6/s is not at 0.01/s
            for tag in (target_tag(other), FLEET_TAG):  # long born: cells start empty
                await cells.client.set(born_key(tag), 0)
            assert (await cells.permit(other, [roomy, slow_fleet], 10)).allowed
            taken = await cells.client.get(roomy.key)
            for _ in range(3):
                refused = await cells.permit(other, [roomy, slow_fleet], 10)
                assert refused.limit == "fleet", refused
            assert await cells.client.get(roomy.key) == taken
            assert await cells.client.hget(daily_key(other), "used") == b"1"
        finally:
            await cells.close()
    finally:
        cluster.stop()


async def test_sentinels_with_a_password_of_their_own_are_asked_with_it_and_refuse_without(
    tmp_path: Path, auth_bundle: Bundle | None
) -> None:
    """The URL's user and password are the data nodes' (the role's ACL user under auth);
    ``?sentinel_password=`` is the Sentinels' ``requirepass``, apart from them."""
    watched = LoopbackSentinel(tmp_path / "sentinel", auth_bundle, sentinel_password="s3nt&pw")
    try:
        await watched.start()
        client = connect_redis(watched.url, 4)
        try:
            await client.set("jf-probe", "through the Sentinel")
            assert await client.get("jf-probe") == b"through the Sentinel"
        finally:
            await close_redis(client)
        bare = connect_redis(watched.url.partition("?")[0], 4)
        try:
            with pytest.raises(redis.exceptions.ConnectionError) as refused:
                await bare.get("jf-probe")
        finally:
            await close_redis(bare)
    finally:
        watched.stop()
    assert "AuthenticationError" in str(refused.value), refused.value
