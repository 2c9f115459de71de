"""A ``jetfleet.worker.Worker`` that injects faults by overriding small methods.

- lost ack: after the sink answers ``committed`` for a job the plan picks, the worker
  gives its lease back as usual but never acks, so JetStream redelivers the job after
  ack_wait; the next holder must hear ``already-done`` from the leaser.
- stall: a stalled job's first attempt, after its request to the target, freezes its
  whole worker process (a blocking sleep: the event loop stops, as in a long GC pause or a
  SIGSTOP) past the TTL and ack_wait. The worker's own lease keeper is left as it is: it
  cannot renew while frozen, finds the lease lost when the process runs again, and the
  attempts that still report do so late with their old fences. An attempt whose lease was
  asked for before the process last froze was caught by that freeze: it has stalled
  already. A process freezes at most once per ``FREEZE_GAP_S``; a stall that would
  freeze it sooner is skipped (the attempt runs like ``test.effect``), so a run's stalls
  cost a bounded time.

Everything it sees is written to its ``EventLog``. Importing this module registers the
test handlers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from jetfleet.schemas import (
    AttemptRecord,
    DataOutput,
    HandlerOutput,
    HttpFetch,
    SinkReply,
    Versions,
    WorkOrder,
)
from jetfleet.schemas.lease import LeaseAlreadyDone, LeaseGrant, LeaseReply, LeaseRequest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet.lease_client import LeaseClient
from jetfleet.settings import Settings
from jetfleet.worker import HandlerContext, Worker, handler
from jetfleet.worker.builtin import http_get
from jetfleet.worker.verdict import Held, Verdict
from tests.faults.plan import EFFECT_HANDLER, STALL_HANDLER, EventLog, FaultPlan

# Handlers are process-global functions; they find their worker by ctx.worker_id.
FREEZE_GAP_S = 15.0
_WORKERS: dict[str, FaultyWorker] = {}


class _RecordingLeases(LeaseClient):
    """The worker's lease client, noting each grant and each already-done answer."""

    def __init__(self, nc: NatsClient, events: EventLog) -> None:
        super().__init__(nc)
        self.events = events
        self.asked_at: dict[tuple[str, int], float] = {}
        """When the lease of each granted (job, attempt) was asked for (monotonic)."""

    async def grant(self, request: LeaseRequest) -> LeaseReply | None:
        asked_at = time.monotonic()
        reply = await super().grant(request)
        if isinstance(reply, LeaseAlreadyDone):
            self.events.write("already-done", job=request.job_id)
        elif isinstance(reply, LeaseGrant):
            self.asked_at[(request.job_id, reply.attempt)] = asked_at
            self.events.write(
                "granted", job=request.job_id, fence=reply.fence, attempt=reply.attempt
            )
        return reply


class FaultyWorker(Worker):
    """The product worker with the plan's faults and an event log."""

    def __init__(
        self,
        settings: Settings,
        nc: NatsClient,
        worker_id: str,
        plan: FaultPlan,
        events: EventLog,
        targets: Iterable[str] = (),
        identity: str = "",
    ) -> None:
        super().__init__(settings, nc, worker_id, targets, identity=identity)
        self.plan = plan
        self.events = events
        self.recording = _RecordingLeases(nc, events)
        self.leases = self.recording
        self.froze_at = -FREEZE_GAP_S
        """When the process last froze (monotonic)."""
        self.stalled: set[tuple[str, int]] = set()
        """(job, attempt) that stalled past their lease."""
        _WORKERS[worker_id] = self

    def stalls(self, order: WorkOrder, attempt: int) -> bool:
        """Whether this attempt of ``order`` stalled past its lease (see ``stall``)."""
        return (order.job.id, attempt) in self.stalled

    def stall(self, job_id: str, attempt: int) -> str:
        """Stall a stalled job's attempt: ``froze`` (the whole process, now), ``caught``
        (its lease was asked for before the last freeze began) or ``skipped``."""
        now = time.monotonic()
        if self.recording.asked_at.get((job_id, attempt), now) < self.froze_at:
            # Its lease was asked for (and renewed at the latest) before the last freeze
            # began, which outlasted the TTL: it has expired.
            how = "caught"
        elif now - self.froze_at < FREEZE_GAP_S:
            return "skipped"
        else:
            self.froze_at = now
            time.sleep(self.plan.stall_s)  # blocking on purpose: nothing in the process runs
            how = "froze"
        self.stalled.add((job_id, attempt))
        return how

    async def _publish_outcome(
        self,
        order: WorkOrder,
        attempt: int,
        verdict: Verdict,
        duration: float,
        versions: Versions,
        fence: int,
    ) -> AttemptRecord:
        self.events.write(
            "outcome", job=order.job.id, attempt=attempt, kind=verdict.kind, reason=verdict.reason
        )
        return await super()._publish_outcome(order, attempt, verdict, duration, versions, fence)

    async def _process_order(self, msg: Msg, order: WorkOrder, target: str) -> Verdict | None:
        verdict = await super()._process_order(msg, order, target)
        if verdict is not None and verdict.kind == "lost":
            # The lease keeper found the lease lost and cancelled the handler.
            self.events.write("lost", job=order.job.id, **_delivery(msg))
        return verdict

    async def _settle(
        self, msg: Msg, order: WorkOrder, held: Held, verdict: Verdict, reply: SinkReply | None
    ) -> None:
        status = reply.status if reply is not None else "no-reply"
        self.events.write(
            "settle",
            job=order.job.id,
            attempt=held.attempt,
            fence=held.fence,
            status=status,
            stalled=self.stalls(order, held.attempt),
            # No reply because the worker's own keeper found the lease lost (it then
            # reports no more), not because the sink was silent.
            lost=held.lost.is_set(),
            detail=reply.detail if reply is not None else "",
            **_delivery(msg),
        )
        if status == "committed" and self.plan.drops_ack(order.job.id):
            # As if the +ACK were lost on the wire: everything else goes on as usual.
            self.stats["committed"] += 1
            self.stats["ack-dropped"] += 1
            self.events.write(
                "ack-dropped", job=order.job.id, fence=held.fence, attempt=held.attempt
            )
            await self._give_back(order, held)
            return
        await super()._settle(msg, order, held, verdict, reply)


def _delivery(msg: Msg) -> dict[str, int]:
    """Which delivery of which work message ``msg`` is, as ``$JS.ACK`` names it."""
    meta = msg.metadata
    return {"sseq": meta.sequence.stream, "delivered": meta.num_delivered}


async def _work(ctx: HandlerContext) -> HandlerOutput:
    worker = _WORKERS[ctx.worker_id]
    job_id = ctx.order.job.id
    worker.events.write("start", job=job_id, attempt=ctx.attempt)
    # The side effect: one request to the target, which counts it.
    fetched = await http_get(ctx)
    status = fetched.status if isinstance(fetched, HttpFetch) else 0
    how = "no"
    if ctx.order.job.handler == STALL_HANDLER and ctx.attempt == 1:
        how = worker.stall(job_id, ctx.attempt)
        kind = "stall-skipped" if how == "skipped" else "stall"
        worker.events.write(kind, job=job_id, attempt=ctx.attempt, how=how)
    if how in ("no", "skipped"):
        await asyncio.sleep(worker.plan.effect_s(job_id))
    return DataOutput(data={"job": job_id, "attempt": ctx.attempt, "status": status})


@handler(EFFECT_HANDLER)
async def effect(ctx: HandlerContext) -> HandlerOutput:
    """One request to the target (its side effect), then short work."""
    return await _work(ctx)


@handler(STALL_HANDLER)
async def stall(ctx: HandlerContext) -> HandlerOutput:
    """Like ``test.effect``, but the first attempt overruns its lease (see the plan)."""
    return await _work(ctx)
