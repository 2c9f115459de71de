"""A claim on an identity that no renewal confirms: the worker stops using the identity
once the claim is no longer surely its own (it fetches nothing, stops its handlers and
saves no cookie jar), gives the identity up after ``GIVE_UP_TTLS`` TTLs and quits; and a
single renewal that goes unanswered is tried again before the claim stops being sure
(docs/identities.md#one-live-owner-the-claim)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from jetfleet import identity_presence, subjects
from jetfleet.connection import connect_nats
from jetfleet.identity_presence import IdentityPresence
from jetfleet.simulator import TargetSimulator
from jetfleet.topology import declare
from jetfleet.worker.identity_cookies import COOKIES_FILE, IdentityCookies
from jetfleet.worker.runtime import Worker
from tests.conftest import make_settings, sim_target, wait_for
from tests.queueing.helpers import committed, dead, delivered, submit_paths
from tests.test_identity_announce import alice_in_a_slow_handler, slow_job_settings
from tests.test_invariant_i5 import identity_settings, running

pytestmark = pytest.mark.timeout(90)


async def _cut_off_claims(js: JetStreamContext) -> None:
    """Every renewal fails from now on and none is refused by compare-and-set: the claims
    bucket's stream is gone (as an R1 stream whose server is down would be)."""
    await js.delete_stream(f"KV_{subjects.BUCKET_WORKERS}")


async def _unsure(worker: Worker) -> None:
    claim = worker.claim
    assert claim is not None

    async def not_sure() -> bool:
        return not claim.live()

    await wait_for(not_sure, 10, "the claim to stop being sure")
    assert not claim.lost.is_set(), "given up at once, before it could be renewed again"


async def test_a_worker_whose_claim_cannot_be_renewed_holds_its_jobs_then_gives_it_up(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger=identity_presence.__name__)
    ttl_s = 2.0
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path, claim_ttl_s=ttl_s)
    async with running(settings) as stack:
        js = stack.connections[0].jetstream()
        worker = await stack.add_worker("w-a", identity="alice")
        claim = worker.claim
        assert claim is not None
        quit_at: list[float] = []
        watch = asyncio.create_task(worker.quit.wait())
        watch.add_done_callback(lambda _: quit_at.append(time.monotonic()))
        await _cut_off_claims(js)
        await _unsure(worker)
        await submit_paths(js, settings, "demo", [f"/page/{n}" for n in range(3)], "spin")

        async def quit() -> bool:
            return bool(quit_at)

        await wait_for(quit, 20, "the worker to give its identity up and quit")
        assert claim.lost.is_set()
        # Not given up before its time: a renewal might still have landed until then.
        assert quit_at[0] >= claim.give_up_at
        assert any("gives the identity up" in r.getMessage() for r in caplog.records)
        # While unsure it fetched nothing more than a fetch already waiting brought in,
        # and sent nothing: no lease, no permit, no request with that identity.
        hand_backs = sum(worker.hand_backs.values.values())
        assert hand_backs <= 3, dict(worker.hand_backs.values)
        assert await delivered(js, "demo") <= 3
        assert simulator.counts()["total"] == 0
        await worker.drain(1.0)
        stack.workers.remove(worker)
        # No job was used up: a worker that can run them commits every one.
        await stack.add_worker("w-b")

        async def all_committed() -> bool:
            return await committed(js, "demo") == 3

        await wait_for(all_committed, 30, "the jobs to commit elsewhere")
        assert await dead(js, "demo") == 0


async def test_running_handlers_stop_once_the_claim_is_no_longer_surely_the_workers(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    settings = slow_job_settings(nats_url, redis_url, simulator)
    async with running(settings) as stack:
        worker, js = await alice_in_a_slow_handler(stack, simulator)
        claim = worker.claim
        assert claim is not None
        await _cut_off_claims(js)

        async def stopped() -> bool:
            return not worker._handlers and not worker._tasks

        await wait_for(stopped, 10, "the handler to be stopped")
        stopped_at = time.monotonic()
        assert claim.valid_until <= stopped_at < claim.give_up_at
        assert not claim.lost.is_set()
        assert simulator.counts()["total"] == 1


async def test_a_worker_whose_claim_is_not_sure_at_drain_leaves_the_identitys_jar_alone(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="jetfleet.worker")
    settings = identity_settings(nats_url, redis_url, simulator, tmp_path, claim_ttl_s=2)
    async with running(settings) as stack:
        js = stack.connections[0].jetstream()
        worker = await stack.add_worker("w-a", identity="alice")
        await submit_paths(js, settings, "demo", ["/session/1"], "jar")

        async def done() -> bool:
            return await committed(js, "demo") == 1

        await wait_for(done, 30, "the session page to commit")
        [token] = simulator.sessions_issued()
        assert len(worker.cookies.jar) == 1
        await _cut_off_claims(js)
        await _unsure(worker)
        # Meanwhile another worker may own the identity, and it saved its own jar.
        state_dir = settings.identities["alice"].state_dir
        IdentityCookies("alice", state_dir).save()
        jar = Path(state_dir) / COOKIES_FILE
        theirs = jar.read_bytes()
        await worker.drain(1.0)
        stack.workers.remove(worker)
        assert worker.claim is not None and not worker.claim.lost.is_set()
        assert jar.read_bytes() == theirs, "the newer owner's jar was overwritten"
        assert token.encode() not in theirs
        assert any("cookies of identity alice not saved" in r.getMessage() for r in caplog.records)


async def test_one_renewal_that_goes_unanswered_is_tried_again_while_the_claim_is_sure(
    nats_url: str, redis_url: str, simulator: TargetSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "unanswered-renewal")
    js = nc.jetstream()
    keeper: asyncio.Task[None] | None = None
    try:
        await declare(js, settings)
        presence = IdentityPresence(js)
        claim = await presence.claim("id-x", "w-1", ttl_s=6)
        publish = js.publish
        hung: list[tuple[float, float, float]] = []  # (asked at, its timeout, valid_until)

        async def first_unanswered(*args: Any, **kwargs: Any) -> Any:
            if not hung:
                # The renewal reaches no server and its answer never comes.
                hung.append((time.monotonic(), kwargs["timeout"], claim.valid_until))
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(asyncio.Event().wait(), kwargs["timeout"])
                raise NatsTimeoutError
            return await publish(*args, **kwargs)

        monkeypatch.setattr(js, "publish", first_unanswered)
        unsure: list[float] = []
        keeper = asyncio.create_task(presence.keep(claim, lambda: unsure.append(time.monotonic())))
        revision = claim.revision

        async def renewed_after_the_hang() -> bool:
            return bool(hung) and claim.revision > revision

        await wait_for(renewed_after_the_hang, 10, "a renewal to land after the lost one")
        asked_at, timeout_s, valid_until = hung[0]
        # It waited for the lost answer no longer than half the time the claim had left,
        # so the retry came while the claim was still sure: it never stopped being sure.
        assert timeout_s <= (valid_until - asked_at) / 2 + 0.01
        assert unsure == []
        assert claim.live() and not keeper.done()
        holder = await presence.holder("id-x")
        assert holder is not None and holder.token == claim.token
    finally:
        if keeper is not None:
            keeper.cancel()
        await nc.close()
