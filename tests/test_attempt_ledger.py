"""A job's attempt history lives in its ledger entry (``JobLeaseHistory.attempts``):
each release that ends an attempt carries the worker's record of it, the leaser keeps it
(also when the lease was lost), and the sink's dead letter is written from it, with the
events of attempts made before outcome events moved to per-target subjects (docs/scale.md,
"Subject state", item 1). Real leaser and sink over NATS; the releases and reports are
sent by hand, as a worker sends them."""

from __future__ import annotations

import msgspec
import pytest
from jetfleet.schemas import AttemptRecord, Failure, Outcome, SinkReply
from jetfleet.schemas.lease import LEASE_LOST, LeaseRefusal, LeaseRelease
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.attempt_history import MAX_HISTORY
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.dead_letters import list_dead_letters
from jetfleet.settings import Settings
from tests.leasing import VERSIONS, grant_fence, order_for
from tests.stack import InProcessStack

_encoder = msgspec.json.Encoder()


def attempt(n: int, fence: int, worker: str = "w-a", outcome: str = "retryable") -> AttemptRecord:
    return AttemptRecord(
        attempt=n, worker=worker, fence=fence, duration_s=0.5, outcome=outcome, reason="http-500"
    )


async def test_a_release_carries_its_attempt_into_the_ledger_entry_once(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/1")
    fence = await grant_fence(client, order, "w-a")
    # The record names someone else and another fence: the entry keeps the holder the
    # leaser granted to, under the release's fence.
    forged = msgspec.structs.replace(attempt(1, fence + 7), worker="w-forged")
    assert await client.release(order.job.id, fence, attempt=forged) is True

    read = await store.read_history(order.job.id)
    assert read.history is not None
    assert read.history.attempts == [attempt(1, fence, worker="w-a")]
    # Sent again (its answer was lost): refused, the lease is gone, and no second record
    # and no write.
    assert await client.release(order.job.id, fence, attempt=forged) is False
    again = await store.read_history(order.job.id)
    assert again.revision == read.revision and again.history == read.history


async def test_a_lost_leases_release_records_its_attempt_only_under_the_newest_grant(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/2")
    first = await grant_fence(client, order, "w-a")
    assert await client.release(order.job.id, first)  # its attempt ran: no record sent
    # The newest grant's attempt ended after its lease was gone (the release above
    # played its loss): refused, and its record kept.
    assert await client.release(order.job.id, first, attempt=attempt(1, first)) is False
    history = (await store.read_history(order.job.id)).history
    assert history is not None and history.attempts == [attempt(1, first)]

    # Once a newer grant is made, a lost release of an older fence records nothing:
    # nothing proves that fence was this job's. w-b's lease is untouched.
    second = await grant_fence(client, order, "w-b")
    assert await client.release(order.job.id, first - 1, attempt=attempt(1, first - 1)) is False
    live = await store.live(order.job.id)
    assert live is not None and live.fence == second
    history = (await store.read_history(order.job.id)).history
    assert history is not None and history.attempts == [attempt(1, first)]

    # A fence the entry never granted records nothing.
    reply = await nc.request(
        subjects.LEASE,
        _encoder.encode(
            LeaseRelease(job_id=order.job.id, fence=second + 100, attempt=attempt(9, second + 100))
        ),
        timeout=5.0,
    )
    assert msgspec.json.decode(reply.data, type=LeaseRefusal).reason == LEASE_LOST
    history = (await store.read_history(order.job.id)).history
    assert history is not None and history.attempts == [attempt(1, first)]


async def test_releases_of_never_granted_lower_fences_neither_record_nor_evict(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    """Any worker credential may send releases naming a job: fences are global KV
    revisions, so 1..100 are all at most the entry's highest fence yet were never this
    job's. Each is refused, and none enters the entry, bloats it or pushes out the real
    record (nor does an inflated attempt number reorder or renumber it)."""
    client = LeaseClient(nc)
    order = order_for(settings, "/page/5")
    for n in range(60):  # enough KV revisions that 1..100 lie below the job's fence
        other = order_for(settings, f"/other/{n}")
        assert await client.release(other.job.id, await grant_fence(client, other, "w-x"))
    fence = await grant_fence(client, order, "w-a")
    assert fence > 100
    assert await client.release(order.job.id, fence, attempt=attempt(10**6, fence)) is True
    real = (await store.read_history(order.job.id)).history
    assert real is not None
    assert real.attempts == [attempt(1, fence)]  # numbered at most the grants made

    for forged in range(1, 101):
        record = attempt(10**6 + forged, forged, worker="w-forged", outcome="x" * 10_000)
        assert await client.release(order.job.id, forged, attempt=record) is False
    after = await store.read_history(order.job.id)
    assert after.history == real
    assert after.history is not None and after.history.attempts == [attempt(1, fence)]


async def test_the_dead_letter_takes_its_history_from_the_entry_and_old_events(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    """Attempt 1 ran before the switch (its event on the job's old per-job subject, no
    record in the entry), attempt 2 after it (released with its record), attempt 3 ends
    the job (the worker's own record in its report): the letter lists all three."""
    client = LeaseClient(nc)
    order = order_for(settings, "/page/3")
    js = nc.jetstream()
    fence_1 = await grant_fence(client, order, "w-old")
    old_event = Outcome(
        job_id=order.job.id,
        target=order.target,
        worker="w-old",
        attempt=1,
        kind="retryable",
        duration_s=0.5,
        versions=VERSIONS,
        reason="http-500",
        fence=fence_1,
    )
    await js.publish(subjects.outcome(order.target, order.job.id), _encoder.encode(old_event))
    assert await client.release(order.job.id, fence_1)
    fence_2 = await grant_fence(client, order, "w-a")
    assert await client.release(order.job.id, fence_2, attempt=attempt(2, fence_2))
    fence_3 = await grant_fence(client, order, "w-b")
    last = attempt(3, fence_3, worker="w-b", outcome="permanent")
    failure = Failure(
        order=order,
        worker="w-b",
        reason="attempts-exhausted",
        history=[last],
        versions=VERSIONS,
        fence=fence_3,
    )
    answer = await nc.request(
        subjects.sink_report(order.target), _encoder.encode(failure), timeout=5.0
    )
    assert msgspec.json.decode(answer.data, type=SinkReply).status == "dead-lettered"

    [entry] = [e for e in await list_dead_letters(js) if e.letter.order.job.id == order.job.id]
    assert [(a.attempt, a.worker, a.fence, a.outcome) for a in entry.letter.history] == [
        (1, "w-old", fence_1, "retryable"),
        (2, "w-a", fence_2, "retryable"),
        (3, "w-b", fence_3, "permanent"),
    ]


async def test_the_entrys_history_keeps_the_newest_attempts(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/4")
    fences = []
    for n in range(1, MAX_HISTORY + 6):
        fence = await grant_fence(client, order, "w-a")
        # Refunded, so the job keeps its attempt budget however many times it runs.
        assert await client.release(order.job.id, fence, refund=True, attempt=attempt(n, fence))
        fences.append(fence)
    history = (await store.read_history(order.job.id)).history
    assert history is not None
    assert [a.fence for a in history.attempts] == fences[-MAX_HISTORY:]


async def test_a_failed_record_write_after_the_release_is_answered_as_the_release(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    store: LeaseStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lease is deleted before the record's write: a jf-fences error there must not
    answer ``busy`` (the worker's retry would find the lease lost and the job would wait
    out its whole ack wait instead of its retry delay). The failure is made by hand in
    the leaser's own store; NATS and the release are real."""
    assert services.leaser is not None
    leaser_store = services.leaser.store

    async def failing_amend(*args: object, **kwargs: object) -> None:
        raise TimeoutError("jf-fences did not answer")

    monkeypatch.setattr(leaser_store, "amend", failing_amend)
    client = LeaseClient(nc)
    order = order_for(settings, "/page/6")
    fence = await grant_fence(client, order, "w-a")
    assert await client.release(order.job.id, fence, attempt=attempt(1, fence)) is True
    assert await store.live(order.job.id) is None
    # A lost lease's release whose record cannot be written is refused as ever.
    assert await client.release(order.job.id, fence, attempt=attempt(1, fence)) is False
    history = (await store.read_history(order.job.id)).history
    assert history is not None and history.attempts == []
