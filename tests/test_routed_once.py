"""A submission is routed to the work stream once, however late it is redelivered: its
job id's claim is marked routed once the work order is stored (docs/leases.md#job-ids)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from jetfleet.schemas import Job
from jetfleet.services.scheduler.service import Scheduler
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.status import fleet_status
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.topology import declare
from tests.conftest import make_settings, sim_target, wait_for

pytestmark = pytest.mark.timeout(60)
WINDOW_S = 1.0


@pytest.fixture
async def fleet(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> AsyncIterator[tuple[Settings, NatsClient]]:
    settings = make_settings(nats_url, redis_url, {"demo": sim_target(simulator)})
    nc = await connect_nats(settings.nats, "routed-once")
    await declare(nc.jetstream(), settings)
    try:
        yield settings, nc
    finally:
        await nc.close()


async def _one_submission(settings: Settings, nc: NatsClient) -> tuple[Job, Msg]:
    """Submit one job and take its submission as the scheduler's consumer would."""
    job, _, msg = await _probed_submission(settings, nc, "routed-once-probe")
    return job, msg


async def _probed_submission(
    settings: Settings, nc: NatsClient, durable: str
) -> tuple[Job, JetStreamContext.PullSubscription, Msg]:
    """One job submitted, and its submission's first delivery to consumer ``durable``."""
    js = nc.jetstream()
    [job] = jobs_for("demo", settings, ["/page/1"])
    await submit_jobs(js, settings, "demo", [job])
    sub = await js.pull_subscribe(
        subjects.submit(">"), durable=durable, stream=subjects.STREAM_SUBMIT
    )
    [msg] = await sub.fetch(1, timeout=5)
    return job, sub, msg


async def _shorten_duplicate_window(nc: NatsClient) -> None:
    js = nc.jetstream()
    cfg = (await js.stream_info(subjects.STREAM_WORK)).config
    cfg.duplicate_window = WINDOW_S
    await js.update_stream(cfg)


async def _work_messages(nc: NatsClient) -> int:
    info = await nc.jetstream().stream_info(subjects.STREAM_WORK)
    return info.state.messages


async def test_a_submission_redelivered_after_the_work_duplicate_window_is_not_routed_again(
    fleet: tuple[Settings, NatsClient],
) -> None:
    settings, nc = fleet
    await _shorten_duplicate_window(nc)
    _, msg = await _one_submission(settings, nc)
    scheduler = Scheduler(settings, nc)  # not started: only its admission step runs
    store = await LeaseStore.open(nc.jetstream())
    await scheduler._admit_one(store, msg)  # routed; say its ack was lost
    assert await _work_messages(nc) == 1
    # The scenario is time itself: no scheduler ran for longer than the window, so the
    # stream no longer knows the work order's msg id.
    await asyncio.sleep(WINDOW_S * 2)
    msg._ackd = False  # the same delivery again, as a redelivery brings it
    await scheduler._admit_one(store, msg)
    totals = (await fleet_status(nc.jetstream(), settings)).totals
    assert await _work_messages(nc) == 1, f"one submission routed twice: {totals}"
    assert (totals.submitted, totals.queued) == (1, 1), totals


async def test_a_submission_claimed_but_never_routed_is_routed_when_redelivered(
    fleet: tuple[Settings, NatsClient],
) -> None:
    settings, nc = fleet
    job, msg = await _one_submission(settings, nc)
    store = await LeaseStore.open(nc.jetstream())
    # A scheduler claimed the id, then died before storing the work order.
    claim = await store.claim(job.id, msg.metadata.sequence.stream)
    assert not claim.routed
    await Scheduler(settings, nc)._admit_one(store, msg)
    assert await _work_messages(nc) == 1, "the job was lost: claimed, never routed"
    history = (await store.read_history(job.id)).history
    assert history is not None and history.routed_seq > 0


async def test_a_redelivered_submission_whose_job_was_granted_is_acked_not_routed_again(
    fleet: tuple[Settings, NatsClient],
) -> None:
    settings, nc = fleet
    job, msg = await _one_submission(settings, nc)
    store = await LeaseStore.open(nc.jetstream())
    # Routed by a scheduler that died before marking the claim; a worker took the job
    # since, and its work order was acked away.
    await store.claim(job.id, msg.metadata.sequence.stream)
    await store.record_grant(job.id, fence=3)
    await Scheduler(settings, nc)._admit_one(store, msg)
    assert await _work_messages(nc) == 0, "a granted job was routed again"
    info = await nc.jetstream().consumer_info(subjects.STREAM_SUBMIT, "routed-once-probe")
    assert info.num_ack_pending == 0, "the submission was not acked"


async def test_a_submission_whose_admission_failed_is_asked_again_well_before_the_ack_wait(
    fleet: tuple[Settings, NatsClient],
) -> None:
    """A submission the scheduler could not admit (here its id ledger's stream is gone,
    as during an election) is handed back with a short delay, not left to the
    consumer's 30 s ack wait, and is routed once the ledger answers again."""
    settings, nc = fleet
    js = nc.jetstream()
    own = await connect_nats(settings.nats, "scheduler")
    scheduler = Scheduler(settings, own)
    await scheduler.start()
    try:
        [first, second] = jobs_for("demo", settings, ["/page/1", "/page/2"])
        await submit_jobs(js, settings, "demo", [first])

        async def routed(n: int) -> bool:
            return await _work_messages(nc) == n

        async def none_pending() -> bool:
            info = await js.consumer_info(subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER)
            return bool(info.num_ack_pending == 0)

        await wait_for(lambda: routed(1), 10, "the first job routed")
        # Marked routed and acked: only the second submission meets the missing ledger.
        await wait_for(none_pending, 10, "the first submission acked")
        subscriptions = len(own._subs)  # nats-py's own count of the connection's
        await js.delete_stream(f"KV_{subjects.BUCKET_FENCES}")
        await submit_jobs(js, settings, "demo", [second])

        async def asked_again() -> bool:
            info = await js.consumer_info(subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER)
            return bool(info.num_redelivered >= 1)

        # Well within the 30 s ack wait that brought it back before.
        await wait_for(asked_again, 8, "the failed submission delivered again")
        assert await _work_messages(nc) == 1
        await declare(js, settings)  # the ledger is back (empty: the first id is forgotten)
        await wait_for(lambda: routed(2), 10, "the failed submission routed")
        await wait_for(none_pending, 10, "the failed submission acked")
        assert await _work_messages(nc) == 2  # routed once
        # Each failure rebinds the pull subscription; the old ones are let go.
        assert len(own._subs) <= subscriptions
    finally:
        await scheduler.drain(5.0)
        await own.close()


@pytest.mark.parametrize("failed_after_s", [0.0, 26.0], ids=["soon", "near-the-ack-wait"])
async def test_a_failed_admission_is_handed_back_only_while_its_delivery_is_surely_ours(
    fleet: tuple[Settings, NatsClient], failed_after_s: float
) -> None:
    """Handed back (nak, 0.5 s) when it failed soon after its fetch; left alone when it
    failed near the ack wait's end, when the server may have delivered it again already
    and a late nak would cut short that delivery's wait (review of 255d467)."""
    settings, nc = fleet
    js = nc.jetstream()
    _, sub, msg = await _probed_submission(settings, nc, "hand-back-probe")
    store = await LeaseStore.open(js)
    await js.delete_stream(f"KV_{subjects.BUCKET_FENCES}")
    scheduler = Scheduler(settings, nc)  # not started: only its admission step runs
    with pytest.raises(Exception):  # noqa: B017 (whatever the missing stream raises)
        await scheduler._admit_or_hand_back(store, msg, time.monotonic() - failed_after_s)
    if failed_after_s:
        # Left to the probe's 30 s ack wait: not back within 3 s (a nak brings it in 0.5).
        with pytest.raises(NatsTimeoutError):
            await sub.fetch(1, timeout=3)
    else:
        [again] = await sub.fetch(1, timeout=3)
        assert again.metadata.num_delivered == 2
