"""I7, the pause switch (DESIGN.md section 3; issue 11; docs/pause.md): a pause stops new
grants in its scope within 1 s of its acknowledgement, leaves other scopes running,
survives restarts, lapses by itself when timed, and nothing is lost on the way.

Grants are counted from the leases the server stored (a KV watch on ``jf-leases``: a
grant is a lease record without a fence, stamped with the server's time), against the
server's time when it stored the pause the leaser acknowledged (the acknowledgement comes
after it, so the figure is an upper bound); never this host's clock. Real servers, the
services and workers in this process (tests/stack.py), the target simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import pytest
from jetfleet.schemas import LeaseGrant, LeaseRefusal
from jetfleet.schemas.audit import AuditEntry
from jetfleet.schemas.control import PauseList, PauseReply, PauseResume, PauseSet
from jetfleet.schemas.lease import LeaseRecord
from jetfleet.services.leaser import Leaser
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.cli.actor import actor
from jetfleet.cli.pause_commands import command_of, parse_duration, send_pause
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.server_clock import parse_server_time
from jetfleet.settings import Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import read_stream
from jetfleet.topology import declare
from tests.conftest import make_settings, sim_target, wait_for
from tests.leasing import ask, order_for
from tests.queueing.helpers import committed, dead, submit_paths
from tests.stack import InProcessStack, running_stack

pytestmark = pytest.mark.timeout(120)

SHOP = "shop"
NEWS = "news"
WITHIN_S = 1.0


@dataclass(frozen=True)
class Grant:
    """One grant as the server stored its lease."""

    job_id: str
    target: str
    worker: str
    at: datetime.datetime
    """The server's time when it stored the lease."""


@dataclass
class GrantLog:
    """Every grant made while it runs, from a KV watch on the leases."""

    grants: list[Grant] = field(default_factory=list)

    def of(self, target: str = "", worker: str = "") -> list[Grant]:
        return [
            g
            for g in self.grants
            if (not target or g.target == target) and (not worker or g.worker == worker)
        ]


@contextlib.asynccontextmanager
async def grant_log(js: JetStreamContext) -> AsyncIterator[GrantLog]:
    log = GrantLog()
    leases = await js.key_value(subjects.BUCKET_LEASES)
    watcher = await leases.watchall()

    async def follow() -> None:
        async for entry in watcher:
            if entry is None or entry.operation is not None or not entry.value:
                continue
            record = msgspec.json.decode(entry.value, type=LeaseRecord)
            if record.fence == 0:  # a grant; a renewal names its fence
                assert entry.created is not None
                log.grants.append(Grant(record.job_id, record.target, record.worker, entry.created))

    task = asyncio.create_task(follow())
    try:
        yield log
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await watcher.stop()  # type: ignore[no-untyped-call]


def two_targets(nats_url: str, redis_url: str, site: TargetSimulator) -> Settings:
    target = sim_target(site)
    return make_settings(nats_url, redis_url, {SHOP: target, NEWS: target})


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    return two_targets(nats_url, redis_url, simulator)


async def pause(settings: Settings, **fields: object) -> PauseReply:
    reply = await send_pause(settings, msgspec.convert(fields, PauseSet))
    assert reply.ok and reply.pauses, reply
    return reply


async def resume(settings: Settings, **fields: object) -> PauseReply:
    reply = await send_pause(settings, msgspec.convert(fields, PauseResume))
    assert reply.ok, reply
    return reply


async def consumer_paused(js: JetStreamContext, target: str, tier: str = "normal") -> bool:
    info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer(target, tier))
    return bool(info.paused)


@contextlib.asynccontextmanager
async def second_leaser(stack: InProcessStack) -> AsyncIterator[Leaser]:
    """Another leaser replica in the queue group: grants go to either, so a pause taken
    by one must reach the other through its watch within the second too."""
    replica = Leaser(stack.settings, await connect_nats(stack.settings.nats, "leaser-2"))
    await replica.start()
    try:
        yield replica
    finally:
        await replica.drain(5.0)
        await replica.nc.close()


async def stored_time(js: JetStreamContext, reply: PauseReply) -> datetime.datetime:
    """The server's time when it stored the pause's record. The leaser acknowledges
    after that (once its own book has it), so a grant counted from here to under 1 s is
    under 1 s from the acknowledgement too."""
    msg = await js.get_msg(f"KV_{subjects.BUCKET_CONTROL}", seq=reply.pauses[0].revision)
    assert msg.time is not None
    return msg.time


def js_of(stack: InProcessStack) -> JetStreamContext:
    return stack.connections[0].jetstream()


def last_after(grants: list[Grant], acked: datetime.datetime) -> float:
    """Seconds from the acknowledgement to the last of ``grants`` (negative: none after)."""
    if not grants:
        return -1.0
    return (max(g.at for g in grants) - acked).total_seconds()


async def test_I7_a_target_pause_stops_its_grants_within_1_s_while_other_targets_run(
    nats_url: str, redis_url: str
) -> None:
    async with TargetSimulator(SimulatorConfig(latency_s=0.2)) as site:
        settings = two_targets(nats_url, redis_url, site)
        async with running_stack(settings, workers=2) as stack, second_leaser(stack):
            js = js_of(stack)
            async with grant_log(js) as log:
                shop = await submit_paths(
                    js, settings, SHOP, [f"/page/{n}" for n in range(150)], "s", handler="http.get"
                )
                news = await submit_paths(
                    js,
                    settings,
                    NEWS,
                    [f"/page/{n}" for n in range(1000, 1600)],
                    "n",
                    handler="http.get",
                )

                async def shop_flows() -> bool:
                    return await committed(js, SHOP) >= 10

                await wait_for(shop_flows, 30, "shop's first commits")
                reply = await pause(settings, scope="target", name=SHOP, why="i7 test")
                acked = await stored_time(js, reply)
                news_then = await committed(js, NEWS)

                # Watched for longer than the promise, by the server's clock: news is
                # still granted (and committing) more than a second after the ack.
                async def news_granted_well_after() -> bool:
                    late = [g for g in log.of(NEWS) if (g.at - acked).total_seconds() > 1.5]
                    return bool(late) and await committed(js, NEWS) > news_then + 50

                await wait_for(news_granted_well_after, 30, "news granted 1.5 s after the ack")
                shop_during = await committed(js, SHOP)
                last = last_after(log.of(SHOP), acked)
                print(f"\nI7 target pause: last shop grant {last * 1000:.0f} ms after the pause")
                assert last < WITHIN_S, f"a shop grant {last:.3f} s after the pause's ack"
                assert await consumer_paused(js, SHOP) and not await consumer_paused(js, NEWS)
                assert shop_during < len(shop), "shop's backlog ran out before the pause"

                await resume(settings, scope="target", name=SHOP)

                async def all_committed() -> bool:
                    return await committed(js, SHOP) == len(shop) and (
                        await committed(js, NEWS) == len(news)
                    )

                await wait_for(all_committed, 60, "every job committed after the resume")
                assert not await consumer_paused(js, SHOP)
                assert await dead(js, SHOP) == 0 and await dead(js, NEWS) == 0


async def test_I7_a_fleet_pause_now_requeues_held_jobs_and_every_job_commits_once(
    nats_url: str, redis_url: str
) -> None:
    async with TargetSimulator(SimulatorConfig(latency_s=1.0)) as site:
        settings = two_targets(nats_url, redis_url, site)
        async with running_stack(settings, workers=1) as stack:
            js = js_of(stack)
            store = await LeaseStore.open(js)
            jobs = await submit_paths(
                js, settings, SHOP, [f"/page/{n}" for n in range(12)], "h", handler="http.get"
            )

            async def leases_held() -> bool:
                return len(await store.all_live()) >= 6

            await wait_for(leases_held, 30, "leases held on the slow pages")
            async with grant_log(js) as log:
                reply = await pause(settings, scope="fleet", mode="now", why="i7 now")
                acked = await stored_time(js, reply)
                assert len(reply.revoked) >= 6, reply
                still = {live.record.job_id for live in await store.all_live()}
                assert not still & set(reply.revoked), still
                assert await consumer_paused(js, SHOP) and await consumer_paused(js, NEWS)
                # The requests of the revoked leases were already sent; their answers
                # come back to nobody (the sink refuses the revoked fences).
                assert await committed(js, SHOP) == 0
                last = last_after(log.grants, acked)
                print(f"\nI7 fleet pause --now: last grant {last * 1000:.0f} ms after the pause")
                assert last < WITHIN_S, f"a grant {last:.3f} s after the pause's ack"

            await resume(settings, scope="fleet")

            async def all_committed() -> bool:
                return await committed(js, SHOP) == len(jobs)

            await wait_for(all_committed, 60, "every job committed after the resume")
            assert await dead(js, SHOP) == 0
            history = [(await store.read_history(j.id)).history for j in jobs]
            # The revoked attempts were given back: the fleet paused them.
            assert all(h is not None and h.settled is not None for h in history)


async def test_I7_a_pause_survives_a_leaser_restart_and_binds_consumers_made_later(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    js = nc.jetstream()
    client = LeaseClient(nc)
    order = order_for(settings, "/page/1", target=SHOP)
    await pause(settings, scope="target", name=SHOP, why="survive")
    assert services.leaser is not None
    await services.leaser.drain(5.0)
    await services.start_leaser()
    reply = await client.grant(ask(order, worker="w-a"))
    assert isinstance(reply, LeaseRefusal) and reply.reason == "paused", reply
    assert reply.pause_scope == "target" and reply.retry_after_s <= 1.0, reply
    assert await consumer_paused(js, SHOP)
    # A consumer made later (a topology declare after it was lost) is paused from birth.
    await js.delete_consumer(subjects.STREAM_WORK, subjects.work_consumer(SHOP, "bulk"))
    await declare(js, settings)
    assert await consumer_paused(js, SHOP, "bulk")
    listed = await send_pause(settings, PauseList())
    assert [v.record.name for v in listed.pauses] == [SHOP], listed
    news = order_for(settings, "/page/1", target=NEWS)
    assert isinstance(await client.grant(ask(news, worker="w-a")), LeaseGrant)

    await resume(settings, scope="target", name=SHOP)
    assert isinstance(await client.grant(ask(order, worker="w-a")), LeaseGrant)
    assert not await consumer_paused(js, SHOP) and not await consumer_paused(js, SHOP, "bulk")


async def test_I7_a_timed_pause_lapses_by_itself_at_its_end_by_the_servers_clock(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    js = nc.jetstream()
    client = LeaseClient(nc)
    order = order_for(settings, "/page/1", target=SHOP)
    reply = await pause(settings, scope="target", name=SHOP, for_s=2.0)
    ends = await stored_time(js, reply) + datetime.timedelta(seconds=2)
    info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer(SHOP))
    assert info.config.pause_until is not None
    assert abs((parse_server_time(info.config.pause_until) - ends).total_seconds()) < 0.001
    refused = await client.grant(ask(order, worker="w-a"))
    assert isinstance(refused, LeaseRefusal) and refused.reason == "paused", refused

    async def granted() -> bool:
        return isinstance(await client.grant(ask(order, worker="w-a")), LeaseGrant)

    await wait_for(granted, 10, "the timed pause lapsed")
    lease = await js.get_msg(
        f"KV_{subjects.BUCKET_LEASES}", subject=f"$KV.{subjects.BUCKET_LEASES}.{order.job.id}"
    )
    assert lease.time is not None
    # Judged by the server's clock, carried on the leaser's: a few ms either way.
    assert (lease.time - ends).total_seconds() > -0.05, (lease.time, ends)

    async def consumer_resumed() -> bool:
        return not await consumer_paused(js, SHOP)

    await wait_for(consumer_resumed, 5, "the consumer resumed at the pause's end")
    listed = await send_pause(settings, PauseList())
    assert listed.pauses == [], listed


async def test_I7_resuming_the_fleet_leaves_a_paused_target_paused(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    js = nc.jetstream()
    await pause(settings, scope="fleet")
    await pause(settings, scope="target", name=SHOP)
    assert await consumer_paused(js, NEWS) and await consumer_paused(js, SHOP)
    await resume(settings, scope="fleet")
    assert await consumer_paused(js, SHOP) and not await consumer_paused(js, NEWS)
    client = LeaseClient(nc)
    refused = await client.grant(ask(order_for(settings, "/page/1", target=SHOP), worker="w-a"))
    assert isinstance(refused, LeaseRefusal) and refused.pause_scope == "target", refused
    again = await resume(settings, scope="fleet")
    assert again.detail.startswith("not paused"), again
    await resume(settings, scope="target", name=SHOP)
    assert not await consumer_paused(js, SHOP)


async def test_I7_an_identity_pause_now_moves_its_jobs_to_other_workers(
    nats_url: str, redis_url: str
) -> None:
    async with TargetSimulator(SimulatorConfig(latency_s=0.3)) as site:
        settings = two_targets(nats_url, redis_url, site)
        async with running_stack(settings) as stack:
            await stack.add_worker("w-a", identity="id-a")
            await stack.add_worker("w-b", identity="id-b")
            js = js_of(stack)
            async with grant_log(js) as log:
                jobs = await submit_paths(
                    js, settings, SHOP, [f"/page/{n}" for n in range(60)], "i", handler="http.get"
                )

                async def both_granted() -> bool:
                    return bool(log.of(worker="w-a")) and bool(log.of(worker="w-b"))

                await wait_for(both_granted, 30, "both workers granted")
                reply = await pause(settings, scope="identity", name="id-a", mode="now")
                acked = await stored_time(js, reply)
                assert reply.revoked, "id-a held no lease when it was paused"

                async def all_committed() -> bool:
                    return await committed(js, SHOP) == len(jobs)

                await wait_for(all_committed, 60, "every job committed")
                last = last_after(log.of(worker="w-a"), acked)
                print(f"\nI7 identity pause --now: last id-a grant {last * 1000:.0f} ms after")
                assert last < WITHIN_S, f"a grant to id-a {last:.3f} s after the ack"
                for job_id in reply.revoked:
                    after = [g for g in log.grants if g.job_id == job_id and g.at > acked]
                    assert any(g.worker == "w-b" for g in after), (job_id, after)
                # Not a target-wide pause: nothing held at the server.
                assert not await consumer_paused(js, SHOP)
                assert await dead(js, SHOP) == 0


def test_pause_durations_parse_with_clear_errors() -> None:
    assert parse_duration("90") == 90.0
    assert parse_duration("30s") == 30.0
    assert parse_duration("30m") == 1800.0
    assert parse_duration("2h") == 7200.0
    assert parse_duration("1.5d") == 129600.0
    for bad in ("", "3x", "-1m", "0", "40d", "m"):
        with pytest.raises(JetfleetError, match="--for"):
            parse_duration(bad)


async def test_I7_worker_and_region_pauses_refuse_only_their_workers(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/1", target=SHOP)
    await pause(settings, scope="worker", name="w-a", why="draining its host")
    await pause(settings, scope="region", name="eu", for_s=600.0)
    by_worker = await client.grant(ask(order, worker="w-a"))
    assert isinstance(by_worker, LeaseRefusal) and by_worker.pause_scope == "worker", by_worker
    in_region = msgspec.structs.replace(ask(order, worker="w-b"), region="eu")
    by_region = await client.grant(in_region)
    assert isinstance(by_region, LeaseRefusal) and by_region.pause_scope == "region", by_region
    assert "draining its host" in by_worker.detail
    assert isinstance(await client.grant(ask(order, worker="w-b")), LeaseGrant)
    # Only fleet and target pauses hold consumers at the server.
    assert not await consumer_paused(nc.jetstream(), SHOP)
    shown = (await services.status()).pauses
    assert [(v.record.scope, v.record.name) for v in shown] == [("region", "eu"), ("worker", "w-a")]
    assert 590 < shown[0].left_s <= 600 and shown[1].left_s == 0.0


def _cli(*argv: str) -> PauseSet | PauseResume | PauseList:
    from jetfleet.cli.main import build_parser

    return command_of(build_parser().parse_args(list(argv)))


def test_the_pause_cli_builds_each_scope_and_mode() -> None:
    assert _cli("pause") == PauseSet(scope="fleet", by=actor(argparse.Namespace()))
    assert _cli(
        "pause", "--target", SHOP, "--for", "30m", "--now", "--why", "w", "--as", "ana"
    ) == (PauseSet(scope="target", name=SHOP, for_s=1800.0, mode="now", by="ana", why="w"))
    assert _cli("pause", "--identity", "id a", "--drain", "--as", "ana") == PauseSet(
        scope="identity", name="id a", by="ana"
    )
    assert _cli("resume", "--region", "eu", "--as", "ops") == PauseResume(
        scope="region", name="eu", by="ops"
    )
    assert _cli("pause", "--list") == PauseList()
    with pytest.raises(JetfleetError, match="not a target name"):
        _cli("pause", "--target", "Shop!")
    with pytest.raises(SystemExit):  # argparse: one scope at a time
        _cli("pause", "--target", SHOP, "--worker", "w-a")


async def test_I7_every_pause_and_resume_is_in_the_audit_log(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    await pause(settings, scope="target", name=SHOP, for_s=60.0, mode="now", by="ana", why="x")
    await resume(settings, scope="target", name=SHOP, by="ana", why="done")
    refused = await send_pause(settings, PauseSet(scope="target", name="nope", by="bo"))
    assert not refused.ok
    await send_pause(settings, PauseList())
    entries = [
        msgspec.json.decode(m.data, type=AuditEntry)
        async for m in read_stream(nc.jetstream(), subjects.STREAM_AUDIT, subjects.audit(">"))
    ]
    assert [(e.action, e.who, e.what, e.why, e.outcome) for e in entries] == [
        ("pause", "ana", f"target {SHOP} for 60 s, now", "x", "done"),
        ("resume", "ana", f"target {SHOP}", "done", "done"),
        ("pause", "bo", "target nope until resumed, drain", "", "refused"),
    ], entries
