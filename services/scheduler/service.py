"""Admit each submission from ``JF_SUBMIT``: route it to its target's work subject, or
keep it on ``jf.rejected.<target>`` with the reason. Nothing is dropped silently."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from jetfleet.schemas import Rejection
from jetfleet.services.scheduler.job_ids import claim_job_id
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import FetchTimeoutError

from jetfleet import subjects
from jetfleet.admission import admit
from jetfleet.lease_store import LeaseStore
from jetfleet.metrics import CounterFamily
from jetfleet.publish import publish_durably
from jetfleet.settings import Settings

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
BATCH = 200


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
            await asyncio.wait_for(asyncio.shield(self._loop), timeout_s)

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
                try:
                    msgs = await sub.fetch(BATCH, timeout=1.0)
                except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
                    continue
                await asyncio.gather(*(self._admit_one(self._store, m) for m in msgs))
            except Exception:  # keep admitting through reconnects and leader changes
                log.exception("admission loop failed; rebinding")
                sub = None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 1.0)

    async def _admit_one(self, store: LeaseStore, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        verdict = admit(
            msg.subject, msg.data, self.settings, submit_seq=seq, stored_at=msg.metadata.timestamp
        )
        if not isinstance(verdict, Rejection):
            verdict = await claim_job_id(store, verdict, msg.subject, msg.data, self.settings, seq)
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
        else:
            subject = subjects.work(verdict.target, verdict.job.tier)
            # The job id as message id: a redelivered submission (re-admitted, its claim
            # already its own) cannot be routed twice.
            await publish_durably(
                self.js,
                subject,
                _encoder.encode(verdict),
                msg_id=f"job-{verdict.job.id}",
                headers=_passthrough(msg),
            )
            self.admissions.inc(target=verdict.target, verdict="admitted", reason="")
        await msg.ack()


def _passthrough(msg: Msg) -> dict[str, str]:
    # Trace context rides from submit to ack (one job, one trace).
    return {k: v for k, v in (msg.headers or {}).items() if k in ("traceparent", "tracestate")}
