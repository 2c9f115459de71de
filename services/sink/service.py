"""Serve ``jf.sink.report.<target>`` in the ``sink`` queue group: commit successes,
dead-letter failures (with reason and history) and answer the worker."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from jetfleet.schemas import Failure, Report, SinkReply, Success
from jetfleet.services.sink.commit import CommitPolicy, commit
from jetfleet.services.sink.dead_letter import dead_letter
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from jetfleet import subjects
from jetfleet.lease_store import LeaseStore
from jetfleet.metrics import CounterFamily
from jetfleet.partition_places import PartitionPlaces
from jetfleet.settings import Settings

log = logging.getLogger(__name__)
# Answers after which the job is done for good (the worker acks or terminates it).
SETTLED = frozenset({"committed", "suppressed:duplicate-key", "dead-lettered"})

_decoder = msgspec.json.Decoder(Report)
_encoder = msgspec.json.Encoder()


class Sink:
    """The commit point; any number of replicas share the queue group."""

    name = "sink"

    def __init__(
        self, settings: Settings, nc: NatsClient, policy: CommitPolicy | None = None
    ) -> None:
        self.settings = settings
        self.policy = policy or CommitPolicy(leases=settings.fleet.leases)
        self.nc = nc
        self.js = nc.jetstream()
        self._sub: Subscription | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self.answers = CounterFamily(
            "jetfleet_sink_answers_total", "Sink answers to reports, by status and target"
        )
        self.metrics = [self.answers]

    @property
    def counts(self) -> dict[str, int]:
        """Answers by status, over every target."""
        totals: dict[str, int] = {}
        for labels, value in self.answers.values.items():
            status = dict(labels)["status"]
            totals[status] = totals.get(status, 0) + value
        return totals

    async def start(self) -> None:
        """Bind to the lease buckets and start answering reports."""
        self.store = await LeaseStore.open(self.js)
        self.places = PartitionPlaces(self.settings)
        self._sub = await self.nc.subscribe(
            f"{subjects.SINK_REPORT}.*", queue=subjects.QUEUE_SINK, cb=self._on_report
        )
        # Started means answering: make sure the server has the subscription.
        await self.nc.flush()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking reports and finish the ones in hand."""
        if self._sub is not None:
            # drain, not unsubscribe: reports already received are still answered.
            await self._sub.drain()  # type: ignore[no-untyped-call]
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=timeout_s)
        await self.places.close()

    async def _on_report(self, msg: Msg) -> None:
        # Handle each report in its own task so one slow commit does not hold the rest.
        task = asyncio.create_task(self._answer(msg))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _answer(self, msg: Msg) -> None:
        report: Success | Failure | None = None
        try:
            report = _decoder.decode(msg.data)
            reply = await self._handle(report)
        except msgspec.MsgspecError as exc:
            reply = SinkReply(status="error", detail=f"malformed report: {exc}")
        except Exception as exc:  # the worker retries; the commit is idempotent
            log.exception("report on %s failed", msg.subject)
            reply = SinkReply(status="error", detail=f"{type(exc).__name__}: {exc}")
        self.answers.inc(status=reply.status, target=msg.subject.rsplit(".", 1)[-1])
        if msg.reply:
            await self.nc.publish(msg.reply, _encoder.encode(reply))
        if report is not None and reply.status in SETTLED:
            # A partitioned target's place frees now, not when the lease runs out. The
            # check above confirmed the live lease, and a settled job is never granted
            # again, so the place is this job's to free. After the answer: the worker
            # need not wait for it.
            await self.places.free(report.order.target, report.order.job.id)

    async def _handle(self, report: Success | Failure) -> SinkReply:
        if isinstance(report, Success):
            return await commit(self.js, self.store, report, self.policy)
        return await dead_letter(self.nc, self.store, report, self.policy)
