"""What a quarantine does to leases, at its edges, against real servers: a grant that
passed the check but lands after both sweeps is taken back; a lease that slipped past
every sweep is revoked at its next renewal; a committed job's lease is not revoked (its
job goes nowhere); a record is replaced in one compare-and-set, never absent between,
and racing commands on one scope all land (docs/quarantine.md, docs/leases.md)."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from jetfleet.schemas import LeaseRefusal
from jetfleet.schemas.lease import (
    QuarantineCommand,
    QuarantineList,
    QuarantineRecord,
    QuarantineReply,
    QuarantineSet,
)
from jetfleet.services.leaser.quarantine_book import record_key
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.target_places import Taken
from tests.conftest import make_settings, sim_target, wait_for
from tests.leasing import ask, granted, order_for, report
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)
_encoder = msgspec.json.Encoder()
TAKE_DELAY_S = 1.5
"""Longer than the second sweep's 1 s after a quarantine is set."""


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """A lease TTL long enough that no lease lapses by itself during a test."""
    return make_settings(nats_url, redis_url, {"demo": sim_target(simulator)}, lease_ttl_s=15.0)


async def command(nc: NatsClient, sent: QuarantineCommand) -> QuarantineReply:
    answer = await nc.request(subjects.QUARANTINE, _encoder.encode(sent), timeout=10.0)
    return msgspec.json.decode(answer.data, type=QuarantineReply)


def ban(name: str, reason: str = "test ban", for_s: float = 0.0) -> QuarantineRecord:
    return QuarantineRecord(scope="worker", name=name, target="demo", reason=reason, for_s=for_s)


async def in_flight(services: InProcessStack) -> int:
    assert services.leaser is not None
    return (await services.leaser.places.counts()).get("demo", 0)


async def test_a_grant_landing_after_both_sweeps_is_taken_back_and_spends_no_attempt(
    nc: NatsClient,
    services: InProcessStack,
    store: LeaseStore,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leaser = services.leaser
    assert leaser is not None
    taking = asyncio.Event()
    take = leaser.places.take

    async def slow_take(target: str, job_id: str, cap: int) -> Taken:
        taking.set()
        # The fault: Redis answers the in-flight cap slower than the second sweep runs.
        await asyncio.sleep(TAKE_DELAY_S)
        return await take(target, job_id, cap)

    monkeypatch.setattr(leaser.places, "take", slow_take)
    order = order_for(settings, "/page/1")
    asking = asyncio.create_task(LeaseClient(nc).grant(ask(order, worker="w-late")))
    await asyncio.wait_for(taking.wait(), 10.0)  # past the quarantine check
    set_reply = await command(nc, QuarantineSet(record=ban("w-late")))
    assert set_reply.ok and set_reply.revoked == []

    reply = await asking
    assert isinstance(reply, LeaseRefusal), reply
    assert reply.reason == "quarantined" and "test ban" in reply.detail
    assert await store.live(order.job.id) is None
    assert (await store.highest_fence(order.job.id)).grants == 0  # no attempt spent
    assert await in_flight(services) == 0  # its place went with it


async def test_a_lease_that_slipped_past_the_sweeps_is_revoked_at_its_renewal(
    nc: NatsClient, services: InProcessStack, store: LeaseStore, settings: Settings
) -> None:
    leaser = services.leaser
    assert leaser is not None
    client = LeaseClient(nc)
    order = order_for(settings, "/page/2")
    lease = await granted(client, ask(order, worker="w-slip"))
    # Another replica's record that no sweep of this one followed: written straight to
    # jf-control, as if every sweep had run before this lease landed.
    record = ban("w-slip", "slipped")
    control = await nc.jetstream().key_value(subjects.BUCKET_CONTROL)
    await control.create(record_key("worker", "w-slip", "demo"), _encoder.encode(record))

    async def seen_by_the_leaser() -> bool:
        return record_key("worker", "w-slip", "demo") in leaser.quarantine.watch.keys

    await wait_for(seen_by_the_leaser, 10.0, "the leaser's watch to see the record")
    assert await store.live(order.job.id) is not None
    assert await client.renew(order.job.id, lease.fence) is False
    assert await store.live(order.job.id) is None
    assert await in_flight(services) == 0
    history = (await store.read_history(order.job.id)).history
    assert history is not None
    assert [(e.scope, e.name) for e in history.avoid] == [("worker", "w-slip")]


async def test_revoking_a_scope_leaves_a_committed_jobs_lease_and_lists_only_jobs_that_go_back(
    nc: NatsClient, services: InProcessStack, store: LeaseStore, settings: Settings
) -> None:
    client = LeaseClient(nc)
    done = order_for(settings, "/page/3")
    running = order_for(settings, "/page/4")
    done_lease = await granted(client, ask(done, worker="w-c"))
    await granted(client, ask(running, worker="w-c"))
    assert (await report(nc, done, done_lease.fence, "w-c")).status == "committed"
    # After the commit the lease is left to expire: it is still live here.
    assert await store.live(done.job.id) is not None

    reply = await command(nc, QuarantineSet(record=ban("w-c")))
    assert reply.ok and reply.revoked == [running.job.id]
    assert await store.live(running.job.id) is None
    done_history = (await store.read_history(done.job.id)).history
    assert done_history is not None and done_history.settled is not None
    assert done_history.avoid == []  # not requeued, so nothing to avoid


async def test_a_record_is_replaced_in_one_write_and_racing_commands_all_land(
    nc: NatsClient, services: InProcessStack
) -> None:
    control = await nc.jetstream().key_value(subjects.BUCKET_CONTROL)
    key = record_key("worker", "w-r", "demo")
    assert (await command(nc, QuarantineSet(record=ban("w-r", "first", for_s=60)))).ok
    watcher = await control.watch(key, include_history=False)
    operations: list[str | None] = []

    async def follow() -> None:
        async for entry in watcher:
            if entry is not None:
                operations.append(entry.operation)

    following = asyncio.create_task(follow())
    try:
        replies = await asyncio.gather(
            *(
                command(nc, QuarantineSet(record=ban("w-r", f"racing {n}", for_s=60 + n)))
                for n in range(8)
            )
        )
        assert [r.detail for r in replies if not r.ok] == []
        listed = await command(nc, QuarantineList())
        assert [r.reason for r in listed.records if r.name == "w-r"] in (
            [[f"racing {n}"] for n in range(8)]
        )

        async def all_seen() -> bool:
            return len(operations) >= 9  # the first record again, then each replacement

        await wait_for(all_seen, 10.0, "the watch to see every write")
        # Replaced, never purged or deleted in between: no grant could pass meanwhile.
        assert set(operations) == {None}
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await watcher.stop()  # type: ignore[no-untyped-call]
