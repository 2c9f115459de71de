"""A worker's claim on its identity is renewed through server errors, and the answers a
reader caches about other identities stay bounded."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from jetfleet import identity_presence, subjects
from jetfleet.connection import connect_nats
from jetfleet.identity_presence import IdentityPresence, owned_key
from jetfleet.simulator import TargetSimulator
from jetfleet.topology import declare
from tests.conftest import make_settings, sim_target, wait_for
from tests.test_unrunnable import running, unrunnable_settings

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


async def test_a_claim_that_lapsed_unrenewed_is_taken_again_if_nobody_took_it(
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

        # A process stalled past its TTL (nothing renewed it meanwhile).
        await wait_for(lapsed, 10, "the unrenewed claim to lapse")
        keeper = asyncio.create_task(presence.keep(claim))
        try:

            async def ours_again() -> bool:
                holder = await presence.holder("id-x")
                return holder is not None and holder.token == claim.token

            await wait_for(ours_again, 10, "the claim to be taken again")
            assert not claim.lost.is_set()
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
    finally:
        await nc.close()


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
