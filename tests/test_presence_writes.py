"""A worker writes no KV: its presence goes through the leaser on ``jf.presence``, which
writes exactly the worker's key families and refuses everything else
(docs/identities.md#who-writes-what)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import pytest
from jetfleet.schemas.output import HttpFetch
from jetfleet.schemas.presence import (
    PresenceCreate,
    PresencePut,
    PresenceRefused,
    PresenceReply,
    PresenceUpdate,
    PresenceWrite,
)
from jetfleet.schemas.targets import RobotsRecord
from nats.aio.client import Client as NatsClient
from nats.js.errors import KeyNotFoundError

from jetfleet import subjects
from jetfleet.auth.roles import permissions
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import EmbeddedNats, find_nats_server
from jetfleet.errors import WrongRevision
from jetfleet.identity_presence import IdentityPresence, owned_key
from jetfleet.presence_writer import LeaserPresenceWriter
from jetfleet.region_presence import RegionPresence
from jetfleet.results import iter_results, stored_bytes
from jetfleet.settings import IdentitySettings, NatsSettings, Settings, validate
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.topology import declare
from jetfleet.worker import Worker
from tests.conftest import wait_for
from tests.queueing.helpers import committed, queue_settings, submit_paths, target
from tests.stack import InProcessStack

# The guarded worker's direct writes are refused on purpose (and asserted).
pytestmark = pytest.mark.expects_refusals

WORKER_PUBLISH = permissions("worker").publish
"""What the role table allows a worker to publish (jetfleet/auth/roles.py), applied by a
hand-written server config: the worker's writes must all be in it."""
BIG = 400_000  # above fleet.max_inline_bytes: kept in the object store


class GuardedNats(EmbeddedNats):
    """nats-server with two users: ``admin`` may do anything, ``worker`` only what
    ``WORKER_PUBLISH`` lists (as notes/next-facts.md section 1 configures it)."""

    def start(self, timeout_s: float = 20.0) -> GuardedNats:
        conf = self.data_dir / "nats-server.conf"
        allow = ", ".join(f'"{s}"' for s in WORKER_PUBLISH)
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(
            'listen: "127.0.0.1:-1"\n'
            f'jetstream {{ store_dir: "{self.data_dir / "jetstream"}" }}\n'
            "authorization {\n"
            f"  WORKER = {{ publish: {{ allow: [{allow}] }}, "
            'subscribe: { allow: ["_INBOX.>"] } }\n'
            "  users: [\n"
            "    { user: admin, password: admin-pw }\n"
            "    { user: worker, password: worker-pw, permissions: $WORKER }\n"
            "  ]\n"
            "}\n"
        )
        self._spawn([str(find_nats_server()), "-c", str(conf)])
        match = self._wait_for_log(r"Listening for client connections on [^\n]*:(\d+)", timeout_s)
        self.port = int(match.group(1))
        self._wait_for_log(r"Server is ready", timeout_s)
        return self

    def url_of(self, user: str) -> str:
        return f"nats://{user}:{user}-pw@127.0.0.1:{self.port}"


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[GuardedNats]:
    server = GuardedNats(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Fleet:
    settings: Settings
    stack: InProcessStack
    sim: TargetSimulator
    server: GuardedNats


@pytest.fixture
async def fleet(guarded: GuardedNats, redis_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    """Services on the admin user; no worker yet (a test starts it as ``worker``)."""
    async with TargetSimulator(SimulatorConfig()) as sim:
        base = queue_settings(
            guarded.url_of("admin"),
            redis_url,
            {"pages": target(sim.base_url, obey_robots=True, robots_off_reason="")},
            concurrency=2,
        )
        # This server has its own two users, not the session's bundle.
        base = msgspec.structs.replace(base, nats=NatsSettings(url=guarded.url_of("admin")))
        alice = IdentitySettings(state_dir=str(tmp_path / "alice"), region="eu")
        worker = msgspec.structs.replace(base.worker, claim_ttl_s=3.0)
        settings = msgspec.structs.replace(base, identities={"alice": alice}, worker=worker)
        validate(settings)
        stack = InProcessStack(settings)
        await stack.start(workers=0)
        try:
            yield Fleet(settings, stack, sim, guarded)
        finally:
            await stack.stop()


async def _as_worker(fleet: Fleet, name: str) -> NatsClient:
    nc = await connect_nats(NatsSettings(url=fleet.server.url_of("worker")), name)
    fleet.stack.connections.append(nc)  # closed with the stack
    return nc


async def test_a_worker_that_may_not_write_kv_still_claims_its_identity_and_shares_what_it_learns(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    admin = fleet.stack.connections[0].jetstream()
    nc = await _as_worker(fleet, "w-guarded")
    # The worker's own connection really cannot write the bucket: a direct write is
    # refused by the server (no ack comes).
    with pytest.raises(nats.errors.TimeoutError):
        await nc.jetstream(timeout=1.0).publish(f"$KV.{subjects.BUCKET_WORKERS}.x", b"forged")
    caplog.clear()  # that refusal was this test's own
    worker = Worker(fleet.settings, nc, "w-guarded", identity="alice")
    await worker.start()
    fleet.stack.workers.append(worker)

    presence = IdentityPresence(admin)
    holder = await presence.holder("alice")
    assert holder is not None and holder.worker_id == "w-guarded"
    first = holder.revision

    async def renewed() -> bool:
        now = await presence.holder("alice")
        return now is not None and now.revision > first

    await wait_for(renewed, 10, "a renewal of the claim through the leaser")
    # Its region is announced (region presence), and the robots.txt it fetched for its
    # job is shared, both written by the leaser.
    await wait_for(lambda: RegionPresence(admin).present("eu"), 10, "the region's presence")
    await submit_paths(
        admin, fleet.settings, "pages", [f"/big/1?bytes={BIG}"], "big", store_body=True
    )

    async def done() -> bool:
        return await committed(admin, "pages") == 1

    await wait_for(done, 30, "the job to commit")
    robots = await (await admin.key_value(subjects.BUCKET_ROBOTS)).get("pages")
    assert robots.value and msgspec.json.decode(robots.value, type=RobotsRecord).target == "pages"
    # The large body went to the object store by the worker's two publishes, and reads
    # back intact against the SHA-256 the committed result carries.
    [result] = [r async for r in iter_results(admin, "pages")]
    output = result.output
    assert isinstance(output, HttpFetch) and output.body_object is not None
    assert len(await stored_bytes(admin, output.body_object)) == BIG
    violations = [r for r in caplog.records if "permissions violation" in r.getMessage().lower()]
    assert violations == [], "the worker used a subject outside its permissions"
    await worker.drain(5.0)
    fleet.stack.workers.remove(worker)
    assert await presence.holder("alice") is None, "the drained worker released its claim"


async def _ask(nc: NatsClient, write: PresenceWrite) -> PresenceReply:
    answer = await nc.request(subjects.PRESENCE, msgspec.json.encode(write), timeout=5.0)
    return msgspec.json.decode(answer.data, type=PresenceReply)


async def test_jf_presence_refuses_writes_outside_the_workers_key_families(
    fleet: Fleet,
) -> None:
    nc = await _as_worker(fleet, "w-forger")
    alice_key = owned_key("alice")
    forged: list[PresenceWrite] = [
        # A lease, a fence, a control key: never a worker's to write.
        PresencePut(bucket=subjects.BUCKET_LEASES, key="job-1", value=b"{}"),
        PresencePut(bucket=subjects.BUCKET_FENCES, key="job-1", value=b"{}"),
        PresenceCreate(bucket=subjects.BUCKET_CONTROL, key="pause", value=b"{}", ttl_s=5),
        # A claim taken by a put (no compare-and-set), or one that never lapses.
        PresencePut(bucket=subjects.BUCKET_WORKERS, key=alice_key, value=b"alice\nw\nt", ttl_s=5),
        PresenceCreate(bucket=subjects.BUCKET_WORKERS, key=alice_key, value=b"alice\nw\nt"),
        # A claim whose value names another identity than its key.
        PresenceCreate(bucket=subjects.BUCKET_WORKERS, key=alice_key, value=b"bob\nw\nt", ttl_s=5),
        # A robots record of a target the fleet does not declare.
        PresencePut(
            bucket=subjects.BUCKET_ROBOTS,
            key="elsewhere",
            value=msgspec.json.encode(RobotsRecord(target="elsewhere", status=200)),
        ),
    ]
    for write in forged:
        reply = await _ask(nc, write)
        assert isinstance(reply, PresenceRefused), write
        assert reply.reason == "not-permitted", reply
        assert "jf.presence writes only" in reply.detail and "owned" in reply.detail, reply
    admin = fleet.stack.connections[0].jetstream()
    for bucket, key in [
        (subjects.BUCKET_LEASES, "job-1"),
        (subjects.BUCKET_CONTROL, "pause"),
        (subjects.BUCKET_WORKERS, alice_key),
    ]:
        with pytest.raises(KeyNotFoundError):
            await (await admin.key_value(bucket)).get(key)


async def test_a_lost_compare_and_set_through_jf_presence_is_told_apart_from_a_refusal(
    fleet: Fleet,
) -> None:
    nc = await _as_worker(fleet, "w-cas")
    writer = LeaserPresenceWriter(nc)
    key, value = owned_key("alice"), b"alice\nw-cas\ntoken"
    revision = await writer.create(subjects.BUCKET_WORKERS, key, value, ttl_s=30)
    with pytest.raises(WrongRevision):
        await writer.create(subjects.BUCKET_WORKERS, key, value, ttl_s=30)
    with pytest.raises(WrongRevision):
        await writer.update(subjects.BUCKET_WORKERS, key, value, last=revision + 7, ttl_s=30)
    renewed = await writer.update(subjects.BUCKET_WORKERS, key, value, last=revision, ttl_s=30)
    assert renewed > revision
    with pytest.raises(WrongRevision):
        await writer.delete(subjects.BUCKET_WORKERS, key, last=revision)
    await writer.delete(subjects.BUCKET_WORKERS, key, last=renewed)
    reply = await _ask(
        nc, PresenceUpdate(bucket=subjects.BUCKET_WORKERS, key=key, value=value, last=1, ttl_s=0)
    )
    assert isinstance(reply, PresenceRefused) and reply.reason == "not-permitted", reply


async def test_a_claim_kept_through_the_leaser_survives_the_leaser_being_away_briefly(
    fleet: Fleet,
) -> None:
    nc = await _as_worker(fleet, "w-patient")
    presence = IdentityPresence(nc.jetstream(), writer=LeaserPresenceWriter(nc))
    # The leaser must be back (started, subscribed) inside the last third of the TTL:
    # 4 s here, where a 3 s TTL left 1 s, too little under load.
    claim = await presence.claim("alice", "w-patient", ttl_s=12)
    unsure: list[bool] = []
    keeper = asyncio.create_task(presence.keep(claim, lambda: unsure.append(True)))
    try:
        leaser = fleet.stack.leaser
        assert leaser is not None
        await leaser.drain(5.0)  # no leaser answers jf.presence: like a KV outage

        async def unconfirmed() -> bool:
            return bool(unsure)

        await wait_for(unconfirmed, 15, "the claim to stop being sure")
        assert not keeper.done(), "the renewal loop died while the leaser was away"
        assert not claim.live()
        await fleet.stack.start_leaser()

        async def live_again() -> bool:
            return claim.live()

        await wait_for(live_again, 10, "a renewal once a leaser answers again")
        assert not claim.lost.is_set()
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
    await presence.release(claim)
    assert await IdentityPresence(fleet.stack.connections[0].jetstream()).holder("alice") is None


async def test_a_worker_claim_fails_like_a_kv_outage_when_no_leaser_answers(
    guarded: GuardedNats,
) -> None:
    admin = await nats.connect(guarded.url_of("admin"))
    nc = await connect_nats(NatsSettings(url=guarded.url_of("worker")), "w-alone")
    try:
        settings = queue_settings(
            guarded.url_of("admin"), "redis://unused", {"pages": target("http://127.0.0.1:9")}, 1
        )
        await declare(admin.jetstream(), settings)
        presence = IdentityPresence(nc.jetstream(), writer=LeaserPresenceWriter(nc))
        with pytest.raises(nats.errors.NoRespondersError):
            await presence.claim("alice", "w-alone", ttl_s=3)
        assert await IdentityPresence(admin.jetstream()).holder("alice") is None
    finally:
        await nc.close()
        await admin.close()


async def test_a_worker_started_before_any_leaser_waits_for_one_to_claim_its_identity(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jetfleet.worker.runtime")
    leaser = fleet.stack.leaser
    assert leaser is not None
    await leaser.drain(5.0)
    worker = Worker(fleet.settings, await _as_worker(fleet, "w-early"), "w-early", identity="alice")
    starting = asyncio.create_task(worker.start())

    async def said_it_waits() -> bool:
        return any("no leaser answers jf.presence" in r.getMessage() for r in caplog.records)

    await wait_for(said_it_waits, 10, "the worker to say it waits for a leaser")
    assert not starting.done(), "the worker gave up at once"
    await fleet.stack.start_leaser()
    await asyncio.wait_for(starting, 30)
    fleet.stack.workers.append(worker)
    holder = await IdentityPresence(fleet.stack.connections[0].jetstream()).holder("alice")
    assert holder is not None and holder.worker_id == "w-early"
