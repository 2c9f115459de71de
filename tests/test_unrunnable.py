"""Issue 8 item 3: jobs nobody can run must end, and must not starve others.

Real servers throughout: a fresh nats-server per test, the session redis-server, the
simulator as the target. The backstop is kept small (``fleet.max_deliver`` at its
validated minimum for one attempt) so the jobs it ends do so within seconds.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import CommittedResult, Duplicate, Job, NoopOutput, WorkOrder
from jetfleet.schemas.lease import SealedCommit
from nats.aio.client import Client as NatsClient
from nats.js import api as js_api
from nats.js.api import RawStreamMsg

from jetfleet import subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.dev.settings_file import settings_toml
from jetfleet.errors import ConfigError
from jetfleet.identity_presence import IdentityPresence, owned_key
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.dead_letters import list_dead_letters
from jetfleet.ops.status import FleetStatus, confirmed_status
from jetfleet.results import iter_results
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings, TargetSettings, min_max_deliver, validate
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import count_messages, read_stream
from jetfleet.topology import declare
from tests import i2_worker  # noqa: F401  (registers the test.slow handler)
from tests.conftest import make_settings, sim_target, wait_for
from tests.leasing import VERSIONS, grant_fence
from tests.stack import InProcessStack
from tests.test_invariant_i2 import SkewedWorker

pytestmark = pytest.mark.timeout(180)

WINDOW = 4  # the target's max_in_flight: each tier consumer's max_ack_pending
NOBODY = "identity-nobody-has"
# Named like jetfleet's streams, so a run against a user's NATS_URL removes it too.
FACT_STREAM = "JF_TEST_HANDED_BACK"
_PAGES = itertools.count(1)


def unrunnable_settings(
    nats_url: str, redis_url: str, simulator: TargetSimulator, **target: object
) -> Settings:
    """One target with a small window, one attempt per job and the smallest backstop."""
    fields = msgspec.structs.asdict(sim_target(simulator))
    fields.update({"max_in_flight": WINDOW, "max_attempts": 1, **target})
    settings = make_settings(nats_url, redis_url, {"demo": TargetSettings(**fields)})
    fleet = msgspec.structs.replace(settings.fleet, max_deliver=min_max_deliver(settings))
    settings = msgspec.structs.replace(settings, fleet=fleet)
    validate(settings)
    return settings


def pages(n: int) -> list[str]:
    return [f"/page/{next(_PAGES)}" for _ in range(n)]


async def dead_reasons(nc: NatsClient) -> dict[str, str]:
    """Job id -> reason of every dead letter kept."""
    return {e.letter.order.job.id: e.letter.reason for e in await list_dead_letters(nc.jetstream())}


@contextlib.asynccontextmanager
async def running(settings: Settings, workers: int) -> AsyncIterator[InProcessStack]:
    """The services and ``workers`` workers, stopped on the way out."""
    stack = InProcessStack(settings)
    await stack.start(workers=workers)
    try:
        yield stack
    finally:
        await stack.stop()


async def wait_dead(
    nc: NatsClient, job_ids: list[str], timeout_s: float, what: str
) -> dict[str, str]:
    """Wait until each of ``job_ids`` has a dead letter; every letter's reason by job."""

    async def all_dead() -> bool:
        return set(job_ids) <= set(await dead_reasons(nc))

    await wait_for(all_dead, timeout_s, what)
    return await dead_reasons(nc)


async def wait_queued(nc: NatsClient, n: int, what: str) -> None:
    """Wait until ``JF_WORK`` holds exactly ``n`` work orders."""
    js = nc.jetstream()

    async def queued() -> bool:
        return (await js.stream_info(subjects.STREAM_WORK)).state.messages == n

    await wait_for(queued, 30, what)


async def queue_one(stack: InProcessStack) -> tuple[Job, int, RawStreamMsg]:
    """One job submitted and admitted: the job, its work order's sequence and message."""
    nc = stack.connections[0]
    js = nc.jetstream()
    [job] = jobs_for("demo", stack.settings, pages(1))
    await submit_jobs(js, stack.settings, "demo", [job])
    await wait_queued(nc, 1, "the job's work order")
    seq = (await js.stream_info(subjects.STREAM_WORK)).state.last_seq
    return job, seq, await js.get_msg(subjects.STREAM_WORK, seq=seq, direct=False)


async def conserved_status(stack: InProcessStack) -> FleetStatus:
    status = await confirmed_status(stack.connections[0].jetstream(), stack.settings, reads=20)
    assert status.conserved, status
    return status


async def test_item3_a_job_pinned_to_an_identity_no_worker_owns_ends_dead_no_eligible_worker(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=1) as stack:
        nc = stack.connections[0]
        [job] = jobs_for("demo", settings, pages(1), pin_identity=NOBODY)
        await submit_jobs(nc.jetstream(), settings, "demo", [job])

        await wait_dead(nc, [job.id], 60, "the pinned job's dead letter")
        [entry] = await list_dead_letters(nc.jetstream())
        assert entry.letter.reason == "no-eligible-worker"
        assert NOBODY in entry.letter.detail
        assert entry.letter.history == []
        assert simulator.counts()["total"] == 0
        status = await conserved_status(stack)
        assert (status.totals.dead, status.totals.queued, status.totals.leased) == (1, 0, 0)


async def test_item3_a_job_older_than_its_max_age_ends_dead_expired_without_a_request(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    max_age_s = 2.0
    settings = unrunnable_settings(nats_url, redis_url, simulator, max_age_s=max_age_s)
    async with running(settings, workers=0) as stack:  # nobody runs it while it ages
        nc = stack.connections[0]
        js = nc.jetstream()
        [job] = jobs_for("demo", settings, pages(1))
        await submit_jobs(js, settings, "demo", [job])

        await wait_queued(nc, 1, "the work order")
        stored_at = (await js.get_msg(subjects.STREAM_WORK, seq=1, direct=False)).time
        assert stored_at is not None

        async def too_old() -> bool:
            age = await ServerClock(nc).age_s(stored_at)  # a fresh reading each time
            return age is not None and age > max_age_s + 0.5

        await wait_for(too_old, 30, "the job to pass its max age on the server's clock")
        await stack.add_worker("w-late")

        reasons = await wait_dead(nc, [job.id], 30, "the expired job's dead letter")
        assert reasons == {job.id: "expired"}
        assert simulator.counts()["total"] == 0
        status = await conserved_status(stack)
        assert (status.totals.dead, status.totals.committed, status.totals.queued) == (1, 0, 0)


async def test_item3_jobs_nobody_can_run_do_not_starve_runnable_jobs_of_their_tier(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    """Twice the window of pinned-to-nobody jobs queued first, runnable ones behind them
    on the same target and tier: the runnable all commit, the pinned all end dead."""
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=1) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        pinned = jobs_for("demo", settings, pages(2 * WINDOW), pin_identity=NOBODY)
        await submit_jobs(js, settings, "demo", pinned)

        await wait_queued(nc, len(pinned), "the pinned jobs' work orders")
        runnable = jobs_for("demo", settings, pages(6))
        await submit_jobs(js, settings, "demo", runnable)

        async def runnable_committed() -> bool:
            done = await count_messages(js, subjects.STREAM_RESULTS, subjects.results("demo"))
            return done == len(runnable)

        await wait_for(runnable_committed, 90, "the runnable jobs behind the pinned ones")

        reasons = await wait_dead(nc, [j.id for j in pinned], 60, "the pinned jobs' letters")
        assert reasons == {j.id: "no-eligible-worker" for j in pinned}
        status = await conserved_status(stack)
        counts = status.totals
        assert (counts.committed, counts.dead, counts.queued, counts.leased) == (6, 8, 0, 0)


async def test_item3_an_exhausted_job_whose_key_is_committed_ends_a_duplicate_not_dead(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    """The backstop never dead-letters committed work. The advisory is published here in
    the server's own format (docs: next-facts section 2) for a real work message, since
    the leaser settles a committed key (already-done) before max_deliver can run out."""
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=1) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        [page] = pages(1)
        [first] = jobs_for("demo", settings, [page])
        await submit_jobs(js, settings, "demo", [first])

        async def first_committed() -> bool:
            return await count_messages(js, subjects.STREAM_RESULTS, "jf.results.>") == 1

        await wait_for(first_committed, 30, "the first job's commit")
        for worker in stack.workers:
            await worker.drain(5.0)
        [second] = jobs_for("demo", settings, [page])  # the same work, another job id
        await submit_jobs(js, settings, "demo", [second])

        await wait_queued(nc, 1, "the second job's work order")
        seq = (await js.stream_info(subjects.STREAM_WORK)).state.last_seq
        await publish_advisory(nc, seq)

        await wait_queued(nc, 0, "the exhausted work order to be removed")
        assert await dead_reasons(nc) == {}
        records = [
            msgspec.json.decode(m.data, type=Duplicate)
            async for m in read_stream(js, subjects.STREAM_DUPLICATES, "jf.duplicates.>")
        ]
        assert [(r.job_id, r.committed_by) for r in records] == [(second.id, first.id)]
        status = await conserved_status(stack)
        assert (status.totals.submitted, status.totals.committed, status.totals.dead) == (2, 2, 0)


async def publish_advisory(
    nc: NatsClient, seq: int, deliveries: int = 24, at: datetime | None = None
) -> None:
    """A max-deliveries advisory for ``JF_WORK`` message ``seq``, as nats-server sends it
    (at ``at`` by the server's clock; by default a time before any message's)."""
    consumer = subjects.work_consumer("demo")
    stamp = at.strftime("%Y-%m-%dT%H:%M:%S.%f000Z") if at else "2026-01-01T00:00:00.000000000Z"
    body = {
        "type": "io.nats.jetstream.advisory.v1.max_deliver",
        "id": f"test-{seq}",
        "timestamp": stamp,
        "stream": subjects.STREAM_WORK,
        "consumer": consumer,
        "stream_seq": seq,
        "deliveries": deliveries,
    }
    subject = subjects.max_deliveries_advisories(subjects.STREAM_WORK).replace(">", consumer)
    await nc.jetstream().publish(subject, json.dumps(body).encode())


async def test_item3_the_backstop_names_a_job_whose_deliveries_ran_out_past_its_max_age_expired(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    """The backstop's own judgement of age, by the server's clocks (the advisory's time
    against the work order's): deliveries that ran out past the max age end the job
    ``expired``, naming its age. (Workers end an old job at its next delivery, so the
    kept-out test below ends there, not here.)"""
    settings = unrunnable_settings(nats_url, redis_url, simulator, max_age_s=20.0)
    async with running(settings, workers=0) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        job, seq, stored = await queue_one(stack)
        assert stored.time is not None
        await publish_advisory(nc, seq, at=stored.time + timedelta(seconds=25))

        reasons = await wait_dead(nc, [job.id], 30, "the job's letter")
        assert reasons == {job.id: "expired"}
        [entry] = await list_dead_letters(js)
        assert entry.letter.detail == "queued 25 s, more than the 20 s max age"
        await wait_queued(nc, 0, "the exhausted work order to be removed")
        status = await conserved_status(stack)
        assert (status.totals.dead, status.totals.queued) == (1, 0)


async def test_item3_a_job_handed_back_with_a_delay_still_holds_its_place_in_the_window(
    nats_url: str,
) -> None:
    """The JetStream fact the design rests on (docs/topology.md): a message nakked with
    a delay stays ack-pending until it is delivered again, so while the window is full
    of them the consumer delivers nothing else."""
    nc = await _connect(nats_url)
    js = nc.jetstream()
    try:
        await js.add_stream(
            js_api.StreamConfig(
                name=FACT_STREAM,
                subjects=["jf-test-fact.>"],
                retention=js_api.RetentionPolicy.WORK_QUEUE,
            )
        )
        await js.add_consumer(
            FACT_STREAM,
            js_api.ConsumerConfig(
                durable_name="c", ack_policy=js_api.AckPolicy.EXPLICIT, max_ack_pending=2
            ),
        )
        for n in range(3):
            await js.publish("jf-test-fact.x", str(n).encode())
        sub = await js.pull_subscribe_bind("c", stream=FACT_STREAM)
        held = await sub.fetch(2, timeout=2)
        for msg in held:
            await msg.nak(delay=30)
        await nc.flush()

        async def counted() -> bool:
            return bool((await js.consumer_info(FACT_STREAM, "c")).num_ack_pending == 2)

        await wait_for(counted, 10, "both nakked messages to count as ack-pending")
        with pytest.raises(TimeoutError):
            await sub.fetch(1, timeout=1.5)  # the third is not delivered meanwhile
    finally:
        await nc.close()


async def _connect(url: str) -> NatsClient:
    client = NatsClient()
    await client.connect(url)
    return client


async def test_item3_work_consumers_made_with_unlimited_deliveries_are_drift_until_apply(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    nc = await _connect(nats_url)
    js = nc.jetstream()
    try:
        await declare(js, settings)
        name = subjects.work_consumer("demo")
        old = (await js.consumer_info(subjects.STREAM_WORK, name)).config
        old.max_deliver = -1
        await js.add_consumer(subjects.STREAM_WORK, old)  # as an earlier build made it

        drifts = await declare(js, settings)
        assert [(d.what, d.field) for d in drifts] == [
            (f"consumer {subjects.STREAM_WORK}/{name}", "max_deliver")
        ]
        live = await js.consumer_info(subjects.STREAM_WORK, name)
        assert live.config.max_deliver == -1  # reported, never changed silently
        await declare(js, settings, update=True)
        live = await js.consumer_info(subjects.STREAM_WORK, name)
        assert live.config.max_deliver == settings.fleet.max_deliver
        assert await declare(js, settings) == []
    finally:
        await nc.close()


def test_item3_a_backstop_too_close_to_the_attempt_budget_is_refused_naming_the_fix(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    needed = min_max_deliver(settings)
    low = msgspec.structs.replace(settings.fleet, max_deliver=needed - 1)
    with pytest.raises(ConfigError, match=rf"fleet\.max_deliver .* at least {needed}"):
        validate(msgspec.structs.replace(settings, fleet=low))
    old = msgspec.structs.replace(settings.fleet, max_job_age_s=settings.fleet.retention_s + 1)
    with pytest.raises(ConfigError, match=r"fleet\.max_job_age_s .* fleet\.retention_s"):
        validate(msgspec.structs.replace(settings, fleet=old))


def test_item3_a_jobs_max_age_is_its_targets_or_else_the_fleets(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator, max_age_s=30.0)
    assert settings.max_age_s("demo") == 30.0
    plain = unrunnable_settings(nats_url, redis_url, simulator)
    assert plain.max_age_s("demo") == plain.fleet.max_job_age_s


async def test_item3_a_workers_skewed_clock_neither_expires_a_fresh_job_nor_spares_an_old_one(
    nats_url: str, redis_url: str, simulator: TargetSimulator, tmp_path: Path
) -> None:
    """Ages are judged on the server's clock (I9): a worker a day ahead runs a fresh job,
    and a worker a day behind still dead-letters one past its max age."""
    max_age_s = 3.0
    settings = unrunnable_settings(nats_url, redis_url, simulator, max_age_s=max_age_s)
    config = tmp_path / "jetfleet.toml"
    config.write_text(settings_toml(settings))
    async with running(settings, workers=0) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        ahead = SkewedWorker("w-ahead", "+1d", config, tmp_path, settings)
        try:
            await ahead.start()
            assert ahead.clock > 86000, ahead.clock  # its wall clock really is a day ahead
            await wait_pulling(nc, ahead)
            [fresh] = jobs_for("demo", settings, pages(1))
            await submit_jobs(js, settings, "demo", [fresh])

            async def committed() -> bool:
                return await count_messages(js, subjects.STREAM_RESULTS, "jf.results.>") == 1

            await wait_for(committed, 30, f"the fresh job's commit\n{ahead.log_tail()}")
        finally:
            await ahead.stop()

        [old] = jobs_for("demo", settings, pages(1))
        await submit_jobs(js, settings, "demo", [old])
        await wait_queued(nc, 1, "the old job's work order")
        seq = (await js.stream_info(subjects.STREAM_WORK)).state.last_seq
        stored_at = (await js.get_msg(subjects.STREAM_WORK, seq=seq, direct=False)).time
        assert stored_at is not None

        async def too_old() -> bool:
            age = await ServerClock(nc).age_s(stored_at)
            return age is not None and age > max_age_s + 0.5

        await wait_for(too_old, 30, "the old job to pass its max age on the server's clock")
        behind = SkewedWorker("w-behind", "-1d", config, tmp_path, settings)
        try:
            await behind.start()
            assert behind.clock < -86000, behind.clock
            reasons = await wait_dead(
                nc, [old.id], 30, f"the old job's letter\n{behind.log_tail()}"
            )
        finally:
            await behind.stop()
        assert reasons == {old.id: "expired"}
        assert simulator.counts()["total"] == 1  # the fresh job's one request
        status = await conserved_status(stack)
        assert (status.totals.committed, status.totals.dead) == (1, 1)


async def wait_pulling(nc: NatsClient, worker: SkewedWorker) -> None:
    """Wait until ``worker``'s process pulls the demo target's normal tier."""
    js = nc.jetstream()

    async def pulling() -> bool:
        assert worker.proc is not None
        if worker.proc.returncode is not None:
            raise AssertionError(f"{worker.worker_id} exited:\n{worker.log_tail()}")
        info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer("demo"))
        return (info.num_waiting or 0) >= 1

    await wait_for(pulling, 20, f"{worker.worker_id} to pull")


async def test_item3_jobs_pinned_to_an_identity_a_worker_owns_still_run_there_not_dead(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    """The hand-backs that send pinned jobs to the backstop leave them to their owner:
    a worker without the identity pulls beside one that has it, and every job commits."""
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=1) as stack:
        await stack.add_worker("w-alice", identity="alice")
        js = stack.connections[0].jetstream()
        pinned = jobs_for("demo", settings, pages(2 * WINDOW), pin_identity="alice")
        await submit_jobs(js, settings, "demo", pinned)

        async def all_committed() -> bool:
            done = await count_messages(js, subjects.STREAM_RESULTS, "jf.results.>")
            return done == len(pinned)

        await wait_for(all_committed, 60, "every pinned job's commit")
        results = [r async for r in iter_results(js, "demo")]
        assert {(r.job_id, r.identity) for r in results} == {(j.id, "alice") for j in pinned}
        status = await conserved_status(stack)
        assert (status.totals.committed, status.totals.dead) == (len(pinned), 0)


async def test_item3_jobs_pinned_to_a_busy_owner_wait_for_it_and_are_not_dead_lettered(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    """An owner whose slots are all busy does not pull, so only workers without the
    identity see its jobs for a while: long enough to pass the patience, yet the jobs can
    run, so they must wait for it rather than be driven to the backstop."""
    # Attempts run under the target's timeout: room for the slow ones.
    settings = unrunnable_settings(
        nats_url, redis_url, simulator, max_in_flight=8, timeout_s=4 * BUSY_S
    )
    # The default backstop (1000 deliveries): with the smallest one a job waiting past
    # its patience for a busy owner is paced to last its day's max age, minutes a try.
    fleet = msgspec.structs.replace(settings.fleet, handlers=("test.slow",), max_deliver=1000)
    worker = msgspec.structs.replace(settings.worker, concurrency=2)
    settings = msgspec.structs.replace(settings, fleet=fleet, worker=worker)
    async with running(settings, workers=0) as stack:
        await stack.add_worker("w-alice", identity="alice")
        js = stack.connections[0].jetstream()
        # Two jobs take the owner's two slots for BUSY_S; then a worker without the
        # identity starts, and two more jobs, submitted once both run, wait about
        # BUSY_S for the owner.
        blockers = jobs_for(
            "demo",
            settings,
            pages(2),
            pin_identity="alice",
            handler="test.slow",
            args={"sleep_s": str(BUSY_S)},
        )
        await submit_jobs(js, settings, "demo", blockers)

        async def owner_busy() -> bool:
            return bool(simulator.counts()["total"] == len(blockers))  # only alice runs them

        await wait_for(owner_busy, 30, "the owner to run the first two jobs")
        other = await stack.add_worker("w-other")
        waiting = jobs_for(
            "demo",
            settings,
            pages(2),
            pin_identity="alice",
            handler="test.slow",
            args={"sleep_s": "0"},
        )
        await submit_jobs(js, settings, "demo", waiting)
        busy = blockers + waiting

        async def all_ended() -> bool:
            done = await count_messages(js, subjects.STREAM_RESULTS, "jf.results.>")
            return done + len(await dead_reasons(stack.connections[0])) == len(busy)

        await wait_for(all_ended, 90, "every job pinned to the busy owner to end")
        assert await dead_reasons(stack.connections[0]) == {}
        results = [r async for r in iter_results(js, "demo")]
        assert {(r.job_id, r.identity) for r in results} == {(j.id, "alice") for j in busy}
        # Some job did wait past its patience for the busy owner (handed back
        # identity-busy, not sent to the backstop): the case this test is about.
        values = other.hand_backs.values.items()
        assert sum(n for labels, n in values if dict(labels)["reason"] == "identity-busy") > 0


# Longer than a waiting job's patience: eight hand-backs of growing waits that add up
# to at most 11.75 s (runtime.PINNED_PATIENCE, HAND_BACK_MAX_S).
BUSY_S = 15.0


async def test_item3_an_identity_is_owned_while_a_worker_claims_it_and_only_then(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    nc = await _connect(nats_url)
    try:
        await declare(nc.jetstream(), settings)
        presence = IdentityPresence(nc.jetstream())
        assert await presence.owned("alice") is False
        claim = await presence.claim("alice", "w-alice", ttl_s=30)
        reader = IdentityPresence(nc.jetstream())  # no cached answer
        assert await reader.owned("alice")
        assert await reader.owned("bob") is False
        assert owned_key("alice") != owned_key("alice ")  # any identity, its own key
        await presence.release(claim)
        assert await IdentityPresence(nc.jetstream()).owned("alice") is False
    finally:
        await nc.close()


async def test_item3_the_backstop_leaves_a_job_whose_lease_is_live_until_the_lease_ends(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    """Only the live lease's holder may end a delivery: an advisory for a leased job is
    put back, and the job is ended once the lease is given back."""
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    # A lease that outlives the sink's second look (LIVE_LEASE_RETRY_S) by far.
    fleet = msgspec.structs.replace(settings.fleet, lease_ttl_s=20.0, ack_wait_s=30.0)
    settings = msgspec.structs.replace(settings, fleet=fleet)
    validate(settings)
    async with running(settings, workers=0) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        job, seq, stored = await queue_one(stack)
        order = msgspec.json.decode(stored.data or b"", type=WorkOrder)
        leases = LeaseClient(nc)
        fence = await grant_fence(leases, order, "w-holder")
        await publish_advisory(nc, seq)

        async def put_back_and_read_again() -> bool:
            info = await js.consumer_info(
                subjects.STREAM_ADVISORIES, subjects.CONSUMER_MAX_DELIVERIES
            )
            return (info.delivered.consumer_seq or 0) >= 2  # one advisory, read twice

        await wait_for(put_back_and_read_again, 30, "the sink to put the advisory back")
        assert await dead_reasons(nc) == {}
        assert (await js.stream_info(subjects.STREAM_WORK)).state.messages == 1
        assert await leases.release(order.job.id, fence) is True

        reasons = await wait_dead(nc, [job.id], 30, "the letter once the lease is gone")
        assert reasons == {job.id: "deliveries-exhausted"}
        await wait_queued(nc, 0, "the exhausted work order to be removed")
        status = await conserved_status(stack)
        assert (status.totals.dead, status.totals.queued) == (1, 0)


async def test_item3_a_job_kept_out_by_its_targets_cap_waits_out_its_max_age_then_ends_expired(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    """A partitioned target at its cap hands its other jobs back (``target-busy``) with
    waits paced against their deliveries (review finding 2): the backstop cannot end
    a job that could still run before its max age, so it ends ``expired``, not
    ``deliveries-exhausted`` within a minute (its deliveries would have run out in about
    24 x 2 s before the pacing).

    The holder keeps the target's one place a little past the kept-out job's max age,
    then frees it: a job whose deliveries ran out first would have been dead-lettered
    ``deliveries-exhausted`` before that; one that lasted is leased at its next delivery
    and ended ``expired`` unrun. (Held for ever, the job ended only at its 24th delivery,
    about 50 s in: the paced waits last more than twice its 20 s max age.)"""
    settings = unrunnable_settings(
        nats_url, redis_url, simulator, max_in_flight=1, timeout_s=4 * HOLD_S, max_age_s=20.0
    )
    fleet = msgspec.structs.replace(
        settings.fleet, handlers=("test.slow",), dedicated_targets=0, target_partitions=1
    )
    settings = msgspec.structs.replace(settings, fleet=fleet)
    async with running(settings, workers=1) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        # Holds the target's one place for longer than the other job's deliveries last.
        [holder] = jobs_for(
            "demo", settings, pages(1), handler="test.slow", args={"sleep_s": str(HOLD_S)}
        )
        await submit_jobs(js, settings, "demo", [holder])

        async def holding() -> bool:
            return bool(simulator.counts()["total"] == 1)

        await wait_for(holding, 30, "the first job to take the target's place")
        [kept_out] = jobs_for("demo", settings, pages(1))
        await submit_jobs(js, settings, "demo", [kept_out])

        reasons = await wait_dead(nc, [kept_out.id], 120, "the kept-out job's letter")
        assert reasons == {kept_out.id: "expired"}
        [entry] = await list_dead_letters(js)
        assert entry.letter.detail.endswith("more than the 20 s max age"), entry.letter.detail
        assert simulator.counts()["total"] == 1  # only the holder's request
        [worker] = stack.workers
        kept_out_back = sum(
            n
            for labels, n in worker.hand_backs.values.items()
            if dict(labels)["reason"] == "target-busy"
        )
        assert kept_out_back >= 2  # it was kept out by the cap, delivery after delivery


HOLD_S = 24.0  # past the kept-out job's 20 s max age (submitted just after the hold began)


async def test_item3_the_backstop_lands_a_decision_sealed_before_and_writes_no_letter(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    """One terminal decision per job: a commit sealed by a holder whose sink died before
    writing the result is what the backstop lands when the deliveries run out."""
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=0) as stack:
        nc = stack.connections[0]
        js = nc.jetstream()
        _, seq, stored = await queue_one(stack)
        order = msgspec.json.decode(stored.data or b"", type=WorkOrder)
        result = CommittedResult(
            job_id=order.job.id,
            target=order.target,
            url=order.job.url,
            key=order.key,
            handler=order.job.handler,
            worker="w-gone",
            attempt=1,
            duration_s=0.01,
            output=NoopOutput(),
            versions=VERSIONS,
            fence=7,
        )
        store = await LeaseStore.open(js)
        sealed = SealedCommit(fence=7, result=result)
        assert await store.seal(order.job.id, sealed, await store.read_history(order.job.id))
        await publish_advisory(nc, seq)

        await wait_queued(nc, 0, "the exhausted work order to be removed")
        assert await dead_reasons(nc) == {}
        assert [r.job_id async for r in iter_results(js, "demo")] == [order.job.id]
        status = await conserved_status(stack)
        assert (status.totals.committed, status.totals.dead) == (1, 0)
