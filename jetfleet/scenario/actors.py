"""Scripted workers: they speak the real protocol (lease, renew, report, ack) to the real
leaser, sink and JetStream, but the walkthrough decides what each does and when."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import FetchTimeoutError

import jetfleet
from jetfleet import subjects
from jetfleet.lease_client import LeaseClient
from jetfleet.scenario.ledger import Ledger
from jetfleet.schemas import (
    AttemptRecord,
    Failure,
    HandlerOutput,
    SinkReply,
    Success,
    Versions,
    WorkOrder,
)
from jetfleet.schemas.lease import LeaseGrant, LeaseRefusal, LeaseReply, LeaseRequest

_encoder = msgspec.json.Encoder()
_order_decoder = msgspec.json.Decoder(WorkOrder)
_reply_decoder = msgspec.json.Decoder(SinkReply)
VERSIONS = Versions(jetfleet=jetfleet.__version__, handler="scenario@1")


@dataclass
class Holding:
    """A delivery an actor works on, with the lease it holds for it."""

    msg: Msg
    order: WorkOrder
    fence: int
    ttl_s: float
    attempt: int
    renewer: asyncio.Task[None] | None = None
    lost: asyncio.Event = field(default_factory=asyncio.Event)


class Dispatcher:
    """Fetches the target's deliveries and hands out the one the script asks for."""

    def __init__(self, nc: NatsClient, target: str) -> None:
        self.js = nc.jetstream()
        self.target = target
        self.in_hand: dict[str, tuple[Msg, WorkOrder]] = {}
        self._sub: object | None = None

    async def take(self, job_id: str, timeout_s: float = 20.0) -> tuple[Msg, WorkOrder]:
        """The next delivery of ``job_id`` (others fetched meanwhile are kept in hand)."""
        if self._sub is None:
            self._sub = await self.js.pull_subscribe_bind(
                subjects.work_consumer(self.target, "normal"), stream=subjects.STREAM_WORK
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while job_id not in self.in_hand:
            if loop.time() > deadline:
                raise TimeoutError(f"no delivery of {job_id} within {timeout_s:g} s")
            try:
                msgs = await self._sub.fetch(10, timeout=0.5)  # type: ignore[attr-defined]
            except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
                continue
            for msg in msgs:
                order = _order_decoder.decode(msg.data)
                self.in_hand[order.job.id] = (msg, order)  # a newer delivery replaces
        return self.in_hand.pop(job_id)


class Actor:
    """One scripted worker with its identity and (deliberately wrong) clock."""

    def __init__(
        self, name: str, identity: str, clock_offset_s: float, nc: NatsClient, ledger: Ledger
    ) -> None:
        self.name = name
        self.identity = identity
        self.clock_offset_s = clock_offset_s
        self.nc = nc
        self.leases = LeaseClient(nc)
        self.ledger = ledger

    async def ask(self, msg: Msg, order: WorkOrder) -> LeaseReply | None:
        """Ask the leaser for the job's lease for this delivery; count the answer."""
        reply = await self.leases.grant(
            LeaseRequest(
                job_id=order.job.id,
                target=order.target,
                key=order.key,
                worker=self.name,
                versions=VERSIONS,
                identity=self.identity,
                reply_subject=msg.reply or "",
                pin_identity=order.job.pin_identity,
                sends_request=False,  # as a real worker: permits are its own step
            )
        )
        if isinstance(reply, LeaseGrant):
            self.ledger.count("grants")
            self.ledger.log(
                "grant",
                f"{order.job.id} -> {self.name} (fence {reply.fence}, attempt {reply.attempt})",
            )
        elif isinstance(reply, LeaseRefusal):
            metric = {
                "wrong-identity": "grants_refused_profile",
                "quarantined": "grants_refused_quarantine",
            }.get(reply.reason)
            if metric:
                self.ledger.count(metric)
            self.ledger.log(
                "refused", f"{order.job.id} on {self.name}: {reply.reason} ({reply.detail})"
            )
        return reply

    async def take(self, msg: Msg, order: WorkOrder, renew: bool = True) -> Holding:
        """Take the lease (the script expects a grant) and, like a real worker, renew it."""
        reply = await self.ask(msg, order)
        if not isinstance(reply, LeaseGrant):
            raise RuntimeError(
                f"scenario expected a grant of {order.job.id} to {self.name}, got {reply!r}"
            )
        held = Holding(msg, order, reply.fence, reply.ttl_s, reply.attempt)
        if renew:
            held.renewer = asyncio.create_task(self._renew(held))
        return held

    async def _renew(self, held: Holding) -> None:
        while True:
            await asyncio.sleep(held.ttl_s / 3)
            if not await self.leases.renew(held.order.job.id, held.fence):
                held.lost.set()
                self.ledger.log(
                    "lease-lost",
                    f"{self.name} lost {held.order.job.id}'s lease: "
                    "stops, discards identity state, does not ack",
                )
                return
            await held.msg.in_progress()

    async def stop_renewing(self, held: Holding) -> None:
        """Stop the renewal beat (a stalled worker)."""
        if held.renewer is not None:
            held.renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held.renewer

    async def commit(
        self, held: Holding, output: HandlerOutput, duration_s: float = 0.1
    ) -> SinkReply:
        """Send a success report to the sink; count the answer."""
        report = Success(
            order=held.order,
            worker=self.name,
            attempt=held.attempt,
            duration_s=duration_s,
            output=output,
            versions=VERSIONS,
            identity=self.identity,
            fence=held.fence,
        )
        return await self.send_report(held.order.job.id, _encoder.encode(report))

    async def send_report(self, job_id: str, payload: bytes) -> SinkReply:
        """Deliver a report to the sink (the script may deliver the same one twice)."""
        self.ledger.count("commits")
        answer = await self.nc.request(
            subjects.sink_report(self._target(payload)), payload, timeout=5.0
        )
        reply = _reply_decoder.decode(answer.data)
        metric = {
            "committed": "accepted",
            "suppressed:duplicate-key": "suppressed_dedupe",
            "rejected:fenced-out": "rejected_fenced",
            "rejected:lease-expired": "rejected_expired",
        }.get(reply.status)
        if metric:
            self.ledger.count(metric)
        self.ledger.log("commit", f"{job_id} by {self.name}: {reply.status}")
        return reply

    @staticmethod
    def _target(payload: bytes) -> str:
        report = msgspec.json.decode(payload, type=Success)
        return report.order.target

    async def fail(self, held: Holding, reason: str) -> SinkReply:
        """Report a permanent failure: the sink dead-letters it, then we terminate."""
        record = AttemptRecord(
            attempt=held.attempt,
            worker=self.name,
            identity=self.identity,
            fence=held.fence,
            outcome="permanent",
            reason=reason,
        )
        report = Failure(
            order=held.order,
            worker=self.name,
            reason=reason,
            history=[record],
            versions=VERSIONS,
            identity=self.identity,
            fence=held.fence,
        )
        answer = await self.nc.request(
            subjects.sink_report(held.order.target), _encoder.encode(report), timeout=5.0
        )
        reply = _reply_decoder.decode(answer.data)
        if reply.status == "dead-lettered":
            await self.nc.publish(held.msg.reply, b"+TERM " + reason.encode())
            await self.release(held)
        self.ledger.log("fail", f"{held.order.job.id} on {self.name}: {reason} -> {reply.status}")
        return reply

    async def ack(self, held: Holding) -> None:
        """Ack the delivery (after the sink confirmed our fence) and release the lease."""
        await self.stop_renewing(held)
        await held.msg.ack()
        await self.leases.release(held.order.job.id, held.fence)

    async def release(self, held: Holding) -> None:
        """Stop renewing and give the lease back."""
        await self.stop_renewing(held)
        await self.leases.release(held.order.job.id, held.fence)

    async def hand_back(self, msg: Msg, delay_s: float = 0.05) -> None:
        """Nak a delivery we were refused a lease for (we never held it)."""
        await msg.nak(delay=delay_s)
