"""Serve ``jf.sink.report.<target>`` in the ``sink`` queue group: commit successes,
dead-letter failures (with reason and history) and answer the worker."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from jetfleet.schemas import DeadLetter, Failure, Report, SinkReply, Success
from jetfleet.services.sink.commit import CommitPolicy, check_fence, commit
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.attempt_history import attempt_history
from jetfleet.lease_store import LeaseStore
from jetfleet.metrics import CounterFamily
from jetfleet.partition_places import PartitionPlaces
from jetfleet.publish import publish_durably
from jetfleet.responder import Refusals, Responder, Route
from jetfleet.results import committed_job
from jetfleet.settings import Settings

log = logging.getLogger(__name__)
# Answers after which the job is done for good (the worker acks or terminates it).
SETTLED = frozenset({"committed", "suppressed:duplicate-key", "dead-lettered"})

_decoder = msgspec.json.Decoder(Report)
_encoder = msgspec.json.Encoder()


REPORT_REFUSALS = Refusals[SinkReply](
    malformed=lambda error: SinkReply(status="error", detail=f"malformed report: {error}"),
    busy=lambda wait, why: SinkReply(
        status="busy", retry_after_s=wait, detail=f"not settled, {why}: send the report again"
    ),
    # Spends the attempt: the error may be the report's own (an output the stream refuses).
    failed=lambda exc: SinkReply(status="error", detail=f"{type(exc).__name__}: {exc}"),
)


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
        self.responder = Responder(
            nc, self.name, subjects.QUEUE_SINK, settings.fleet.service_concurrency
        )
        self.answers = CounterFamily(
            "jetfleet_sink_answers_total", "Sink answers to reports, by status and target"
        )
        self.metrics = [self.answers, self.responder.refused]

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
        await self.responder.serve(
            Route(f"{subjects.SINK_REPORT}.*", _decoder, self._handle, REPORT_REFUSALS, self._after)
        )
        # Started means answering: make sure the server has the subscription.
        await self.nc.flush()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking reports and finish the ones in hand."""
        await self.responder.drain(timeout_s)
        await self.places.close()

    async def _after(self, msg: Msg, report: Success | Failure | None, reply: SinkReply) -> None:
        self.answers.inc(status=reply.status, target=msg.subject.rsplit(".", 1)[-1])
        if report is not None and reply.status in SETTLED:
            # A partitioned target's place frees now, not when the lease runs out. The
            # fence check confirmed the live lease, and a settled job is never granted
            # again, so the place is this job's to free. After the answer: the worker
            # need not wait for it.
            await self.places.free(report.order.target, report.order.job.id)

    async def _handle(self, report: Success | Failure) -> SinkReply:
        if isinstance(report, Success):
            return await commit(self.js, self.store, report, self.policy)
        return await self._dead_letter(report)

    async def _dead_letter(self, failure: Failure) -> SinkReply:
        order = failure.order
        # Every read at once, so the letter is written one round trip after the fence
        # was confirmed: the shorter that gap, the less room for a revoke and a rerun
        # that commits to slip in before the letter lands.
        fence_check = (
            check_fence(self.store, order.job.id, failure.fence)
            if self.policy.leases
            else _no_refusal()
        )
        refusal, holder, history = await asyncio.gather(
            fence_check,
            committed_job(self.js, order.target, order.key),
            attempt_history(self.nc, order.target, order.job.id, failure.history),
        )
        if refusal is not None:
            # Only the live lease's holder may dead-letter (and so terminate) a job.
            return refusal
        if holder is not None:
            # The work is already done (a lost ack or term, then a failing rerun): the job
            # is settled as a duplicate, never both committed and dead.
            return SinkReply(
                status="suppressed:duplicate-key", detail=order.key, committed_by=holder
            )
        letter = DeadLetter(
            order=order, reason=failure.reason, history=history, detail=failure.detail
        )
        # Written (and acked by the stream) BEFORE the worker terminates the message.
        await publish_durably(
            self.js,
            subjects.dead_letter(order.target, order.job.id),
            _encoder.encode(letter),
            msg_id=f"dlq-{order.job.id}",
            headers={"Jf-Reason": failure.reason, "Jf-Job": order.job.id},
        )
        log.info("dead-lettered %s: %s", order.job.id, failure.reason)
        return SinkReply(status="dead-lettered", detail=failure.reason)


async def _no_refusal() -> SinkReply | None:
    """The fence check when leases are off: nothing to refuse."""
    return None
