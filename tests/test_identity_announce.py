"""A worker's claim on its identity is renewed through server errors, and the answers a
reader caches about other identities stay bounded."""

from __future__ import annotations

import asyncio
import logging
import re

import msgspec
import pytest
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from jetfleet import identity_presence, subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.errors import IdentityOwned
from jetfleet.identity_presence import IdentityPresence, owned_key
from jetfleet.presence_writer import DirectPresenceWriter
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.topology import declare
from jetfleet.worker.runtime import Worker
from tests.conftest import make_settings, sim_target, wait_for
from tests.queueing.helpers import delivered
from tests.stack import InProcessStack
from tests.test_unrunnable import pages, running, unrunnable_settings

pytestmark = pytest.mark.timeout(60)


async def test_claim_keeps_being_renewed_after_the_bucket_refuses_writes_with_api_errors(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=identity_presence.__name__)
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "announce-test")
    js = nc.jetstream()
    task: asyncio.Task[None] | None = None
    try:
        await declare(js, settings)
        kv = await js.key_value(subjects.BUCKET_WORKERS)
        presence = IdentityPresence(js)
        claim = await presence.claim("id-x", "w-1", ttl_s=3)
        task = asyncio.create_task(presence.keep(claim))

        async def revision() -> int:
            try:
                return (await kv.get(owned_key("id-x"))).revision or 0
            except Exception:
                return 0

        async def announced() -> bool:
            return await revision() > 0

        first = await revision()

        async def renewed() -> bool:
            return await revision() > first

        await wait_for(announced, 10, "the claim")
        await wait_for(renewed, 10, "the first renewal")
        # The bucket's stream refuses every write with an API error, as a store that is
        # full or a 503 during a leader election would.
        stream = f"KV_{subjects.BUCKET_WORKERS}"
        cfg = (await js.stream_info(stream)).config
        old_max = cfg.max_msg_size
        cfg.max_msg_size = 1
        await js.update_stream(cfg)

        async def refused() -> bool:
            assert task is not None
            return task.done() or any("failed" in r.getMessage() for r in caplog.records)

        await wait_for(refused, 10, "a beat refused by the server")
        assert not task.done(), f"announce ended on an API error: {task.exception()!r}"
        cfg.max_msg_size = old_max if old_max else -1
        await js.update_stream(cfg)
        before = await revision()

        async def beat_again() -> bool:
            return await revision() > before

        await wait_for(beat_again, 10, "a beat once the store takes writes again")
        assert await presence.owned("id-x")
        assert not claim.lost.is_set()
        warnings = [r for r in caplog.records if "failed" in r.getMessage()]
        assert len(warnings) == 1, "one warning per streak of failures, not one per beat"
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await nc.close()


async def test_owned_answers_cache_stays_bounded_however_many_identities_are_asked(
    nats_url: str, redis_url: str, simulator: TargetSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(identity_presence, "CACHE_MAX", 8, raising=False)
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "announce-test")
    js = nc.jetstream()
    try:
        await declare(js, settings)
        presence = IdentityPresence(js)
        for n in range(30):
            assert not await presence.owned(f"nobody-{n}")
        assert len(presence._answers) <= 8
        assert "nobody-29" in presence._answers, "the newest answer is kept"
    finally:
        await nc.close()


async def test_a_worker_drains_and_closes_its_session_even_if_its_claim_keeper_died(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=0) as stack:
        worker = await stack.add_worker("w-alice", identity="alice")
        assert worker._claiming is not None and worker._session is not None
        worker._claiming.cancel()

        async def died() -> None:
            raise RuntimeError("a server error renewing")

        # A keeper that died of an error, whatever it was, before the drain.
        worker._claiming = asyncio.create_task(died())
        await asyncio.wait([worker._claiming])
        await worker.drain(1.0)
        assert worker._session.closed, "the drain stopped before closing the HTTP session"


async def test_a_claim_that_lapsed_unrenewed_is_lost_not_taken_again(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "lapse-test")
    js = nc.jetstream()
    try:
        await declare(js, settings)
        presence = IdentityPresence(js)
        claim = await presence.claim("id-x", "w-1", ttl_s=2)

        async def lapsed() -> bool:
            return await presence.holder("id-x") is None

        # A process stalled past its TTL (nothing renewed it meanwhile): another worker
        # may have claimed, used and released the identity in between.
        await wait_for(lapsed, 10, "the unrenewed claim to lapse")
        keeper = asyncio.create_task(presence.keep(claim))
        try:
            await asyncio.wait_for(keeper, 10)
            assert claim.lost.is_set()
            assert await presence.holder("id-x") is None, "the lapsed claim was taken again"
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
    finally:
        await nc.close()


async def test_a_renewal_that_landed_though_its_answer_was_lost_is_adopted(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "adopt-test")
    js = nc.jetstream()
    try:
        await declare(js, settings)
        presence = IdentityPresence(js)
        claim = await presence.claim("id-x", "w-1", ttl_s=3)
        # The renewal landed but its answer never came: the revision moved on unseen.
        landed = await js.publish(
            f"$KV.{subjects.BUCKET_WORKERS}.{owned_key('id-x')}", claim.payload, msg_ttl=3
        )
        assert landed.seq != claim.revision
        keeper = asyncio.create_task(presence.keep(claim))
        try:

            async def renewed_after_it() -> bool:
                holder = await presence.holder("id-x")
                return holder is not None and holder.revision > landed.seq

            await wait_for(renewed_after_it, 10, "a renewal on the adopted revision")
            assert not claim.lost.is_set() and not keeper.done()
            holder = await presence.holder("id-x")
            assert holder is not None and holder.token == claim.token
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
    finally:
        await nc.close()


async def test_a_failed_read_after_a_refused_renewal_is_retried_and_the_loss_found(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "take-back-test")
    js = nc.jetstream()
    try:
        await declare(js, settings)
        presence = IdentityPresence(js)
        claim = await presence.claim("id-x", "w-1", ttl_s=3)
        kv = await js.key_value(subjects.BUCKET_WORKERS)
        await kv.delete(owned_key("id-x"))
        await IdentityPresence(js).claim("id-x", "w-rival", ttl_s=30)
        read = presence.holder
        failed: list[str] = []

        async def unanswered_once(identity: str) -> identity_presence.ClaimHolder | None:
            # The read of the key after the refused renewal times out once, as during
            # an election; the next beat's read is answered.
            if not failed:
                failed.append(identity)
                raise TimeoutError
            return await read(identity)

        monkeypatch.setattr(presence, "holder", unanswered_once)
        keeper = asyncio.create_task(presence.keep(claim))
        try:
            await asyncio.wait_for(asyncio.shield(keeper), 10)
            assert failed, "the read never failed"
            assert claim.lost.is_set(), "the loss went unnoticed"
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
    finally:
        await nc.close()


async def test_a_worker_whose_claim_renewal_dies_counts_its_identity_lost(
    nats_url: str, redis_url: str, simulator: TargetSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: IdentityPresence, claim: identity_presence.IdentityClaim) -> None:
        raise RuntimeError("a bug in renewing")

    monkeypatch.setattr(IdentityPresence, "keep", broken)
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=0) as stack:
        worker = await stack.add_worker("w-alice", identity="alice")

        async def quit() -> bool:
            return worker.quit.is_set()

        await wait_for(quit, 10, "the worker to stop once nothing renews its claim")
        assert worker.claim is not None and worker.claim.lost.is_set()
        assert worker._stopping.is_set()
        await worker.drain(1.0)
        holder = await IdentityPresence(stack.connections[0].jetstream()).holder("alice")
        assert holder is None, "still its own, the claim was left to lapse: a restart waits"


async def test_a_worker_whose_identity_another_worker_took_stops_taking_jobs(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    worker_settings = msgspec.structs.replace(settings.worker, claim_ttl_s=2)
    settings = msgspec.structs.replace(settings, worker=worker_settings)
    async with running(settings, workers=0) as stack:
        worker = await stack.add_worker("w-alice", identity="alice")
        js = stack.connections[0].jetstream()
        # Its claim is gone (lapsed while it was cut off, say) and a rival claimed it.
        kv = await js.key_value(subjects.BUCKET_WORKERS)
        await kv.delete(owned_key("alice"))
        await IdentityPresence(js).claim("alice", "w-rival", ttl_s=30)

        async def quit() -> bool:
            return worker.quit.is_set()

        await wait_for(quit, 10, "the worker to notice at its next renewal")
        assert worker.claim is not None and worker.claim.lost.is_set()
        assert worker._stopping.is_set(), "it still pulls jobs"
        await worker.drain(1.0)
        holder = await IdentityPresence(js).holder("alice")
        assert holder is not None and holder.worker_id == "w-rival", "its drain released it"


async def test_release_deletes_a_claim_whose_revision_moved_and_spares_a_rivals(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "release-test")
    js = nc.jetstream()
    try:
        await declare(js, settings)
        presence = IdentityPresence(js)
        claim = await presence.claim("id-x", "w-1", ttl_s=2)
        # A renewal that landed though its answer was lost: the revision moved on.
        await js.publish(f"$KV.{subjects.BUCKET_WORKERS}.{owned_key('id-x')}", claim.payload)
        await presence.release(claim)
        assert await presence.holder("id-x") is None, "a claim still ours was kept"
        stale = await presence.claim("id-y", "w-1", ttl_s=2)

        async def lapsed() -> bool:
            return await presence.holder("id-y") is None

        await wait_for(lapsed, 10, "the unrenewed claim to lapse")
        rival = await presence.claim("id-y", "w-rival", ttl_s=30)
        await presence.release(stale)  # its owner never noticed it had lapsed
        holder = await presence.holder("id-y")
        assert holder is not None and holder.token == rival.token, "a rival's claim was deleted"
    finally:
        await nc.close()


def slow_job_settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """The ``test.slow`` handler, an attempt budget longer than any wait of these tests,
    and claims of 2 s."""
    settings = unrunnable_settings(nats_url, redis_url, simulator, timeout_s=120.0)
    fleet = msgspec.structs.replace(settings.fleet, handlers=("test.slow",))
    worker_settings = msgspec.structs.replace(settings.worker, claim_ttl_s=2)
    return msgspec.structs.replace(settings, fleet=fleet, worker=worker_settings)


async def alice_in_a_slow_handler(
    stack: InProcessStack, simulator: TargetSimulator
) -> tuple[Worker, JetStreamContext]:
    """A worker owning ``alice`` whose one job (90 s of ``test.slow``, far longer than
    the waits of these tests and than drain's timeout) is in its handler."""
    worker = await stack.add_worker("w-alice", identity="alice")
    js = stack.connections[0].jetstream()
    settings = stack.settings
    [job] = jobs_for("demo", settings, pages(1), handler="test.slow", args={"sleep_s": "90"})
    await submit_jobs(js, settings, "demo", [job])

    async def in_its_handler() -> bool:
        return bool(simulator.counts()["total"] == 1) and bool(worker._handlers)

    await wait_for(in_its_handler, 30, "the job to be in its handler")
    return worker, js


async def test_a_worker_that_loses_its_identity_stops_its_running_jobs_at_once(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = slow_job_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=0) as stack:
        worker, js = await alice_in_a_slow_handler(stack, simulator)
        kv = await js.key_value(subjects.BUCKET_WORKERS)
        await kv.delete(owned_key("alice"))
        await IdentityPresence(js).claim("alice", "w-rival", ttl_s=30)

        async def stopped() -> bool:
            return worker.quit.is_set() and not worker._tasks

        await wait_for(stopped, 10, "the running job to be stopped at the loss")
        await worker.drain(1.0)


@pytest.mark.parametrize("why", ["lost", "unrenewed"])
async def test_a_worker_whose_claim_is_not_surely_live_fetches_no_job_and_runs_no_handler(
    nats_url: str, redis_url: str, simulator: TargetSimulator, why: str
) -> None:
    settings = unrunnable_settings(nats_url, redis_url, simulator)
    async with running(settings, workers=0) as stack:
        worker = await stack.add_worker("w-alice", identity="alice")
        assert worker.claim is not None and worker._claiming is not None
        assert worker.claim.live()
        if why == "lost":
            # As a refused renewal leaves it, before the worker stopped for it.
            worker.claim.lost.set()
        else:
            # Its renewals failed past the time the claim surely lives (the server
            # unreachable): it may have lapsed and been taken, though nobody could tell
            # this worker so yet.
            worker._claiming.cancel()
            worker.claim.valid_until = 0.0
        js = stack.connections[0].jetstream()
        held = worker.stats["held:identity-unsure"]
        [job] = jobs_for("demo", settings, pages(1))
        await submit_jobs(js, settings, "demo", [job])

        async def looked_again_and_again() -> bool:
            return worker.stats["held:identity-unsure"] >= held + 12 * len(worker._loops)

        await wait_for(looked_again_and_again, 30, "the pull loops to hold off many times")
        # Only a fetch already waiting when the claim stopped being sure may have brought
        # the job in: it went back unrun, paced, and was not fetched again.
        assert await delivered(js, "demo") <= 1
        assert sum(worker.hand_backs.values.values()) <= 1
        assert simulator.counts()["total"] == 0, "its handler sent a request"
        await worker.drain(1.0)


async def test_a_claim_whose_first_answer_was_lost_is_adopted_not_left_to_refuse_a_restart(
    nats_url: str, redis_url: str, simulator: TargetSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "lost-answer-test")
    js = nc.jetstream()
    try:
        await declare(js, settings)
        writer = DirectPresenceWriter(js)
        presence = IdentityPresence(js, writer=writer)
        kv = await writer.bucket(subjects.BUCKET_WORKERS)
        create = kv.create

        async def answer_lost(key: str, value: bytes, msg_ttl: float | None = None) -> int:
            await create(key, value, msg_ttl=msg_ttl)  # it lands ...
            raise TimeoutError  # ... and its answer never comes

        monkeypatch.setattr(kv, "create", answer_lost)
        claim = await presence.claim("id-x", "w-1", ttl_s=30)
        holder = await presence.holder("id-x")
        assert holder is not None and holder.token == claim.token
        assert claim.revision == holder.revision
    finally:
        await nc.close()


async def test_a_claim_that_vanishes_while_its_create_is_checked_is_claimed_again(
    nats_url: str, redis_url: str, simulator: TargetSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "vanished-test")
    js = nc.jetstream()
    try:
        await declare(js, settings)
        writer = DirectPresenceWriter(js)
        presence = IdentityPresence(js, writer=writer)
        kv = await writer.bucket(subjects.BUCKET_WORKERS)
        create = kv.create
        vanished: list[str] = []

        async def lapsed_mid_check(key: str, value: bytes, msg_ttl: float | None = None) -> int:
            # nats-py's create reads the key after a refused write: the holder's claim
            # lapsed between the two.
            if not vanished:
                vanished.append(key)
                raise KeyNotFoundError
            return await create(key, value, msg_ttl=msg_ttl)

        monkeypatch.setattr(kv, "create", lapsed_mid_check)
        claim = await presence.claim("id-x", "w-1", ttl_s=30)
        assert vanished
        holder = await presence.holder("id-x")
        assert holder is not None and holder.token == claim.token
    finally:
        await nc.close()


async def test_a_refusal_says_how_long_an_aged_claim_lasts_by_the_servers_clock(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "aged-test")
    js = nc.jetstream()
    try:
        await declare(js, settings)
        presence = IdentityPresence(js, ServerClock(nc))
        await presence.claim("id-x", "w-1", ttl_s=30)

        async def aged() -> bool:
            holder = await presence.holder("id-x")
            return holder is not None and holder.left_s is not None and holder.left_s < 28.4

        await wait_for(aged, 10, "the claim to age two seconds")
        with pytest.raises(IdentityOwned) as refused:
            await presence.claim("id-x", "w-2", ttl_s=30)
        found = re.search(r"its claim lasts (\d+) s more unless renewed", str(refused.value))
        assert found is not None, str(refused.value)
        assert 20 <= int(found.group(1)) <= 28, "not the TTL minus the claim's age"
    finally:
        await nc.close()
