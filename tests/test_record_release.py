"""A release sent only to put an attempt's record in its job's history (the lease was
lost, the sink did not settle the attempt, or a release carrying the record went
unanswered) runs beside the job, not in its slot: asked again while the leaser does not
answer, a bounded number of times, and cancelled by a drain. A stand-in leaser on a real
nats-server chooses what is answered."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from jetfleet.schemas import AttemptRecord
from jetfleet.schemas.lease import LEASE_LOST, LeaseCall, LeaseRefusal, LeaseRelease
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import lease_client, subjects
from jetfleet.settings import Settings
from jetfleet.worker import Worker
from jetfleet.worker import runtime as worker_runtime
from tests.conftest import wait_for

RECORD = AttemptRecord(attempt=1, worker="w-r", fence=7, outcome="retryable", reason="http-500")
_call = msgspec.json.Decoder(LeaseCall)


async def _leaser(nc: NatsClient, silent_for: int) -> list[LeaseRelease]:
    """A stand-in leaser that leaves the first ``silent_for`` calls unanswered and
    refuses the rest ``lease-lost``; the releases it got, in order."""
    got: list[LeaseRelease] = []

    async def answer(msg: Msg) -> None:
        call = _call.decode(msg.data)
        assert isinstance(call, LeaseRelease)
        got.append(call)
        if len(got) > silent_for:
            await nc.publish(msg.reply, msgspec.json.encode(LeaseRefusal(reason=LEASE_LOST)))

    await nc.subscribe(subjects.LEASE, queue=subjects.QUEUE_LEASER, cb=answer)
    await nc.flush()
    return got


@pytest.fixture(autouse=True)
def short_lease_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # An unanswered call costs its whole timeout: short, so the test does not wait 3 s
    # per silent ask.
    monkeypatch.setattr(lease_client, "TIMEOUT_S", 0.3)


async def test_an_unanswered_record_release_is_asked_again_in_the_background(
    settings: Settings, nc: NatsClient
) -> None:
    got = await _leaser(nc, silent_for=1)
    worker = Worker(settings, nc, "w-r", ["demo"])
    started = time.monotonic()
    worker._record_in_background("job-r", 7, RECORD, tries=0)
    assert time.monotonic() - started < 0.1  # nothing awaited: the slot is free at once

    async def answered() -> bool:
        return len(got) == 2 and not worker._records

    await wait_for(answered, 10.0, "the record's release asked again and answered")
    assert got == [LeaseRelease(job_id="job-r", fence=7, attempt=RECORD)] * 2


async def test_a_silent_leaser_gets_a_bounded_number_of_asks_and_a_drain_cancels_them(
    settings: Settings, nc: NatsClient
) -> None:
    got = await _leaser(nc, silent_for=1_000)
    worker = Worker(settings, nc, "w-r", ["demo"])
    worker._record_in_background("job-a", 7, RECORD, tries=0)

    async def given_up() -> bool:
        return not worker._records

    await wait_for(given_up, 20.0, "the record's releases to give up")
    assert len(got) == worker_runtime.RECORD_TRIES

    for n in range(worker_runtime.RECORDS_IN_FLIGHT + 5):
        worker._record_in_background(f"job-{n}", 7, RECORD, tries=0)
    assert len(worker._records) == worker_runtime.RECORDS_IN_FLIGHT  # the rest dropped
    started = time.monotonic()
    await asyncio.wait_for(worker.drain(timeout_s=5.0), 10.0)
    assert not worker._records
    assert time.monotonic() - started < worker_runtime.RECORD_DRAIN_S + 3.0
