"""The leaser replicas' side of an opening against real servers: a replica whose watch
learns of a breaker another replica opened sweeps the target itself, the attempts of
the leases a breaker revokes are given back, and a read that misses a breaker's record
does not make a replica forget it (docs/quarantine.md#the-target-circuit-breaker)."""

from __future__ import annotations

import pytest
from jetfleet.schemas import LeaseGrant, LeaseRefusal
from jetfleet.schemas.breaker import BreakerOpen, BreakerRecord
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.breaker_book import BreakerBook, key
from jetfleet.cli.breaker_commands import send_breaker
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from tests.conftest import wait_for
from tests.leasing import ask, order_for
from tests.stack import InProcessStack
from tests.test_breaker_service import SHOP, breaker_settings


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """The breaker tests' settings: SHOP and NEWS, K = 3 identities in 600 s."""
    return breaker_settings(nats_url, redis_url, simulator)


async def grants_of(store: LeaseStore, job_id: str) -> int:
    history = (await store.read_history(job_id)).history
    assert history is not None
    return history.grants


async def test_a_replica_sweeps_a_target_as_its_watch_learns_of_its_breaker(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    held = order_for(settings, "/page/1", target=SHOP)
    grant = await client.grant(ask(held, worker="w-x", identity="id-x"))
    assert isinstance(grant, LeaseGrant), grant
    assert await grants_of(store, held.job.id) == 1
    # Opened by another leaser replica whose sweeps ran before this one's grant: here,
    # a book that sweeps nothing, so only this replica's watch can revoke the lease.
    js = nc.jetstream()
    other = BreakerBook(js, await js.key_value(subjects.BUCKET_CONTROL))
    assert await other.open(BreakerRecord(target=SHOP, cool_s=600.0, reason="test"), last=0)

    async def revoked_and_refunded() -> bool:
        gone = await store.live(held.job.id) is None
        return gone and await grants_of(store, held.job.id) == 0

    await wait_for(revoked_and_refunded, 10.0, "the lease revoked, its attempt given back")
    again = await client.grant(ask(held, worker="w-x", identity="id-x"))
    assert isinstance(again, LeaseRefusal) and again.reason == "circuit-open", again


async def test_a_breaker_opening_gives_back_the_attempts_of_the_leases_it_revokes(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    held = order_for(settings, "/page/1", target=SHOP)
    assert isinstance(await client.grant(ask(held, worker="w-x")), LeaseGrant)
    record = BreakerRecord(target=SHOP, cool_s=600.0, reason="test")
    reply = await send_breaker(settings, BreakerOpen(record=record))
    assert reply.ok and reply.revoked == [held.job.id], reply
    assert await store.live(held.job.id) is None
    assert await grants_of(store, held.job.id) == 0


async def test_a_read_that_misses_a_breaker_record_does_not_forget_it(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    assert services.leaser is not None
    book = services.leaser.breakers
    # The watch delivered the record, but a read misses it (a lagging R3 follower
    # answering a direct get): here, the key in the watch's set before the record is
    # readable, as that replica sees it.
    book.watch.keys.add(key(subjects.BREAKER_PREFIX, SHOP))
    client = LeaseClient(nc)
    order = order_for(settings, "/page/1", target=SHOP)
    assert isinstance(await client.grant(ask(order, worker="w-x")), LeaseGrant)
    assert await book.record(SHOP) == (None, 0)
    # Still known, so the grants go on reading the record: once it is readable, the
    # breaker is enforced (a record has no TTL: only a delete the watch sees ends it).
    assert book.known(SHOP)
    other = order_for(settings, "/page/2", target=SHOP)
    record = BreakerRecord(target=SHOP, cool_s=600.0, reason="test")
    assert await BreakerBook(nc.jetstream(), book.control).open(record, last=0)
    reply = await client.grant(ask(other, worker="w-y"))
    assert isinstance(reply, LeaseRefusal) and reply.reason == "circuit-open", reply
