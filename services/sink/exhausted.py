"""End the jobs JetStream stopped delivering: the backstop's dead letters.

A work consumer's ``max_deliver`` (``fleet.max_deliver``) ends the deliveries of a job
that never ends by itself: pinned to an identity no worker owns, or handed back for ever.
The message then stays in the WorkQueue stream with nothing to remove it, and the
server says so once, in a core NATS advisory that ``JF_ADVISORIES`` keeps. The sink reads
those through the durable ``max-deliveries`` consumer and, for each, writes the job's
dead letter (or, if its key was committed, settles it as that commit's duplicate) and
then deletes the message from ``JF_WORK``. See docs/dead-letters.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Annotated, Literal

import msgspec
from jetfleet.schemas import AttemptRecord, DeadLetter, WorkOrder
from jetfleet.schemas.lease import JobLeaseHistory, Sealed, SealedCommit, SealedDeath
from jetfleet.services.sink.malformed_orders import keep_malformed
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import FetchTimeoutError, NotFoundError
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from jetfleet import subjects, tracing
from jetfleet.attempt_history import attempt_history
from jetfleet.duplicates import record_duplicate
from jetfleet.last_hand_back import last_hand_back
from jetfleet.leader_reads import last_message
from jetfleet.lease_store import HistoryEntry, LeaseStore
from jetfleet.metrics import CounterFamily
from jetfleet.results import committed_job
from jetfleet.server_clock import parse_server_time
from jetfleet.settings import Settings
from jetfleet.settlement import land

log = logging.getLogger(__name__)

FETCH_BATCH = 50
# An advisory whose job still has a live lease (its last delivery is still running, or
# its holder stalled) is looked at again after this; its lease ends within its TTL.
LIVE_LEASE_RETRY_S = 5.0
ERROR_RETRY_S = 2.0
# Last hand-backs that mean no worker may run the job (None: no note, nobody said).
NOBODY_MAY_RUN = frozenset({None, "wrong-identity", "wrong-region", "no-eligible-worker"})

_order_decoder = msgspec.json.Decoder(WorkOrder)


StreamSeq = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
"""A stream sequence as the server has them: a uint64 from 1 (msgspec bounds only within
int64, which no stream reaches). Bounded here, not only by the server: an advisory naming
-1 or 10**30 made every read of it a 400 (err 10025), so it was nakked and read again for
ever."""


class MaxDeliveriesAdvisory(msgspec.Struct, frozen=True):
    """What nats-server publishes when a message used up a consumer's max_deliver."""

    stream: str
    consumer: str
    stream_seq: StreamSeq
    deliveries: int
    timestamp: str = ""


_advisory_decoder = msgspec.json.Decoder(MaxDeliveriesAdvisory)


class ExhaustedJobs:
    """The sink's reader of max-deliveries advisories; any number of sinks share it."""

    def __init__(self, settings: Settings, nc: NatsClient, store: LeaseStore) -> None:
        self.settings = settings
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.store = store
        self.ended = CounterFamily(
            "jetfleet_sink_backstop_total",
            "Jobs whose max_deliver ran out, ended by the sink: by target and how (the dead "
            "letter's reason, or duplicate)",
        )
        self._stopping = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind to the advisories' durable consumer and start reading."""
        self._loop = asyncio.create_task(self._read(await self._bind()))

    async def _bind(self) -> JetStreamContext.PullSubscription:
        return await self.js.pull_subscribe_bind(
            subjects.CONSUMER_MAX_DELIVERIES, stream=subjects.STREAM_ADVISORIES
        )

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Stop reading once the advisories in hand are done."""
        self._stopping.set()
        if self._loop is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._loop, self.settings.fleet.long_poll_s + timeout_s)

    async def _read(self, sub: JetStreamContext.PullSubscription | None) -> None:
        while not self._stopping.is_set():
            try:
                if sub is None:
                    sub = await self._bind()
                msgs = await sub.fetch(FETCH_BATCH, timeout=self.settings.fleet.long_poll_s)
                await asyncio.gather(*(self._answer(msg) for msg in msgs))
            except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
                continue
            except Exception:  # a reconnect or leader change: bind again shortly
                log.exception("reading %s failed; rebinding", subjects.STREAM_ADVISORIES)
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                sub = None
                await asyncio.sleep(ERROR_RETRY_S)

    async def _answer(self, msg: Msg) -> None:
        try:
            advisory = _advisory_decoder.decode(msg.data)
        except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: nested too deep
            log.warning("dropped an undecodable advisory on %s: %s", msg.subject, exc)
            await msg.ack()
            return
        if advisory.stream != subjects.STREAM_WORK:
            await msg.ack()  # not a work consumer's: nothing of ours to end
            return
        try:
            done = await self.end_job(advisory)
        except Exception:
            log.exception(
                "ending the job at %s seq %d failed", advisory.stream, advisory.stream_seq
            )
            await msg.nak(delay=ERROR_RETRY_S)
            return
        if done:
            await msg.ack()
        else:
            await msg.nak(delay=LIVE_LEASE_RETRY_S)

    async def end_job(self, advisory: MaxDeliveriesAdvisory) -> bool:
        """End the job the advisory names; False to look again later (a lease is live).

        The message is read from the stream leader (a replica may answer stale), and
        deleted only once the job's end is stored, so a crash in between leaves the
        advisory to be read again.
        """
        try:
            stored = await self.js.get_msg(advisory.stream, seq=advisory.stream_seq, direct=False)
        except NotFoundError:
            return True  # acked late by its last holder, or ended here already
        # A span in the job's trace: the work order carries its submit span's context.
        with tracing.span(
            BACKSTOP_SPAN, SpanKind.CONSUMER, tracing.extract(stored.headers), _traced(advisory)
        ):
            return await self._end_stored(advisory, stored)

    async def _end_stored(self, advisory: MaxDeliveriesAdvisory, stored: RawStreamMsg) -> bool:
        try:
            order = _order_decoder.decode(stored.data or b"")
        except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: nested too deep
            await self._keep_malformed(stored, str(exc))
            tracing.note("kept-malformed", str(exc)[:200])
        else:
            tracing.annotate({tracing.JOB_ID: order.job.id, tracing.TARGET: order.target})
            # History first, then the live lease: a grant recorded between the two reads
            # then changes the history after this read, so the fence-0 seal below fails.
            read = await self.store.read_history(order.job.id)
            if await self.store.live(order.job.id) is not None:
                # Someone holds the job: only the live lease's holder may end it.
                tracing.note("later", "lease-live")
                return False
            if not await self._settle(order, advisory, stored, read):
                tracing.note("later", "granted-meanwhile")
                return False
        await self._delete(advisory)
        return True

    async def _settle(
        self,
        order: WorkOrder,
        advisory: MaxDeliveriesAdvisory,
        stored: RawStreamMsg,
        read: HistoryEntry,
    ) -> bool:
        """Store the job's end: the decision it was sealed with (landed, in case the
        sink that sealed it died before writing it), nothing if it is dead already, a
        duplicate if its key was committed, else its dead letter, sealed first (the
        settle rule: never both committed and dead). False when a grant came first: look
        again later."""
        if read.history is not None and read.history.settled is not None:
            await self._land_sealed(order, read.history.settled)
            tracing.note("landed-sealed")
            return True
        letter_subject = subjects.dead_letter(order.target, order.job.id)
        if await last_message(self.js, subjects.STREAM_DLQ, letter_subject) is not None:
            tracing.note("dead-lettered-already")
            return True  # its letter is written (a sink died before the delete)
        holder = await committed_job(self.js, order.target, order.key)
        if holder is not None:
            await self._record_duplicate(order, holder, "already-done")
            tracing.note("duplicate", holder)
            return True
        entry_attempts = read.history.attempts if read.history is not None else []
        history = await attempt_history(self.nc, order.target, order.job.id, entry_attempts, [])
        reason, detail = await self._why(order, advisory, stored, history, read.history)
        letter = DeadLetter(order=order, reason=reason, history=history, detail=detail)
        # Fence 0: no holder decided. A grant recorded since the read makes the seal fail.
        death = SealedDeath(fence=0, letter=letter)
        if not await self.store.seal(order.job.id, death, read):
            return False
        await land(self.js, death)
        tracing.note("dead-lettered", reason)
        self.ended.inc(target=order.target, how=reason)
        log.info(
            "dead-lettered %s after %d deliveries: %s", order.job.id, advisory.deliveries, reason
        )
        return True

    async def _land_sealed(self, order: WorkOrder, sealed: Sealed) -> None:
        """Land the decision the job was sealed with. A commit whose key another job
        committed first is recorded as that job's duplicate: the worker that sealed it
        may have died before doing so, and without the record, deleting the message
        would leave the job counted nowhere."""
        reply = await land(self.js, sealed)
        if (
            isinstance(sealed, SealedCommit)
            and reply.status == "suppressed:duplicate-key"
            and reply.committed_by
        ):
            await self._record_duplicate(order, reply.committed_by, "suppressed")

    async def _why(
        self,
        order: WorkOrder,
        advisory: MaxDeliveriesAdvisory,
        stored: RawStreamMsg,
        history: list[AttemptRecord],
        ledger: JobLeaseHistory | None,
    ) -> tuple[str, str]:
        """The dead letter's reason and detail, from what the job went through: its age,
        its attempts, whether it was ever leased, and why its last delivery was handed
        back (noted by the worker, when known)."""
        age = _age_s(advisory, stored)
        max_age = self._max_age_s(order.target)
        if age is not None and age > max_age:
            return "expired", f"queued {age:.0f} s, more than the {max_age:g} s max age"
        handed_back = await last_hand_back(self.js, order.job.id)
        told = f"; last handed back: {handed_back}" if handed_back else ""
        deliveries = f"{advisory.deliveries} deliveries"
        if history:
            last = history[-1]
            attempts = f"{len(history)} attempt(s); last: {last.outcome} {last.reason}"
            return "deliveries-exhausted", f"{deliveries} and {attempts}{told}"
        if ledger is not None and ledger.fence:
            return "deliveries-exhausted", f"{deliveries}; leased, but no verdict{told}"
        if handed_back in NOBODY_MAY_RUN:
            whom = _eligible(order)
            return "no-eligible-worker", f"{deliveries}, and {whom} never took it{told}"
        # Runnable, but kept out all along: its target at its cap, held or quarantined.
        return "deliveries-exhausted", f"{deliveries}, never leased{told}"

    def _max_age_s(self, target: str) -> float:
        if target in self.settings.targets:
            return self.settings.max_age_s(target)
        return self.settings.fleet.max_job_age_s

    async def _record_duplicate(
        self,
        order: WorkOrder,
        committed_by: str,
        via: Literal["already-done", "suppressed"],
    ) -> None:
        self.ended.inc(target=order.target, how="duplicate")
        await record_duplicate(self.js, order.job.id, order.target, order.key, committed_by, via)

    async def _keep_malformed(self, stored: RawStreamMsg, error: str) -> None:
        subject = stored.subject or ""
        await keep_malformed(
            self.js, self.settings, subject, stored.seq or 0, stored.data or b"", error
        )

    async def _delete(self, advisory: MaxDeliveriesAdvisory) -> None:
        with contextlib.suppress(NotFoundError):
            await self.js.delete_msg(advisory.stream, advisory.stream_seq)


BACKSTOP_SPAN = "backstop dead letter"
"""The span of one look at a job whose deliveries ran out (docs/tracing.md)."""


def _traced(advisory: MaxDeliveriesAdvisory) -> dict[str, AttributeValue] | None:
    if not tracing.tracing_on():
        return None
    return {"jetfleet.deliveries": advisory.deliveries, "jetfleet.stream_seq": advisory.stream_seq}


def _eligible(order: WorkOrder) -> str:
    """Who could have run the job, as the dead letter says it."""
    job = order.job
    whom = f"a worker owning identity {job.pin_identity}" if job.pin_identity else "a worker"
    return f"{whom} of region {job.pin_region}" if job.pin_region else whom


def _age_s(advisory: MaxDeliveriesAdvisory, stored: RawStreamMsg) -> float | None:
    """How long the job had been queued when its deliveries ran out (server clock)."""
    if stored.time is None or not advisory.timestamp:
        return None
    try:
        now = parse_server_time(advisory.timestamp)
    except ValueError:
        return None
    return (now - stored.time).total_seconds()
