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
again from the same evidence (and a record an operator released stays released). The
marker is claimed by compare-and-set before the record is sent, so only one replica sends.

Each event also feeds the egress rule (``egress_proposals``: several identities of one
subnet blocked propose an egress quarantine for an operator), and each retirement set is
marked for ``second_order`` counting; their logic lives in those modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import time
from dataclasses import dataclass, field

import msgspec
from jetfleet.schemas import Outcome
from jetfleet.schemas.lease import (
    Evidence,
    QuarantineRecord,
    QuarantineReply,
    QuarantineSet,
)
from jetfleet.schemas.names import RequiredName
from jetfleet.services.quarantine.breaker_watch import BreakerWatch
from jetfleet.services.quarantine.egress_proposals import EgressProposals
from jetfleet.services.quarantine.fired_markers import Claim, FiredMarkers
from jetfleet.services.quarantine.rollout_guard import RolloutGuard
from jetfleet.services.quarantine.rule_windows import Firing, RuleWindows, Seen
from jetfleet.services.quarantine.second_order import SecondOrder
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import FetchTimeoutError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.metrics import CounterFamily
from jetfleet.outcome_events import read_outcomes
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings

log = logging.getLogger(__name__)

FETCH_BATCH = 200
ERROR_RETRY_S = 2.0
# The server removes a replica's consumer this long after its last fetch: longer than one
# event can keep the reader busy (its firings' marker claims and one leaser request each,
# of up to SET_TIMEOUT_S).
INACTIVE_S = 300.0
# A firing no leaser answered (or whose marker a KV error kept from being claimed) is
# tried again after RETRY_FIRST_S, twice as long each time up to RETRY_CAP_S, until the
# leaser answers or its evidence is older than the record would last. A refusal is final.
RETRY_FIRST_S = 1.0
RETRY_CAP_S = 30.0
UNTIL_RELEASED_PATIENCE_S = 86400.0
"""How long a firing of a rule whose record lasts until released is tried again."""
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


def _wire_name(name: str) -> bool:
    """Whether ``name`` is a valid quarantine scope name on the wire."""
    try:
        msgspec.convert(name, RequiredName)
    except msgspec.ValidationError:
        return False
    return True


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


@dataclass
class Pending:
    """A firing not yet answered by the leaser."""

    firing: Firing
    claim: Claim | None
    age_s: float
    """How old its newest evidence was when it was first tried."""
    attempts: int = 0
    due: float = 0.0
    queued: float = field(default_factory=time.monotonic)


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
            "Outcome events read by the quarantine service: counted (readable, of a declared "
            "target, of any kind), skipped (unreadable, or a name the leaser refuses) or "
            "unknown-target",
        )
        self.fired = CounterFamily(
            "jetfleet_quarantine_fired_total",
            "Rules met, by rule, target and what came of it (set, kept, already-fired, "
            "stale, failed)",
        )
        self.egress = EgressProposals(settings)
        self.second_order = SecondOrder(settings)
        self.breaker = BreakerWatch(settings, nc)
        self.rollout = RolloutGuard(settings, nc)
        self.metrics = [
            self.events,
            self.fired,
            *self.egress.metrics,
            *self.second_order.metrics,
            self.breaker.fired,
            self.rollout.withdrawals,
        ]
        self.markers: FiredMarkers | None = None
        self.next_seq: int | None = None
        """The ``JF_OUTCOMES`` sequence to read next (None: start from the server's now
        less the longest window)."""
        # (message, events of it taken): where a batch cut short by an error goes on.
        self._taken: tuple[int, int] = (0, 0)
        self.pending: list[Pending] = []
        """Firings waiting to be sent again (no leaser answered, or a KV error)."""
        self._newest_at_s = float("-inf")
        self._control: KeyValue | None = None
        self._read_since_forget = 0
        self._stopping = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    @property
    def longest_window_s(self) -> float:
        """The longest window (of the rules, the egress rule and the breaker): how far
        back a (re)started replica reads."""
        return self.settings.quarantine.longest_window_s

    async def start(self) -> None:
        """Open the control bucket and start reading outcome events."""
        self._control = await self.js.key_value(subjects.BUCKET_CONTROL)
        self.markers = FiredMarkers(
            self.js, self._control, self.longest_window_s + MARKER_MARGIN_S, self.clock
        )
        self.egress.start(self.js, self._control, self.markers)
        self.second_order.start(self.js)
        await self.breaker.start(self._control)
        if not self.settings.quarantine.rules:
            log.warning("no quarantine.rules configured: the quarantine service sets no record")
        self._loop = asyncio.create_task(self._read())

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Finish the events in hand (and any record being set), then stop."""
        self._stopping.set()
        if self._loop is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._loop, self.settings.fleet.long_poll_s + timeout_s)

    async def _read(self) -> None:
        sub: JetStreamContext.PullSubscription | None = None
        while not self._stopping.is_set():
            try:
                await self._retry_due()
                await self.egress.retry_due()
                await self.breaker.retry_due()
                await self.rollout.judge_due()
                if sub is None:
                    sub = await self._subscribe()
                try:
                    msgs = await sub.fetch(FETCH_BATCH, timeout=self.settings.fleet.long_poll_s)
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
        for pending in self.pending:
            log.error(
                "stopping: rule %s on %s %s unsent",
                pending.firing.rule.label,
                pending.firing.name,
                pending.firing.target,
            )
            await self._unclaim(pending.claim)
        await self.egress.stop()
        await self.breaker.stop()

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
        at_s = msg.metadata.timestamp.timestamp()
        # A batch holds only ok events (read_outcomes skips others), which no window
        # that counts each sequence once ever holds: they may share one.
        events = read_outcomes(msg.subject, msg.data, msg.headers)
        taken_seq, taken = self._taken
        # An event that raised is not taken again (as a lone event never was), but the
        # rest of its batch is: the reader subscribes again from this message.
        self.next_seq = seq
        for index in range(taken if taken_seq == seq else 0, len(events)):
            self._taken = (seq, index + 1)
            await self._take_event(msg.subject, seq, at_s, events[index])
        self.next_seq = seq + 1

    async def _take_event(self, subject: str, seq: int, at_s: float, event: Outcome | str) -> None:
        if isinstance(event, str):
            log.warning("skipped outcome event %d on %s: %s", seq, subject, event)
            self.events.inc(verdict="skipped")
            return
        if not _wire_name(event.worker) or (event.identity and not _wire_name(event.identity)):
            # The leaser would refuse the record of a scope named so (too long, or with
            # control characters): asking would only hold up the reader.
            log.warning("skipped outcome event %d on %s: a name the leaser refuses", seq, subject)
            self.events.inc(verdict="skipped")
            return
        if event.target not in self.settings.targets:
            # Anyone may publish outcomes; a rule for a target the leaser does not
            # declare could never be set (and would hold up the reader asking).
            self.events.inc(verdict="unknown-target")
            return
        self.events.inc(verdict="counted")
        self._newest_at_s = max(self._newest_at_s, at_s)
        seen = Seen(at_s=at_s, seq=seq, outcome=event)
        if event.called or event.kind != "blocked":
            # A block the worker met without calling this target (a handler that does
            # not request it) says nothing of how the target treats the identity.
            for firing in self.windows.observe(seen):
                await self.apply(firing)
            await self.egress.observe(seen)
        await self.breaker.observe(seen)
        await self.rollout.observe(seen)
        self._read_since_forget += 1
        if self._read_since_forget >= FORGET_EVERY:
            self._read_since_forget = 0
            self.windows.forget_before(at_s)
            self.egress.forget_before(at_s)
            self.breaker.windows.forget_before(at_s)

    async def apply(self, firing: Firing) -> None:
        """Claim the firing's marker and send its record, unless its evidence fired before.

        A firing whose marker could not be read or claimed (a KV error) is kept pending
        and tried again: the reader has already moved past its events. One whose evidence
        is older than a marker lives (this replica lags far behind) is skipped, ``stale``.
        """
        if await self._outlived(firing):
            return
        try:
            claim = await self._claim(firing)
        except Exception as exc:
            log.warning(
                "rule %s: the fired marker could not be claimed: %r", firing.rule.label, exc
            )
            self._queue(Pending(firing, None, self._age_s(firing)))
            return
        if isinstance(claim, int):
            log.info(
                "rule %s met again by %s %s on %s from evidence it fired on before",
                firing.rule.label,
                firing.rule.scope,
                firing.name,
                firing.target,
            )
            self._count(firing, "already-fired")
            # Events newer than the marker did not fire it: they count on.
            self.windows.restore(firing, after_seq=claim)
            return
        await self._send(Pending(firing, claim, self._age_s(firing)))

    async def _outlived(self, firing: Firing) -> bool:
        """Whether the firing's evidence is older than its fired marker lives (logged and
        counted ``stale``): the marker another replica set from it may have lapsed, so
        claiming could act on the same evidence twice (a released record set again)."""
        assert self.markers is not None
        if not await self.markers.outlived(firing.evidence[-1].at_s):
            return False
        log.error(
            "rule %s met by %s %s on %s from evidence older than %g s (this replica "
            "lags behind the stream): skipped, as a restarted replica would not read it",
            firing.rule.label,
            firing.rule.scope,
            firing.name,
            firing.target,
            self.markers.ttl_s,
        )
        self._count(firing, "stale")
        return True

    def _age_s(self, firing: Firing) -> float:
        """How old the firing's newest evidence is, by the newest event time read."""
        return max(0.0, self._newest_at_s - firing.evidence[-1].at_s)

    def _queue(self, pending: Pending, at_least_s: float = 0.0) -> None:
        pending.attempts += 1
        wait = min(RETRY_FIRST_S * 2 ** (pending.attempts - 1), RETRY_CAP_S)
        pending.due = time.monotonic() + max(wait, min(at_least_s, RETRY_CAP_S))
        self.pending.append(pending)

    async def _retry_due(self) -> None:
        """Try again the pending firings whose wait is over; drop those whose evidence is
        older than the record would last (it would have expired by now)."""
        now = time.monotonic()
        due = [p for p in self.pending if p.due <= now]
        self.pending = [p for p in self.pending if p.due > now]
        for pending in due:
            firing = pending.firing
            # A record until released has no end to wait past: a day bounds its retries
            # (a leaser failing that long needs an operator, not one more ask).
            for_s = firing.rule.for_s or UNTIL_RELEASED_PATIENCE_S
            if pending.age_s + (now - pending.queued) > for_s:
                log.error(
                    "rule %s: gave up %s %s on %s, its evidence is older than %g s",
                    firing.rule.label,
                    firing.rule.scope,
                    firing.name,
                    firing.target,
                    for_s,
                )
                self._count(firing, "failed")
                await self._unclaim(pending.claim)
                continue
            if pending.claim is None:
                if await self._outlived(firing):
                    continue
                try:
                    claim = await self._claim(firing)
                except Exception as exc:
                    log.warning(
                        "rule %s: the fired marker could not be claimed: %r", firing.rule.label, exc
                    )
                    self._queue(pending)
                    continue
                if isinstance(claim, int):
                    self._count(firing, "already-fired")
                    continue
                pending.claim = claim
            await self._send(pending)

    async def _send(self, pending: Pending) -> None:
        """Send the pending firing's record once: set, refused (never asked again), or
        unanswered (kept pending)."""
        firing = pending.firing
        record = record_for(firing, self.settings.quarantine.max_evidence)
        record = await self.second_order.neighboured(firing, record)
        command = _encoder.encode(QuarantineSet(record=record))
        try:
            answer = await self.nc.request(subjects.QUARANTINE, command, timeout=SET_TIMEOUT_S)
            reply = _reply_decoder.decode(answer.data)
        except (NatsTimeoutError, NoRespondersError, TimeoutError) as exc:
            log.warning(
                "%s: no leaser answered for %s %s on %s (attempt %d), asking again: %r",
                record.set_by,
                record.scope,
                record.name,
                record.target,
                pending.attempts + 1,
                exc,
            )
            self._queue(pending)
            return
        except Exception as exc:  # a garbled answer: asking again would get the same
            reply = QuarantineReply(ok=False, detail=f"{type(exc).__name__}: {exc}")
        if not reply.ok and reply.retry_after_s > 0:
            # Busy, or JetStream did not answer the leaser in time: it did not look at
            # the record, so nothing is wrong with it. Asked again, like no answer.
            log.warning(
                "%s: the leaser could not set %s %s on %s now (attempt %d), asking again: %s",
                record.set_by,
                record.scope,
                record.name,
                record.target,
                pending.attempts + 1,
                reply.detail,
            )
            self._queue(pending, at_least_s=reply.retry_after_s)
            return
        if not reply.ok:
            log.error(
                "%s: the leaser refused %s %s on %s: %s",
                record.set_by,
                record.scope,
                record.name,
                record.target,
                reply.detail,
            )
            self._count(firing, "failed")
            await self._unclaim(pending.claim)
            return
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
        await self.second_order.retired(firing, record)
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

    async def _claim(self, firing: Firing) -> Claim | int:
        """Move the firing's marker to its newest evidence, atomically (compare and set on
        the marker's revision), so of two replicas only one sends; or the marker's seq if
        it already covers the firing's oldest evidence."""
        assert self.markers is not None
        return await self.markers.claim(
            marker_key(firing), firing.evidence[0].seq, firing.evidence[-1].seq
        )

    async def _unclaim(self, claim: Claim | None) -> None:
        """Put a claimed marker back as it was (unless another replica moved it on)."""
        if self.markers is not None:
            await self.markers.unclaim(claim)
