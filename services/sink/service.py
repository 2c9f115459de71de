"""Serve ``jf.sink.report.<target>`` in the ``sink`` queue group: commit successes,
dead-letter failures (with reason and history) and answer the worker."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from jetfleet.schemas import DeadLetter, Failure, Report, SinkReply, Success
from jetfleet.services.sink.commit import CommitPolicy, check_fence, commit
from jetfleet.services.sink.exhausted import ExhaustedJobs
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from jetfleet import subjects
from jetfleet.attempt_history import attempt_history
from jetfleet.lease_store import LeaseStore
from jetfleet.metrics import CounterFamily
from jetfleet.partition_places import PartitionPlaces
from jetfleet.publish import publish_durably
from jetfleet.results import committed_job
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
        self.exhausted: ExhaustedJobs | None = None

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
        # The backstop's dead letters: jobs whose max_deliver ran out.
        self.exhausted = ExhaustedJobs(self.settings, self.nc, self.store)
        self.metrics.append(self.exhausted.ended)
        await self.exhausted.start()
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
        if self.exhausted is not None:
            await self.exhausted.drain(timeout_s)
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
