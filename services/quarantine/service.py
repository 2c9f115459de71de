"""Read outcome events, count them in the configured rules' windows, and quarantine a
(worker or identity, target) when a rule fires (docs/quarantine.md).

A rule fires through the leaser's own command path (a ``QuarantineSet`` on
``jf.quarantine``), so the leaser revokes and requeues the scope's held leases exactly as
for an operator's ``jetfleet quarantine set``.

Every replica reads every event. A rule counts all of one scope's events in its window,
so events shared out between replicas (a shared durable consumer) would split each
count and no replica would see a rule met. Instead each replica reads ``JF_OUTCOMES``
with its own ephemeral consumer from the longest window before the server's now, which
also rebuilds the windows after a restart: the service keeps no state of its own. A
``fired`` marker in ``jf-control`` per (rule, scope, target) remembers the newest event
that fired it, so neither a second replica nor a replay after a restart sets a record
again from the same evidence (and a record an operator released stays released).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging

import msgspec
from jetfleet.schemas.lease import (
    Evidence,
    QuarantineFired,
    QuarantineRecord,
    QuarantineReply,
    QuarantineSet,
)
from jetfleet.services.quarantine.rule_windows import Firing, RuleWindows, Seen
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import FetchTimeoutError, KeyNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.metrics import CounterFamily
from jetfleet.outcome_events import read_outcome
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings

log = logging.getLogger(__name__)

FETCH_BATCH = 200
FETCH_WAIT_S = 1.0
ERROR_RETRY_S = 2.0
# The server removes a replica's consumer this long after its last fetch: longer than a
# firing may keep the reader busy asking the leaser (5 tries of up to 10 s, 15 s apart).
INACTIVE_S = 300.0
# A record the leaser did not take is asked for again this many times, waiting twice as
# long each time (1 + 2 + 4 + 8 s), before the firing is given up and logged.
SET_ATTEMPTS = 5
SET_TIMEOUT_S = 10.0
# A fired marker outlives the longest window by this much, so a replay that could
# rebuild the same window always finds it.
MARKER_MARGIN_S = 60.0
MAX_REASON_CHARS = 500
JOBS_IN_REASON = 5
MARKER_PREFIX = subjects.QUARANTINE_FIRED_PREFIX
# Windows whose newest event is older than the longest window are looked for this often.
FORGET_EVERY = 1000

_encoder = msgspec.json.Encoder()
_reply_decoder = msgspec.json.Decoder(QuarantineReply)


_marker_decoder = msgspec.json.Decoder(QuarantineFired)


def marker_key(firing: Firing) -> str:
    """The ``jf-control`` key of a rule's fired marker for one scope on one target.

    Worker ids and identities are free text: hashed, so any name makes a valid key.
    """
    rule = firing.rule
    token = hashlib.sha256(f"{rule.scope}\0{firing.name}".encode()).hexdigest()[:32]
    return f"{MARKER_PREFIX}.{firing.target}.{rule.label}.{token}"


def record_for(firing: Firing, max_evidence: int) -> QuarantineRecord:
    """The quarantine record a firing sets: its reason names the rule and the evidence."""
    rule = firing.rule
    jobs = [seen.outcome.job_id for seen in firing.evidence]
    shown = ", ".join(j[:64] for j in jobs[-JOBS_IN_REASON:])
    more = f" and {len(jobs) - JOBS_IN_REASON} more" if len(jobs) > JOBS_IN_REASON else ""
    reason = (
        f"rule {rule.label}: {len(jobs)} {'/'.join(rule.reasons)} outcome(s) from "
        f"{rule.scope} {firing.name[:64]} on {firing.target} within {rule.window_s:g} s "
        f"(jobs {shown}{more})"
    )
    return QuarantineRecord(
        scope=rule.scope,
        name=firing.name,
        target=firing.target,
        # Names are free text: the leaser takes only printable reasons (log lines).
        reason="".join(c if c.isprintable() else "?" for c in reason[:MAX_REASON_CHARS]),
        for_s=rule.for_s,
        set_by=f"rule:{rule.label}",
        evidence=[
            Evidence(job_id=s.outcome.job_id[:128], seq=s.seq, reason=s.outcome.reason[:64])
            for s in firing.evidence[-max_evidence:]
        ],
    )


class QuarantineService:
    """Applies ``quarantine.rules`` to ``JF_OUTCOMES``; any number of replicas may run."""

    name = "quarantine"

    def __init__(self, settings: Settings, nc: NatsClient) -> None:
        self.settings = settings
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.windows = RuleWindows(settings.quarantine.rules)
        self.clock = ServerClock(nc, subjects.STREAM_OUTCOMES)
        self.events = CounterFamily(
            "jetfleet_quarantine_events_total",
            "Outcome events read by the quarantine service: counted, skipped (unreadable) or "
            "unknown-target",
        )
        self.fired = CounterFamily(
            "jetfleet_quarantine_fired_total",
            "Rules met, by rule, target and what came of it (set, kept, already-fired, failed)",
        )
        self.metrics = [self.events, self.fired]
        self.next_seq: int | None = None
        """The ``JF_OUTCOMES`` sequence to read next (None: start from the server's now
        less the longest window)."""
        self._control: KeyValue | None = None
        self._read_since_forget = 0
        self._stopping = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    @property
    def longest_window_s(self) -> float:
        """The longest rule window: how far back a (re)started replica reads."""
        return max((r.window_s for r in self.settings.quarantine.rules), default=0.0)

    async def start(self) -> None:
        """Open the control bucket and start reading outcome events."""
        self._control = await self.js.key_value(subjects.BUCKET_CONTROL)
        if not self.settings.quarantine.rules:
            log.warning("no quarantine.rules configured: the quarantine service sets nothing")
        self._loop = asyncio.create_task(self._read())

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Finish the events in hand (and any record being set), then stop."""
        self._stopping.set()
        if self._loop is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._loop, FETCH_WAIT_S + timeout_s)

    async def _read(self) -> None:
        sub: JetStreamContext.PullSubscription | None = None
        while not self._stopping.is_set():
            try:
                if sub is None:
                    sub = await self._subscribe()
                try:
                    msgs = await sub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_S)
                except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
                    continue
                for msg in msgs:
                    await self._take(msg)
            except Exception:  # a reconnect or leader change: read on from next_seq
                log.exception("reading %s failed; subscribing again", subjects.STREAM_OUTCOMES)
                await self._unsubscribe(sub)
                sub = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), ERROR_RETRY_S)
        await self._unsubscribe(sub)

    async def _unsubscribe(self, sub: JetStreamContext.PullSubscription | None) -> None:
        """Let go of the consumer now rather than when the server times it out."""
        if sub is None:
            return
        with contextlib.suppress(Exception):
            name = (await sub.consumer_info()).name
            await sub.unsubscribe()
            await self.js.delete_consumer(subjects.STREAM_OUTCOMES, name)

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        """An ephemeral consumer of every outcome event from ``next_seq`` on, or from the
        longest window before the server's now."""
        config = js_api.ConsumerConfig(
            ack_policy=js_api.AckPolicy.NONE,
            filter_subject=f"{subjects.PREFIX}.outcome.>",
            inactive_threshold=INACTIVE_S,
            mem_storage=True,
        )
        if self.next_seq is not None:
            config.deliver_policy = js_api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self.next_seq
        else:
            now = await self.clock.now()
            if now is None:
                raise RuntimeError("the NATS server's time cannot be read")
            config.deliver_policy = js_api.DeliverPolicy.BY_START_TIME
            config.opt_start_time = now - datetime.timedelta(seconds=self.longest_window_s)
        info = await self.js.add_consumer(subjects.STREAM_OUTCOMES, config)
        return await self.js.pull_subscribe_bind(info.name, stream=subjects.STREAM_OUTCOMES)

    async def _take(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        self.next_seq = seq + 1
        event = read_outcome(msg.subject, msg.data)
        if isinstance(event, str):
            log.warning("skipped outcome event %d on %s: %s", seq, msg.subject, event)
            self.events.inc(verdict="skipped")
            return
        if event.target not in self.settings.targets:
            # Anyone may publish outcomes; a rule for a target the leaser does not
            # declare could never be set (and would hold up the reader asking).
            self.events.inc(verdict="unknown-target")
            return
        self.events.inc(verdict="counted")
        at_s = msg.metadata.timestamp.timestamp()
        for firing in self.windows.observe(Seen(at_s=at_s, seq=seq, outcome=event)):
            await self.apply(firing)
        self._read_since_forget += 1
        if self._read_since_forget >= FORGET_EVERY:
            self._read_since_forget = 0
            self.windows.forget_before(at_s)

    async def apply(self, firing: Firing) -> None:
        """Set the firing's record through the leaser, unless its evidence fired before."""
        if await self._fired_before(firing):
            log.info(
                "rule %s met again by %s %s on %s from evidence it fired on before",
                firing.rule.label,
                firing.rule.scope,
                firing.name,
                firing.target,
            )
            self._count(firing, "already-fired")
            return
        record = record_for(firing, self.settings.quarantine.max_evidence)
        reply = await self._set(record)
        if reply is None:
            self._count(firing, "failed")
            return
        await self._mark(firing)
        if reply.detail:  # the leaser kept a record in force (an operator's, or longer)
            log.info(
                "%s: %s %s on %s: %s",
                record.set_by,
                record.scope,
                record.name,
                record.target,
                reply.detail,
            )
            self._count(firing, "kept")
            return
        self._count(firing, "set")
        log.warning(
            "%s: quarantined %s %s on %s for %g s; the leaser revoked %d lease(s)",
            record.set_by,
            record.scope,
            record.name,
            record.target,
            record.for_s,
            len(reply.revoked),
        )

    def _count(self, firing: Firing, outcome: str) -> None:
        self.fired.inc(rule=firing.rule.label, target=firing.target, outcome=outcome)

    async def _fired_before(self, firing: Firing) -> bool:
        assert self._control is not None
        try:
            entry = await self._control.get(marker_key(firing))
        except KeyNotFoundError:
            return False
        if not entry.value:
            return False
        return _marker_decoder.decode(entry.value).seq >= firing.evidence[0].seq

    async def _mark(self, firing: Firing) -> None:
        assert self._control is not None
        key = marker_key(firing)
        payload = _encoder.encode(QuarantineFired(seq=firing.evidence[-1].seq))
        ttl = ttl_whole_seconds(self.longest_window_s + MARKER_MARGIN_S)
        # A marker carries a TTL only when created; another replica's marker is replaced.
        await self._control.purge(key)
        with contextlib.suppress(Exception):
            await self._control.create(key, payload, msg_ttl=ttl)

    async def _set(self, record: QuarantineRecord) -> QuarantineReply | None:
        """Send the record to the leaser; its answer, or None once every attempt failed."""
        command = _encoder.encode(QuarantineSet(record=record))
        delay_s = 1.0
        for attempt in range(1, SET_ATTEMPTS + 1):
            try:
                answer = await self.nc.request(subjects.QUARANTINE, command, timeout=SET_TIMEOUT_S)
                reply = _reply_decoder.decode(answer.data)
                if reply.ok:
                    return reply
                why = reply.detail
            except Exception as exc:  # no leaser, a timeout, a garbled answer: try again
                why = f"{type(exc).__name__}: {exc}"
            log.warning(
                "%s: the leaser did not set %s %s on %s (attempt %d of %d): %s",
                record.set_by,
                record.scope,
                record.name,
                record.target,
                attempt,
                SET_ATTEMPTS,
                why,
            )
            if attempt < SET_ATTEMPTS and not self._stopping.is_set():
                await asyncio.sleep(delay_s)
                delay_s *= 2
        log.error(
            "%s: gave up quarantining %s %s on %s",
            record.set_by,
            record.scope,
            record.name,
            record.target,
        )
        return None
