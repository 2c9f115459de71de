"""Admit each submission from ``JF_SUBMIT``: route it to its target's work subject, or
keep it on ``jf.rejected.<target>`` with the reason. Nothing is dropped silently."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from jetfleet.schemas import Rejection
from jetfleet.services.scheduler.job_ids import ClaimedOrder, claim_job_id
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from jetfleet import subjects, tracing
from jetfleet.admission import admit
from jetfleet.bounded_fetch import fetch_at_most
from jetfleet.lease_store import LeaseStore
from jetfleet.metrics import CounterFamily
from jetfleet.publish import publish_durably
from jetfleet.settings import Settings
from jetfleet.topology import SCHEDULER_ACK_WAIT_S

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
BATCH = 200
RETRY_FIRST_S = 0.5
"""A submission whose admission failed comes back after this, doubled with each
delivery up to the consumer's ack wait."""
HAND_BACK_MARGIN_S = 5.0
"""A failed admission is handed back only if it failed this long before the ack wait
ran out: past that, the server may have delivered it again already, and a late nak
would cut short the wait of the delivery another admission is working on."""


class Scheduler:
    """Pulls the shared ``scheduler`` consumer; any number of replicas may run."""

    name = "scheduler"

    def __init__(self, settings: Settings, nc: NatsClient) -> None:
        self.settings = settings
        self.nc = nc
        self.js = nc.jetstream()
        self._stopping = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._store: LeaseStore | None = None
        self.admissions = CounterFamily(
            "jetfleet_admissions_total", "Submissions admitted or rejected, by target and reason"
        )
        self.metrics = [self.admissions]

    async def start(self) -> None:
        """Start the admission loop."""
        self._loop = asyncio.create_task(self._run())

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Finish the batch in hand, then stop."""
        self._stopping.set()
        if self._loop is not None:
            # Its pull in hand ends within the long poll; a batch not done by then is
            # cancelled (what it did not ack comes back after the ack wait).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._loop, self.settings.fleet.long_poll_s + timeout_s)

    async def _run(self) -> None:
        sub = None
        while not self._stopping.is_set():
            try:
                if self._store is None:
                    self._store = await LeaseStore.open(self.js)
                if sub is None:
                    sub = await self.js.pull_subscribe_bind(
                        subjects.CONSUMER_SCHEDULER, stream=subjects.STREAM_SUBMIT
                    )
                # Queued late answers first: a refused pull then loses none of them
                # to the ack wait (jetfleet/bounded_fetch.py).
                msgs = await fetch_at_most(sub, BATCH, self.settings.fleet.long_poll_s)
                fetched_at = time.monotonic()
                await asyncio.gather(
                    *(self._admit_or_hand_back(self._store, m, fetched_at) for m in msgs)
                )
            except Exception:  # keep admitting through reconnects and leader changes
                log.exception("admission loop failed; rebinding")
                if sub is not None:
                    # Its inbox only (the durable consumer stays): one per failure
                    # would otherwise pile up on the connection for its whole life.
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                sub = None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 1.0)

    async def _admit_or_hand_back(self, store: LeaseStore, msg: Msg, fetched_at: float) -> None:
        try:
            await self._admit_one(store, msg)
        except Exception:
            # A stream leader's election, a lost connection: asked again soon rather
            # than after the consumer's ack wait. Safe to repeat: each step of the
            # admission is put-if-absent or deduplicated (services/scheduler/job_ids.py).
            # Backing off, so a submission that fails every time is not a hot loop.
            if time.monotonic() - fetched_at < SCHEDULER_ACK_WAIT_S - HAND_BACK_MARGIN_S:
                delivered = msg.metadata.num_delivered or 1
                delay = RETRY_FIRST_S * 2.0 ** min(delivered - 1, 6)
                with contextlib.suppress(Exception):  # unreachable: the ack wait brings it
                    await msg.nak(delay=min(delay, SCHEDULER_ACK_WAIT_S))
            raise

    async def _admit_one(self, store: LeaseStore, msg: Msg) -> None:
        # A sibling of the job's attempts: the work order carries the submit span's
        # context on (``_passthrough``), not this one's (unless there is none: then this
        # is the job's root).
        with tracing.span(
            f"process {msg.subject}",
            SpanKind.CONSUMER,
            tracing.extract(msg.headers),
            tracing.messaging(msg.subject, "process") if tracing.tracing_on() else None,
        ):
            await self._admit_traced(store, msg)

    async def _admit_traced(self, store: LeaseStore, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        admitted = admit(
            msg.subject, msg.data, self.settings, submit_seq=seq, stored_at=msg.metadata.timestamp
        )
        verdict = (
            admitted
            if isinstance(admitted, Rejection)
            else await claim_job_id(store, admitted, msg.subject, msg.data, self.settings, seq)
        )
        if isinstance(verdict, Rejection):
            target = subjects.target_of(msg.subject)
            log.info("rejected submission %s on %s: %s", seq, msg.subject, verdict.message)
            await publish_durably(
                self.js,
                subjects.rejected(target),
                _encoder.encode(verdict),
                msg_id=f"rej-{seq}",
                headers=_passthrough(msg),
            )
            self.admissions.inc(target=target, verdict="rejected", reason=verdict.reason)
            tracing.note("rejected", verdict.reason)
        elif verdict.claim.routed:
            # A redelivery of a submission routed before (its ack was lost): the work
            # order exists, or existed and was settled.
            log.info("submission %s was routed already; acking it", seq)
            tracing.note("routed-already")
        else:
            await self._route(store, verdict, msg)
        await msg.ack()

    async def _route(self, store: LeaseStore, claimed: ClaimedOrder, msg: Msg) -> None:
        """Store the work order, then mark its claim routed."""
        order = claimed.order
        tracing.annotate({tracing.JOB_ID: order.job.id, tracing.TARGET: order.target})
        # The job id as message id dedupes a re-admission inside the duplicate window;
        # the routed mark, one KV write, covers the time after it.
        ack = await publish_durably(
            self.js,
            subjects.work(order.target, order.job.tier),
            _encoder.encode(order),
            msg_id=f"job-{order.job.id}",
            headers=_passthrough(msg),
        )
        await store.mark_routed(order.job.id, claimed.claim, ack.seq)
        self.admissions.inc(target=order.target, verdict="admitted", reason="")
        tracing.note("admitted")


def _passthrough(msg: Msg) -> dict[str, str]:
    # Trace context rides from submit to ack (one job, one trace). A submission without
    # one (a replayed dead letter, an untraced client) gets the admission span's: else
    # each delivery would be a trace of its own. Called inside that span.
    carried = tracing.trace_headers(msg.headers)
    if "traceparent" in carried:
        return carried
    return tracing.inject({}) or {}
