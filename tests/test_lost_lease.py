"""A worker that lost its lease never acks, naks or terms the job (notes: "JetStream does
NOT tie an ack to the delivery it came from").

Worker A holds delivery 1 of job J and stalls past its lease TTL and ack_wait; JetStream
redelivers J to worker B, which takes a new lease. When A finishes, its commit is rejected
and A sends nothing on its delivery's reply subject: an ack there would delete J under B,
a nak would deliver it a third time, a term would delete it. Every ack, nak, term and
+WPI is observed on the wire by a subscriber to ``$JS.ACK.>``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import msgspec
import pytest
from jetfleet.schemas import DataOutput, DeadLetter, HandlerOutput, Job, WorkOrder
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.client import new_job_id, resolve_url
from jetfleet.connection import connect_nats
from jetfleet.errors import PermanentFailure
from jetfleet.lease_store import LeaseStore
from jetfleet.results import iter_results
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from jetfleet.worker import Worker, runtime
from jetfleet.worker.handlers import HandlerContext, handler
from jetfleet.worker.verdict import Held
from tests.conftest import make_settings, sim_target, wait_for
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)

TTL_S = 2.0
ACK_WAIT_S = 4.0
BARRIER = "jf-test.barrier"
_encoder = msgspec.json.Encoder()

# The gated handler: each worker's attempt announces itself and waits for its gate.
ENTERED: dict[str, asyncio.Event] = {}
GATES: dict[str, asyncio.Event] = {}
CANCELLED: dict[str, asyncio.Event] = {}


@handler("test.gate")
async def gated(ctx: HandlerContext) -> HandlerOutput:
    ENTERED[ctx.worker_id].set()
    try:
        await GATES[ctx.worker_id].wait()
    except asyncio.CancelledError:
        CANCELLED[ctx.worker_id].set()
        raise
    return DataOutput(data={"worker": ctx.worker_id})


class RecordingWorker(Worker):
    """A real worker that notes each delivery it processes and when it is done with it."""

    def __init__(self, settings: Settings, nc: NatsClient, worker_id: str) -> None:
        super().__init__(settings, nc, worker_id, ["demo"])
        self.deliveries: list[tuple[int, str]] = []
        self.finished: list[int] = []
        ENTERED[worker_id] = asyncio.Event()
        GATES[worker_id] = asyncio.Event()
        CANCELLED[worker_id] = asyncio.Event()

    async def _process(self, msg: Msg, target: str) -> None:
        self.deliveries.append((msg.metadata.num_delivered, msg.reply))
        try:
            await super()._process(msg, target)
        finally:
            self.finished.append(msg.metadata.num_delivered)


class StalledWorker(RecordingWorker):
    """A worker whose lease keeper never runs: no renewal, no +WPI (a stall, a GC pause)."""

    async def _keep_lease(self, msg: Msg, order: WorkOrder, held: Held) -> None:
        return


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    target = sim_target(simulator)
    return make_settings(
        nats_url,
        redis_url,
        {"demo": target},
        lease_ttl_s=TTL_S,
        ack_wait_s=ACK_WAIT_S,
        handlers=("test.gate", "test.gate-refused"),
    )


class Workers:
    """Workers started by a test, each on its own connection; drained at the end."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started: list[RecordingWorker] = []

    async def start(
        self, kind: type[RecordingWorker], worker_id: str, concurrency: int = 1
    ) -> RecordingWorker:
        # One slot: while its handler runs, the worker cannot fetch the redelivery itself.
        settings = msgspec.structs.replace(
            self.settings,
            worker=msgspec.structs.replace(self.settings.worker, concurrency=concurrency),
        )
        worker = kind(settings, await connect_nats(settings.nats, worker_id), worker_id)
        await worker.start()
        self.started.append(worker)
        return worker

    async def stop(self) -> None:
        for gate in GATES.values():
            gate.set()
        for worker in self.started:
            await worker.drain(5.0)
            await worker.nc.close()


@pytest.fixture
async def workers(settings: Settings, services: InProcessStack) -> AsyncIterator[Workers]:
    started = Workers(settings)
    yield started
    await started.stop()


class AckWire:
    """Everything any connection publishes to a work delivery's reply subject."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []
        self.barriers: set[str] = set()

    async def listen(self, nc: NatsClient) -> None:
        async def on_ack(msg: Msg) -> None:
            self.seen.append((msg.subject, msg.data))

        async def on_barrier(msg: Msg) -> None:
            self.barriers.add(msg.data.decode())

        await nc.subscribe(f"$JS.ACK.{subjects.STREAM_WORK}.>", cb=on_ack)
        await nc.subscribe(BARRIER, cb=on_barrier)
        await nc.flush()

    def on(self, reply: str) -> list[bytes]:
        return [data for subject, data in self.seen if subject == reply]

    async def everything_sent_by(self, worker: Worker) -> None:
        """Wait until all ``worker`` published so far has reached this subscriber (NATS
        keeps one publisher's messages in order for a subscriber)."""
        token = new_job_id()
        await worker.nc.publish(BARRIER, token.encode())
        await worker.nc.flush()

        async def arrived() -> bool:
            return token in self.barriers

        await wait_for(arrived, 5.0, f"the barrier from {worker.worker_id}")


def is_set(event: asyncio.Event) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return event.is_set()

    return check


def not_empty(items: list[int]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(items)

    return check


def kinds(frames: Iterable[bytes]) -> list[str]:
    # An empty payload is an ack too (nats-py's msg.ack() sends one).
    return [(frame.split(b" ", 1)[0] or b"+ACK").decode() for frame in frames]


async def work_state(nc: NatsClient) -> tuple[int, int, int]:
    """(messages in the work stream, acks pending, deliveries made) for target demo."""
    js = nc.jetstream()
    stream = await js.stream_info(subjects.STREAM_WORK)
    info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer("demo"))
    return stream.state.messages, info.num_ack_pending or 0, info.delivered.consumer_seq


async def publish_job(settings: Settings, nc: NatsClient, handler: str = "test.gate") -> WorkOrder:
    job = Job(id=new_job_id(), url=resolve_url(settings, "demo", "/page/1"), handler=handler)
    order = admit(subjects.submit("demo"), _encoder.encode(job), settings)
    assert isinstance(order, WorkOrder), order
    await nc.jetstream().publish(subjects.work("demo", "normal"), _encoder.encode(order))
    return order


async def a_runs_j(
    settings: Settings, nc: NatsClient, workers: Workers, kind: type[RecordingWorker]
) -> tuple[RecordingWorker, WorkOrder, str, AckWire]:
    """Watch the ack wire, start worker A of ``kind`` and publish job J; once A's handler
    runs J: A, J's order, the reply subject of A's delivery, and the wire."""
    wire = AckWire()
    await wire.listen(nc)
    a = await workers.start(kind, "A")
    order = await publish_job(settings, nc)
    await wait_for(is_set(ENTERED["A"]), 5.0, "A to start J")
    [(_, reply)] = a.deliveries
    return a, order, reply, wire


async def test_a_worker_that_lost_its_lease_never_acks_naks_or_terms_the_job(
    settings: Settings, nc: NatsClient, services: InProcessStack, workers: Workers
) -> None:
    store = await LeaseStore.open(nc.jetstream())
    wire = AckWire()
    await wire.listen(nc)
    loop = asyncio.get_running_loop()

    # A takes delivery 1 of J and stalls in its handler without renewing.
    a = await workers.start(StalledWorker, "A")
    order = await publish_job(settings, nc)
    job = order.job.id
    await wait_for(is_set(ENTERED["A"]), 5.0, "A to start J")
    [(delivered, reply_1)] = a.deliveries
    assert delivered == 1
    lease_a = await store.live(job)
    assert lease_a is not None and lease_a.record.worker == "A"
    taken_at = loop.time()

    b = await workers.start(RecordingWorker, "B")

    # A's lease lapses by the server's clock while A is still working ...
    async def lease_gone() -> bool:
        return await store.live(job) is None

    await wait_for(lease_gone, 3 * TTL_S, "A's lease to expire")
    assert a.finished == []
    # ... then ack_wait passes and JetStream hands J to B, who takes a new lease.
    await wait_for(is_set(ENTERED["B"]), 3 * ACK_WAIT_S, "B to start J")
    assert loop.time() - taken_at >= ACK_WAIT_S - 1.0
    [(delivered, reply_2)] = b.deliveries
    assert delivered == 2 and reply_2 != reply_1
    lease_b = await store.live(job)
    assert lease_b is not None and lease_b.record.worker == "B"
    assert lease_b.fence > lease_a.fence

    # A finishes: its commit is fenced out and it leaves the message alone.
    GATES["A"].set()
    await wait_for(not_empty(a.finished), 5.0, "A to finish")
    assert a.stats["rejected:fenced-out"] == 1
    assert a.stats["committed"] == 0
    await wire.everything_sent_by(a)
    assert wire.on(reply_1) == [], f"A touched its superseded delivery: {wire.on(reply_1)}"
    assert await work_state(nc) == (1, 1, 2)  # J still there, leased once, delivered twice
    assert not CANCELLED["B"].is_set() and b.finished == []  # B is still on it
    live = await store.live(job)
    assert live is not None and live.fence == lease_b.fence
    assert [r async for r in iter_results(nc.jetstream(), "demo")] == []
    # A's attempt ran all the same, and its release carries its record; refused (the
    # lease is B's), it leaves J's history alone: A's fence is below B's newest grant,
    # and a lower fence proves nothing about J.
    assert services.leaser is not None
    latency = services.leaser.latency

    async def a_release_refused() -> bool:
        return latency.count(op="release", answer="refused") >= 1

    await wait_for(a_release_refused, 10.0, "A's release carrying its record to be refused")
    kept = await store.highest_fence(job)
    assert kept.attempts == []

    # B finishes: committed once, J acked and gone, no third delivery.
    GATES["B"].set()

    async def b_committed() -> bool:
        return b.stats["committed"] == 1 and (await work_state(nc))[0] == 0

    await wait_for(b_committed, 5.0, "B to commit and ack J")
    assert b.finished == [2]
    assert a.deliveries == [(1, reply_1)] and len(b.deliveries) == 1
    assert await work_state(nc) == (0, 0, 2)
    await wire.everything_sent_by(b)
    assert wire.on(reply_1) == []
    assert kinds(wire.on(reply_2))[-1] == "+ACK"
    assert set(kinds(wire.on(reply_2))[:-1]) <= {"+WPI"}
    results = [r async for r in iter_results(nc.jetstream(), "demo")]
    assert [(r.job_id, r.worker, r.fence) for r in results] == [(job, "B", lease_b.fence)]
    assert services.sink is not None
    assert services.sink.counts == {"rejected:fenced-out": 1, "committed": 1}


async def test_a_worker_whose_renewal_is_refused_abandons_the_job_and_leaves_the_message(
    settings: Settings, nc: NatsClient, services: InProcessStack, workers: Workers
) -> None:
    """The ordinary worker's path: its renewal is refused (the lease was revoked without a
    requeue), so it cancels the handler, sends nothing more, and the job comes back to
    another worker after ack_wait."""
    store = await LeaseStore.open(nc.jetstream())
    a, order, reply_1, wire = await a_runs_j(settings, nc, workers, RecordingWorker)
    live = await store.live(order.job.id)
    assert live is not None
    assert await store.revoke(live) is True  # the lease is gone; nobody naks the delivery

    await wait_for(is_set(CANCELLED["A"]), 2 * TTL_S, "A to give up J")
    await wait_for(not_empty(a.finished), 5.0, "A to finish")
    assert a.stats["lease-lost"] == 1
    # The cancelled attempt is in J's history: A's release after the loss recorded it.
    kept = await store.highest_fence(order.job.id)
    assert [(r.worker, r.fence, r.outcome, r.reason) for r in kept.attempts] == [
        ("A", live.fence, "retryable", "lease-lost")
    ]
    await wire.everything_sent_by(a)
    assert set(kinds(wire.on(reply_1))) <= {"+WPI"}, wire.on(reply_1)
    sent_by_a = len(wire.on(reply_1))
    assert (await work_state(nc))[:2] == (1, 1)
    await a.drain(5.0)  # A leaves (so the redelivery goes to B); it drains nothing

    b = await workers.start(RecordingWorker, "B")
    GATES["B"].set()

    async def b_committed() -> bool:
        return b.stats["committed"] == 1 and (await work_state(nc))[0] == 0

    await wait_for(b_committed, 3 * ACK_WAIT_S, "B to get, commit and ack J")
    assert [d for d, _ in b.deliveries] == [2]
    assert len(wire.on(reply_1)) == sent_by_a  # nothing more from A, ever
    assert (await work_state(nc))[2] == 2
    results = [r async for r in iter_results(nc.jetstream(), "demo")]
    assert [(r.job_id, r.worker) for r in results] == [(order.job.id, "B")]


@handler("test.gate-refused")
async def gated_refused(ctx: HandlerContext) -> HandlerOutput:
    ENTERED[ctx.worker_id].set()
    await GATES[ctx.worker_id].wait()
    raise PermanentFailure("test-refused", f"refused to {ctx.worker_id}")


async def test_a_lost_attempt_superseded_by_a_newer_grant_stays_out_of_the_ledger(
    settings: Settings, nc: NatsClient, services: InProcessStack, workers: Workers
) -> None:
    """A stalls past its lease, B takes J over; both attempts fail for good. A's report
    is fenced out and its release (carrying its record) refused: its fence is below the
    newest grant's, and a lower fence proves nothing about J (fences are global, so
    accepting one would let anyone's releases evict J's real records). B dead-letters J:
    the letter lists B's attempt, and A's is in neither the entry nor the letter."""
    store = await LeaseStore.open(nc.jetstream())
    a = await workers.start(StalledWorker, "A")
    order = await publish_job(settings, nc, handler="test.gate-refused")
    job = order.job.id
    await wait_for(is_set(ENTERED["A"]), 5.0, "A to start J")
    lease_a = await store.live(job)
    assert lease_a is not None

    b = await workers.start(RecordingWorker, "B")
    await wait_for(is_set(ENTERED["B"]), 3 * (TTL_S + ACK_WAIT_S), "B to start J")
    lease_b = await store.live(job)
    assert lease_b is not None and lease_b.fence > lease_a.fence
    GATES["A"].set()
    await wait_for(not_empty(a.finished), 5.0, "A to finish")
    assert a.stats["rejected:fenced-out"] == 1
    assert services.leaser is not None
    latency = services.leaser.latency

    async def a_release_refused() -> bool:
        return latency.count(op="release", answer="refused") >= 1

    await wait_for(a_release_refused, 10.0, "A's release carrying its record to be refused")
    entry = (await store.read_history(job)).history
    assert entry is not None and entry.attempts == []
    GATES["B"].set()
    await wait_for(not_empty(b.finished), 5.0, "B to finish")
    assert b.stats["dead-lettered"] == 1

    [letter] = [
        msgspec.json.decode(m.data, type=DeadLetter)
        async for m in read_stream(nc.jetstream(), subjects.STREAM_DLQ, "jf.dlq.>")
    ]
    assert letter.reason == "test-refused"
    assert [(r.worker, r.fence, r.outcome) for r in letter.history] == [
        ("B", lease_b.fence, "permanent"),
    ]


class CrashingWorker(RecordingWorker):
    """A worker with a bug in what follows a job's attempt: both of its ends crash."""

    def __init__(self, settings: Settings, nc: NatsClient, worker_id: str) -> None:
        super().__init__(settings, nc, worker_id)
        self.crashed: list[str] = []

    def _record_unsettled(self, order: WorkOrder, held: Held) -> None:
        self.crashed.append("lost")
        raise RuntimeError("a bug after the lease was lost")

    async def _settle(self, msg: Msg, order: WorkOrder, held: Held, *args: object) -> None:
        self.crashed.append("settle")
        raise RuntimeError("a bug while the lease is held")


async def test_a_worker_that_crashes_after_losing_its_lease_leaves_the_message_alone(
    settings: Settings, nc: NatsClient, services: InProcessStack, workers: Workers
) -> None:
    """The crash path gives a job back with a nak only while the delivery is surely still
    the worker's: after its lease was lost, a nak could deliver it again under another
    worker. The same crash with the lease held naks (the wire sees it)."""
    store = await LeaseStore.open(nc.jetstream())
    # Lease lost (revoked while the handler runs): the crash sends nothing.
    a, order, reply_1, wire = await a_runs_j(settings, nc, workers, CrashingWorker)
    assert isinstance(a, CrashingWorker)
    live = await store.live(order.job.id)
    assert live is not None
    assert await store.revoke(live) is True
    await wait_for(is_set(CANCELLED["A"]), 2 * TTL_S, "A to give up J")
    await wait_for(not_empty(a.finished), 5.0, "A to end J in its crash")
    await wire.everything_sent_by(a)
    assert a.crashed == ["lost"]
    assert set(kinds(wire.on(reply_1))) <= {"+WPI"}, wire.on(reply_1)
    assert (await work_state(nc))[:2] == (1, 1)  # still there, left to its ack wait

    # Lease held: J comes back after its ack wait, the handler ends, the settle crashes,
    # and J is naked back.
    GATES["A"].set()

    async def second_delivery_ended() -> bool:
        return len(a.finished) >= 2

    await wait_for(second_delivery_ended, 3 * ACK_WAIT_S, "A to end J's redelivery")
    (_, reply_2) = a.deliveries[1]
    assert reply_2 != reply_1
    await wire.everything_sent_by(a)
    assert a.crashed[:2] == ["lost", "settle"]
    assert "-NAK" in kinds(wire.on(reply_2)), wire.on(reply_2)
    assert set(kinds(wire.on(reply_1))) <= {"+WPI"}, wire.on(reply_1)


async def test_a_drain_whose_lease_release_fails_still_gives_the_job_back(
    settings: Settings, nc: NatsClient, services: InProcessStack, workers: Workers
) -> None:
    """A drain cancels a running job; its lease release raises (the connection lost, as
    the release is asked). The cancel stands and the drain ends, and the job, whose lease
    was not lost and whose ack wait has not run out, is naked back for another worker."""
    a, order, reply_1, wire = await a_runs_j(settings, nc, workers, RecordingWorker)

    async def release_fails(*args: object, **kwargs: object) -> bool | None:
        raise ConnectionError("connection lost as the release was asked")

    a.leases.release = release_fails  # type: ignore[method-assign]
    await a.drain(0.2)  # the handler waits on its gate: cancelled
    assert CANCELLED["A"].is_set() and a.finished == [1]
    await wire.everything_sent_by(a)
    assert kinds(wire.on(reply_1))[-1] == "-NAK", wire.on(reply_1)

    b = await workers.start(RecordingWorker, "B")
    GATES["B"].set()

    async def b_committed() -> bool:
        return b.stats["committed"] == 1 and (await work_state(nc))[0] == 0

    # Not lost: its lease lapses by its TTL (it was not released), then B is granted it.
    await wait_for(b_committed, 3 * TTL_S + 2, "B to commit J")
    assert [d for d, _ in b.deliveries][-1] >= 2
    results = [r async for r in iter_results(nc.jetstream(), "demo")]
    assert [(r.job_id, r.worker) for r in results] == [(order.job.id, "B")]


@pytest.mark.parametrize("failing", [1, 2], ids=["drains-release-fails", "first-resend-fails"])
async def test_a_drain_whose_release_raises_after_the_attempt_ran_keeps_its_record(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    workers: Workers,
    failing: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The attempt ran (its outcome published) and its report waits for a sink; a drain
    cancels it and the release carrying its record raises. The record is asked again in
    the background, so the attempt is in the job's history (and so in a dead letter);
    a background ask that raises too is asked again (``failing`` = 2). The drain's wait
    for those asks is lengthened: its 1 s holds the backoff of three asks with little to
    spare on a loaded machine, and what is tested is the asking again, not that budget
    (the drain returns as soon as the asks are done)."""
    monkeypatch.setattr(runtime, "RECORD_DRAIN_S", 10.0)
    store = await LeaseStore.open(nc.jetstream())
    a, order, _, _ = await a_runs_j(settings, nc, workers, RecordingWorker)
    live = await store.live(order.job.id)
    assert live is not None
    assert services.sink is not None
    await services.sink.drain(5.0)  # no sink: the report waits, asked again
    try:
        release = a.leases.release
        calls: list[bool] = []

        async def first_release_fails(*args: Any, **kwargs: Any) -> bool | None:
            calls.append(True)
            if len(calls) <= failing:
                raise ConnectionError("connection lost as the release was asked")
            return await release(*args, **kwargs)

        a.leases.release = first_release_fails  # type: ignore[method-assign]
        outcomes: list[bytes] = []

        async def on_outcome(msg: Msg) -> None:
            outcomes.append(msg.data)

        sub = await nc.subscribe("jf.outcome.>", cb=on_outcome)
        GATES["A"].set()

        async def outcome_published() -> bool:
            return any(order.job.id.encode() in data for data in outcomes)

        await wait_for(outcome_published, 5.0, "A's outcome event (its record is made then)")
        await sub.unsubscribe()
        await a.drain(0.2)  # its report waits for a sink: cancelled
        assert len(calls) >= failing + 1, "the record was not asked again"
        kept = await store.highest_fence(order.job.id)
        assert [(r.worker, r.fence) for r in kept.attempts] == [("A", live.fence)]
    finally:
        await services.start_sink()  # the stack drains its sink at the end
