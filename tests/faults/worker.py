"""A ``jetfleet.worker.Worker`` that injects faults by overriding small methods.

- lost ack: after the sink answers ``committed`` for a job the plan picks, the worker
  gives its lease back as usual but never acks, so JetStream redelivers the job after
  ack_wait; the next holder must hear ``already-done`` from the leaser.
- stall: on a stalled job's first grant the lease is not renewed (nor +WPI sent) and the
  handler sleeps past the TTL and ack_wait, then reports late with its old fence.

Everything it sees is written to its ``EventLog``. Importing this module registers the
test handlers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from jetfleet.schemas import DataOutput, HandlerOutput, SinkReply, Versions, WorkOrder
from jetfleet.schemas.lease import LeaseAlreadyDone, LeaseGrant, LeaseReply, LeaseRequest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet.lease_client import LeaseClient
from jetfleet.settings import Settings
from jetfleet.worker import HandlerContext, Worker, handler
from jetfleet.worker.verdict import Held, Verdict
from tests.faults.plan import EFFECT_HANDLER, STALL_HANDLER, EventLog, FaultPlan

# Handlers are process-global functions; they find their worker by ctx.worker_id.
_WORKERS: dict[str, FaultyWorker] = {}


class _RecordingLeases(LeaseClient):
    """The worker's lease client, noting each grant and each already-done answer."""

    def __init__(self, nc: NatsClient, events: EventLog) -> None:
        super().__init__(nc)
        self.events = events

    async def grant(self, request: LeaseRequest) -> LeaseReply | None:
        reply = await super().grant(request)
        if isinstance(reply, LeaseAlreadyDone):
            self.events.write("already-done", job=request.job_id)
        elif isinstance(reply, LeaseGrant):
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
        self.leases = _RecordingLeases(nc, events)
        _WORKERS[worker_id] = self

    def stalls(self, order: WorkOrder, attempt: int) -> bool:
        """Whether this attempt of ``order`` is one the plan stalls (first grants only)."""
        return order.job.handler == STALL_HANDLER and attempt == 1

    async def _keep_lease(self, msg: Msg, order: WorkOrder, held: Held) -> None:
        if self.stalls(order, held.attempt or msg.metadata.num_delivered):
            # No renewal and no +WPI: the lease expires by the server's clock and
            # JetStream redelivers after ack_wait. The worker cancels us before it settles.
            self.events.write("renewal-suppressed", job=order.job.id, fence=held.fence)
            await asyncio.Event().wait()
        await super()._keep_lease(msg, order, held)

    async def _publish_outcome(
        self,
        order: WorkOrder,
        attempt: int,
        verdict: Verdict,
        duration: float,
        versions: Versions,
        fence: int,
    ) -> None:
        self.events.write(
            "outcome", job=order.job.id, attempt=attempt, kind=verdict.kind, reason=verdict.reason
        )
        await super()._publish_outcome(order, attempt, verdict, duration, versions, fence)

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
            detail=reply.detail if reply is not None else "",
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


async def _work(ctx: HandlerContext) -> HandlerOutput:
    worker = _WORKERS[ctx.worker_id]
    job_id = ctx.order.job.id
    worker.events.write("start", job=job_id, attempt=ctx.attempt)
    if worker.stalls(ctx.order, ctx.attempt):
        worker.events.write("stall", job=job_id, attempt=ctx.attempt, for_s=worker.plan.stall_s)
        await asyncio.sleep(worker.plan.stall_s)
    else:
        await asyncio.sleep(worker.plan.effect_s(job_id))
    return DataOutput(data={"job": job_id, "attempt": ctx.attempt})


@handler(EFFECT_HANDLER)
async def effect(ctx: HandlerContext) -> HandlerOutput:
    """Short work; its one side effect is the commit the worker then asks for."""
    return await _work(ctx)


@handler(STALL_HANDLER)
async def stall(ctx: HandlerContext) -> HandlerOutput:
    """Like ``test.effect``, but the first attempt overruns its lease (see the plan)."""
    return await _work(ctx)
