"""Lease semantics over real NATS JetStream: grant, renew, release, refusals, quarantine,
and several leaser replicas agreeing. The real Leaser (and Sink) answer over NATS."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import pytest
from jetfleet.schemas import (
    HandlerOutput,
    Job,
    LeaseAlreadyDone,
    LeaseGrant,
    LeaseRefusal,
    LeaseReply,
    LeaseRequest,
    NoopOutput,
    WorkOrder,
)
from jetfleet.schemas.lease import (
    QuarantineCommand,
    QuarantineList,
    QuarantineRecord,
    QuarantineRelease,
    QuarantineReply,
    QuarantineSet,
)
from jetfleet.services.leaser import Leaser
from nats.aio.client import Client as NatsClient
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import FetchTimeoutError

from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.client import new_job_id, resolve_url
from jetfleet.connection import connect_nats
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.results import iter_results
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.worker import Worker
from jetfleet.worker.handlers import HandlerContext, handler
from tests.conftest import make_settings, sim_target, wait_for
from tests.leasing import ask, granted, order_for, refused, report, report_failure
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)

TTL_S = 2.0
_encoder = msgspec.json.Encoder()


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """Two targets (for containment), a short lease TTL and a long ack_wait, so an
    immediate requeue cannot be mistaken for a visibility timeout."""
    target = sim_target(simulator)
    return make_settings(
        nats_url,
        redis_url,
        {"demo": target, "other": target},
        lease_ttl_s=TTL_S,
        ack_wait_s=30.0,
        handlers=("test.hold",),
    )


async def quarantine(nc: NatsClient, command: QuarantineCommand) -> QuarantineReply:
    answer = await nc.request(subjects.QUARANTINE, _encoder.encode(command), timeout=5.0)
    reply = msgspec.json.decode(answer.data, type=QuarantineReply)
    assert reply.ok, reply
    return reply


async def test_renew_with_the_live_fence_extends_the_lease_and_a_wrong_fence_is_refused(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/1")
    grant = await granted(client, ask(order))
    assert grant.ttl_s == TTL_S and grant.attempt == 1
    loop = asyncio.get_running_loop()
    granted_at = loop.time()

    # Wrong fences (a lower and a higher one) are refused and change nothing.
    assert await client.renew(order.job.id, grant.fence - 1) is False
    assert await client.renew(order.job.id, grant.fence + 1) is False
    live = await store.live(order.job.id)
    assert live is not None and live.fence == grant.fence

    # Renewing at ttl/3 keeps the key alive for twice its TTL.
    while loop.time() - granted_at < 2 * TTL_S + 0.5:
        assert await client.renew(order.job.id, grant.fence) is True
        live = await store.live(order.job.id)
        assert live is not None and live.fence == grant.fence, "renewal changed the fence"
        await asyncio.sleep(TTL_S / 3)
    assert loop.time() - granted_at > 2 * TTL_S

    # Unrenewed, it lapses by the server's clock; a renewal after that is refused.
    async def gone() -> bool:
        return await store.live(order.job.id) is None

    stopped_at = loop.time()
    await wait_for(gone, 3 * TTL_S, "the unrenewed lease to expire")
    assert loop.time() - stopped_at > TTL_S / 2
    assert await client.renew(order.job.id, grant.fence) is False


async def test_release_then_regrant_gives_a_higher_fence(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/2")
    first = await granted(client, ask(order, worker="w-a"))
    assert await client.release(order.job.id, first.fence - 1) is False  # not the live fence
    assert await client.release(order.job.id, first.fence) is True
    assert await store.live(order.job.id) is None
    assert await client.release(order.job.id, first.fence) is False  # already released

    second = await granted(client, ask(order, worker="w-b"))
    assert second.fence > first.fence
    assert second.attempt == 2
    # The old holder can neither renew nor release the new holder's lease.
    assert await client.renew(order.job.id, first.fence) is False
    assert await client.release(order.job.id, first.fence) is False
    live = await store.live(order.job.id)
    assert live is not None and live.fence == second.fence and live.record.worker == "w-b"
    history = await store.highest_fence(order.job.id)
    assert (history.fence, history.grants) == (second.fence, 2)


async def test_a_second_grant_while_held_is_refused_as_held(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/3")
    first = await granted(client, ask(order, worker="w-a"))
    for worker in ("w-b", "w-a"):  # another worker, and the holder asking twice
        refusal = await refused(client, ask(order, worker=worker))
        assert refusal.reason == "held"
        assert refusal.retry_after_s > 0
        assert "w-a" in refusal.detail
    live = await store.live(order.job.id)
    assert live is not None and live.fence == first.fence
    assert (await store.highest_fence(order.job.id)).grants == 1


async def test_the_same_delivery_asking_again_gets_its_own_grant_back(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    """A grant whose answer was lost: the worker asks again for the same delivery and
    gets that lease back, instead of waiting it out as held and spending an attempt."""
    client = LeaseClient(nc)
    order = order_for(settings, "/page/40")
    delivery = "$JS.ACK.JF_WORK.work-demo-normal.1.40.40.0.0"
    first = await granted(client, ask(order, worker="w-a", reply_subject=delivery))
    again = await granted(client, ask(order, worker="w-a", reply_subject=delivery))
    assert (again.fence, again.attempt) == (first.fence, 1)
    assert (await store.highest_fence(order.job.id)).grants == 1
    # A later delivery of the job, or another worker, is still refused while it is held.
    for worker, reply_subject in (("w-a", delivery + "1"), ("w-b", delivery)):
        refusal = await refused(client, ask(order, worker=worker, reply_subject=reply_subject))
        assert refusal.reason == "held"


async def test_a_dead_job_whose_key_another_job_committed_since_stays_dead_only(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    """Its terminate lost, a dead-lettered job comes back after another job committed
    its key: it is terminated again, not recorded as that commit's duplicate too."""
    client = LeaseClient(nc)
    dead = order_for(settings, "/page/41", idempotency_key="k-41")
    later = order_for(settings, "/page/41", idempotency_key="k-41")
    fence = (await granted(client, ask(dead, worker="w-a"))).fence
    assert (await report_failure(nc, dead, fence, "w-a")).status == "dead-lettered"
    fence = (await granted(client, ask(later, worker="w-b"))).fence
    assert (await report(nc, later, fence, "w-b")).status == "committed"
    assert (await refused(client, ask(dead, worker="w-c"))).reason == "dead-lettered"


async def test_a_committed_key_answers_already_done(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/4")
    grant = await granted(client, ask(order))
    assert (await report(nc, order, grant.fence, "w-a")).status == "committed"
    assert await client.release(order.job.id, grant.fence) is True

    for request in (
        ask(order, worker="w-b"),
        # the same unit of work under another job id: still done
        ask(order, worker="w-b", job_id=new_job_id()),
    ):
        reply: LeaseReply | None = await client.grant(request)
        assert isinstance(reply, LeaseAlreadyDone), reply
        assert reply.key == order.key
    assert await store.live(order.job.id) is None
    assert (await store.highest_fence(order.job.id)).grants == 1


async def test_a_pinned_job_is_granted_only_to_the_owner_of_its_identity(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/5", pin_identity="id-owner")
    assert order.job.pin_identity == "id-owner"
    for identity in ("id-other", ""):
        refusal = await refused(client, ask(order, worker="w-b", identity=identity))
        assert refusal.reason == "wrong-identity"
        assert "id-owner" in refusal.detail
    grant = await granted(client, ask(order, worker="w-a", identity="id-owner"))
    assert grant.fence > 0


async def test_quarantine_is_contained_to_its_target_and_requeues_the_held_job_at_once(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    js = nc.jetstream()
    client = LeaseClient(nc)
    loop = asyncio.get_running_loop()

    # w-q holds a real delivery of a job on demo.
    held = order_for(settings, "/page/6")
    await js.publish(subjects.work("demo", "normal"), _encoder.encode(held))
    sub = await js.pull_subscribe_bind(subjects.work_consumer("demo"), stream=subjects.STREAM_WORK)
    [delivery] = await sub.fetch(1, timeout=5.0)
    assert delivery.metadata.num_delivered == 1
    lease = await granted(client, ask(held, worker="w-q", reply_subject=delivery.reply))
    # A renewed lease (its record now carries the fence) is what a quarantine meets.
    assert await client.renew(held.job.id, lease.fence) is True
    # ... and a job on the other target.
    elsewhere = order_for(settings, "/page/7", target="other")
    other_lease = await granted(client, ask(elsewhere, worker="w-q"))

    record = QuarantineRecord(scope="worker", name="w-q", target="demo", reason="test ban")
    quarantined_at = loop.time()
    answer = await quarantine(nc, QuarantineSet(record=record))
    assert answer.revoked == [held.job.id]

    # The held lease is revoked: the holder can neither renew nor commit under it.
    assert await store.live(held.job.id) is None
    assert await client.renew(held.job.id, lease.fence) is False
    assert (await report(nc, held, lease.fence, "w-q")).status == "rejected:lease-expired"

    # JetStream redelivers the job now, not after ack_wait (30 s).
    redelivered = []

    async def redelivery() -> bool:
        with contextlib.suppress(FetchTimeoutError, NatsTimeoutError, TimeoutError):
            redelivered.extend(await sub.fetch(1, timeout=0.5))
        return bool(redelivered)

    await wait_for(redelivery, 5.0, "the revoked job's redelivery")
    assert loop.time() - quarantined_at < 5.0 < settings.fleet.ack_wait_s
    [again] = redelivered
    assert again.metadata.num_delivered == 2
    assert msgspec.json.decode(again.data, type=WorkOrder).job.id == held.job.id

    # No grant for w-q on demo, whatever the job ...
    fresh = order_for(settings, "/page/8")
    for order in (held, fresh):
        refusal = await refused(client, ask(order, worker="w-q"))
        assert refusal.reason == "quarantined"
        assert refusal.retry_after_s > 0
        assert "test ban" in refusal.detail
    # ... but its other target is untouched (its lease there lives on, new grants work),
    # and other workers still get demo's jobs.
    assert await client.renew(elsewhere.job.id, other_lease.fence) is True
    await granted(client, ask(order_for(settings, "/page/9", target="other"), worker="w-q"))
    takeover = await granted(client, ask(held, worker="w-r", reply_subject=again.reply))
    assert takeover.fence > lease.fence
    assert (await report(nc, held, lease.fence, "w-q")).status == "rejected:fenced-out"

    listed = await quarantine(nc, QuarantineList())
    assert listed.records == [record]

    await quarantine(nc, QuarantineRelease(scope="worker", name="w-q", target="demo"))
    assert (await quarantine(nc, QuarantineList())).records == []
    await granted(client, ask(fresh, worker="w-q"))
    await again.ack()


async def test_an_identity_quarantine_holds_for_every_worker_with_that_identity_on_that_target(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    client = LeaseClient(nc)
    record = QuarantineRecord(scope="identity", name="id-x", target="demo", reason="blocked")
    await quarantine(nc, QuarantineSet(record=record))
    for worker in ("w-1", "w-2"):
        refusal = await refused(
            client, ask(order_for(settings, "/page/10"), worker=worker, identity="id-x")
        )
        assert refusal.reason == "quarantined"
    await granted(client, ask(order_for(settings, "/page/11"), worker="w-1", identity="id-y"))
    await granted(
        client, ask(order_for(settings, "/page/12", target="other"), worker="w-1", identity="id-x")
    )


async def test_a_timed_quarantine_lapses_by_the_servers_clock(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    client = LeaseClient(nc)
    record = QuarantineRecord(
        scope="worker", name="w-t", target="demo", reason="cool-off", for_s=1.0
    )
    await quarantine(nc, QuarantineSet(record=record))
    refusal = await refused(client, ask(order_for(settings, "/page/15"), worker="w-t"))
    assert refusal.reason == "quarantined" and refusal.retry_after_s == 1.0
    order = order_for(settings, "/page/16")

    async def granted_again() -> bool:
        return isinstance(await client.grant(ask(order, worker="w-t")), LeaseGrant)

    await wait_for(granted_again, 5.0, "the timed quarantine to lapse")
    assert (await quarantine(nc, QuarantineList())).records == []


async def test_leaser_replicas_agree_on_exactly_one_grant_among_twenty_concurrent_asks(
    settings: Settings, nc: NatsClient, store: LeaseStore
) -> None:
    replicas: list[Leaser] = []
    connections: list[NatsClient] = []
    answered: Counter[int] = Counter()
    try:
        for n in range(2):
            conn = await connect_nats(settings.nats, f"leaser-{n}")
            connections.append(conn)
            leaser = Leaser(settings, conn)
            await leaser.start()
            await conn.flush()  # the subscriptions are registered at the server now
            replicas.append(leaser)

            # Count which replica decided each grant (the decision itself is untouched).
            def counted(
                leaser: Leaser = leaser, n: int = n
            ) -> Callable[[LeaseRequest], Coroutine[Any, Any, LeaseReply]]:
                real = leaser.grant

                async def grant(request: LeaseRequest) -> LeaseReply:
                    answered[n] += 1
                    return await real(request)

                return grant

            leaser.grant = counted()  # type: ignore[method-assign,assignment]
        callers = [LeaseClient(nc)]
        for n in range(3):
            conn = await connect_nats(settings.nats, f"caller-{n}")
            connections.append(conn)
            callers.append(LeaseClient(conn))

        order = order_for(settings, "/page/13")

        async def race() -> list[LeaseReply | None]:
            return list(
                await asyncio.gather(
                    *(
                        callers[i % len(callers)].grant(ask(order, worker=f"w-{i}"))
                        for i in range(20)
                    )
                )
            )

        fences = []
        for round_no in range(2):  # a first grant, then a re-grant after a release
            replies = await race()
            grants = [r for r in replies if isinstance(r, LeaseGrant)]
            assert len(grants) == 1, replies
            others = [r for r in replies if not isinstance(r, LeaseGrant)]
            assert all(isinstance(r, LeaseRefusal) and r.reason == "held" for r in others), others
            fences.append(grants[0].fence)
            live = await store.live(order.job.id)
            assert live is not None and live.fence == grants[0].fence
            assert (await store.highest_fence(order.job.id)).grants == round_no + 1
            assert await callers[0].release(order.job.id, grants[0].fence) is True
        assert fences[1] > fences[0]
        assert answered[0] > 0 and answered[1] > 0, f"one replica answered all: {answered}"
        assert sum(answered.values()) == 40
    finally:
        for replica in replicas:
            await replica.drain(5.0)
        for conn in connections:
            await conn.close()


async def test_no_result_is_written_by_refused_commits(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    """A commit without any lease is refused and leaves no trace in JF_RESULTS."""
    order = order_for(settings, "/page/14")
    assert (await report(nc, order, 0, "w-a")).status == "rejected:not-granted"
    assert (await report(nc, order, 12345, "w-a")).status == "rejected:not-granted"
    keys = [r.key async for r in iter_results(nc.jetstream(), "demo")]
    assert order.key not in keys


@pytest.mark.parametrize("job_id", ["job.", "a..b", "a.b=c-d_e", "A" * 128])
async def test_every_job_id_admission_accepts_can_be_leased_renewed_and_released(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore, job_id: str
) -> None:
    """A job id the scheduler admits must also work as a lease key; otherwise the job is
    admitted but can never be granted (refused as leaser-error forever)."""
    job = Job(id=job_id, url=resolve_url(settings, "demo", "/page/20"), handler="noop")
    order = admit(subjects.submit("demo"), _encoder.encode(job), settings)
    if not isinstance(order, WorkOrder):
        return  # refused at admission with a reason: fine
    client = LeaseClient(nc)
    reply = await client.grant(ask(order))
    assert isinstance(reply, LeaseGrant), f"job id {job_id!r} admitted but not leasable: {reply}"
    assert await client.renew(job_id, reply.fence) is True
    assert (await report(nc, order, reply.fence, "w-a")).status == "committed"
    assert await client.release(job_id, reply.fence) is True


@pytest.mark.parametrize(
    ("worker", "identity"),
    [
        ("host-1", "alice@example.com"),
        ("host:1234", ""),
        ("w 1", ""),
        ("w.1", "id.x"),
    ],
)
async def test_worker_and_identity_names_do_not_break_grants_or_quarantine(
    settings: Settings, nc: NatsClient, services: InProcessStack, worker: str, identity: str
) -> None:
    """Worker ids and identity names are free text (--id, --identity): the quarantine
    lookup that runs on every grant must not turn them into a refusal for everyone."""
    client = LeaseClient(nc)
    reply = await client.grant(
        ask(order_for(settings, "/page/21"), worker=worker, identity=identity)
    )
    assert isinstance(reply, LeaseGrant), reply
    record = QuarantineRecord(scope="worker", name=worker, target="demo", reason="probe")
    await quarantine(nc, QuarantineSet(record=record))
    refusal = await refused(
        client, ask(order_for(settings, "/page/22"), worker=worker, identity=identity)
    )
    assert refusal.reason == "quarantined"
    await granted(client, ask(order_for(settings, "/page/23"), worker="someone-else"))


# A handler that holds a worker's attempt until its gate opens (no gate: returns at once).
HOLD: dict[str, asyncio.Event] = {}


@handler("test.hold")
async def hold(ctx: HandlerContext) -> HandlerOutput:
    gate = HOLD.get(ctx.worker_id)
    if gate is not None:
        await gate.wait()
    return NoopOutput()


async def test_a_quarantined_worker_does_not_delay_the_requeued_job_for_other_workers(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    """The quarantine requeues the held job at once; if the quarantined worker itself pulls
    the redelivery, its refusal concerns the worker, not the job: the job must still go
    to a healthy worker promptly (well before ack_wait, 30 s here)."""
    order = order_for(settings, "/page/24", handler="test.hold")
    HOLD["Q"] = asyncio.Event()
    started: list[Worker] = []
    try:
        q = Worker(settings, await connect_nats(settings.nats, "Q"), "Q", ["demo"])
        started.append(q)
        await q.start()
        await nc.jetstream().publish(subjects.work("demo", "normal"), _encoder.encode(order))

        async def q_holds_it() -> bool:
            live = await store.live(order.job.id)
            return live is not None and live.record.worker == "Q"

        await wait_for(q_holds_it, 5.0, "Q to lease the job")
        record = QuarantineRecord(scope="worker", name="Q", target="demo", reason="test")
        answer = await quarantine(nc, QuarantineSet(record=record))
        assert answer.revoked == [order.job.id]

        # Q, the only worker pulling, meets the requeued job first and is refused.
        async def q_refused() -> bool:
            return q.stats["refused:quarantined"] >= 1

        await wait_for(q_refused, 5.0, "Q to be refused the requeued job")
        loop = asyncio.get_running_loop()
        refused_at = loop.time()
        r = Worker(settings, await connect_nats(settings.nats, "R"), "R", ["demo"])
        started.append(r)
        await r.start()

        async def committed_by_r() -> bool:
            return r.stats["committed"] == 1

        await wait_for(committed_by_r, 10.0, "a healthy worker to commit the requeued job")
        assert loop.time() - refused_at < 10.0 < settings.fleet.ack_wait_s
    finally:
        HOLD["Q"].set()
        for worker in started:
            await worker.drain(5.0)
            await worker.nc.close()


async def test_a_quarantine_set_after_the_watch_died_is_still_enforced(
    settings: Settings, nc: NatsClient, services: InProcessStack
) -> None:
    """The leaser answers quarantine checks from a KV watch; if the watch dies, it reads
    KV instead of answering 'not quarantined' to every scope it had not seen."""
    assert services.leaser is not None
    watch = services.leaser.quarantine.watch._watching
    assert watch is not None
    watch.cancel()  # as if the watch's subscription had failed
    await asyncio.gather(watch, return_exceptions=True)
    record = QuarantineRecord(scope="worker", name="w-late", target="demo", reason="test")
    await quarantine(nc, QuarantineSet(record=record))
    client = LeaseClient(nc)
    refusal = await refused(client, ask(order_for(settings, "/page/42"), worker="w-late"))
    assert refusal.reason == "quarantined"


async def test_a_release_racing_the_holders_renewal_still_releases(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    """A worker stops its renewals before it releases, but a renewal already sent can land
    between the release's read and its compare-and-set; that must not read as a lost
    lease (the job would then wait for the ack wait instead of being handed back)."""
    client = LeaseClient(nc)
    for n in range(40):
        order = order_for(settings, f"/race/{n}")
        fence = (await granted(client, ask(order, worker="w-a"))).fence
        _, released = await asyncio.gather(
            store.renew(order.job.id, fence, TTL_S), store.release(order.job.id, fence)
        )
        assert released is not None, n
        assert await store.live(order.job.id) is None, n
