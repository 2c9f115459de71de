"""Serve ``jf.sink.report.<target>`` in the ``sink`` queue group: commit successes,
dead-letter failures (with reason and history), record the jobs another job's commit
settled, keep undecodable work orders, and answer the worker."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from jetfleet.schemas import Failure, Report, SinkReply, Success
from jetfleet.schemas.report import Malformed
from jetfleet.services.sink.commit import CommitPolicy, commit
from jetfleet.services.sink.dead_letter import dead_letter
from jetfleet.services.sink.exhausted import ExhaustedJobs
from jetfleet.services.sink.malformed_orders import keep_reported
from jetfleet.services.sink.report_checks import refuse_report
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.duplicates import record_duplicate
from jetfleet.lease_store import LeaseStore
from jetfleet.metrics import CounterFamily
from jetfleet.responder import Refusals, Responder, Route
from jetfleet.settings import Settings
from jetfleet.target_places import TargetPlaces

log = logging.getLogger(__name__)
# Answers after which the job is done for good (the worker acks or terminates it).
SETTLED = frozenset({"committed", "suppressed:duplicate-key", "dead-lettered"})
RECORD_RETRY_S = 1.0
"""How soon a worker sends a report again when its duplicate record was not stored."""

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
        self.dead_letters = CounterFamily(
            "jetfleet_sink_dead_letters_total",
            "Dead letters written for workers' failure reports, by target and reason (the "
            "backstop's are jetfleet_sink_backstop_total)",
        )
        self.metrics = [self.answers, self.dead_letters, self.responder.refused]
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
        self.places = TargetPlaces(self.settings)
        # The backstop's dead letters: jobs whose max_deliver ran out.
        self.exhausted = ExhaustedJobs(self.settings, self.nc, self.store)
        self.metrics.append(self.exhausted.ended)
        await self.exhausted.start()
        # No max_bytes: a report is bounded by the server's max_payload, which is what a
        # worker keeps its reports under (a user handler's output may come near it).
        await self.responder.serve(
            Route(
                f"{subjects.SINK_REPORT}.*",
                _decoder,
                self._handle,
                REPORT_REFUSALS,
                self._after,
                check=lambda msg, report: refuse_report(self.settings, msg.subject, report),
            )
        )
        # Started means answering: make sure the server has the subscription.
        await self.nc.flush()

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking reports and finish the ones in hand."""
        # Together: the backstop's reader waits out one long-poll fetch.
        await asyncio.gather(self.responder.drain(timeout_s), self.stop_backstop(timeout_s))
        await self.places.close()

    async def stop_backstop(self, timeout_s: float = 30.0) -> None:
        """Stop ending exhausted jobs (after the advisories in hand). Workers do not need
        it while they finish their jobs, so a stack may stop it first, beside them."""
        if self.exhausted is not None:
            await self.exhausted.drain(timeout_s)

    async def _after(self, msg: Msg, report: Report | None, reply: SinkReply) -> None:
        target = msg.subject.rsplit(".", 1)[-1]
        self.answers.inc(status=reply.status, target=target)
        if isinstance(report, Success | Failure) and reply.status in SETTLED:
            # The target's in-flight place frees now, not when the lease runs out. The
            # fence check confirmed the live lease, and a settled job is never granted
            # again, so the place is this job's to free. After the answer: the worker
            # need not wait for it.
            await self.places.free(report.order.target, report.order.job.id)

    async def _handle(self, report: Report) -> SinkReply:
        if isinstance(report, Malformed):
            return await keep_reported(self.js, self.settings, report)
        if isinstance(report, Success):
            reply = await commit(self.js, self.store, report, self.policy)
        else:
            # Letters are counted as written, not as answered: a report sent again
            # after a lost answer is answered ``dead-lettered`` from the seal again.
            order = report.order
            reply = await dead_letter(
                self.nc,
                self.store,
                report,
                self.policy,
                on_written=lambda: self.dead_letters.inc(target=order.target, reason=report.reason),
            )
        return await self._recorded(report, reply)

    async def _recorded(self, report: Success | Failure, reply: SinkReply) -> SinkReply:
        """``reply``, once the duplicate record it implies is stored: a job settled by
        another job's commit of its key counts as committed only through that record
        (I3), and the worker acks on ``suppressed:duplicate-key``. When the record is
        not stored the answer is ``busy``: the worker sends the same report again (the
        seal holds, so it is answered the same), and acks only after a stored record."""
        if reply.status != "suppressed:duplicate-key":
            return reply
        order = report.order
        try:
            await record_duplicate(
                self.js, order.job.id, order.target, order.key, reply.committed_by, "suppressed"
            )
        except Exception as exc:
            log.warning("could not record job %s as a duplicate: %s", order.job.id, exc)
            return SinkReply(
                status="busy",
                retry_after_s=RECORD_RETRY_S,
                detail=f"suppressed, but its duplicate record was not stored ({exc}): send "
                "the report again",
            )
        return reply
