"""The quarantine service's side of the circuit breaker (docs/quarantine.md#the-target-
circuit-breaker): count refusals per target in ``BreakerWindows`` and ask the leaser to
open a target's breaker when K distinct identities were refused there within the window;
and judge a half-open breaker's probe by its outcome, asking the leaser to close the
breaker (the site answered) or to open it again for a longer cooling (refused again).

Every replica reads every event and may ask; the leaser's compare-and-sets and the
target's fired marker make one opening of the same evidence, and one verdict per probe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
from jetfleet.schemas.breaker import (
    BreakerClose,
    BreakerOpen,
    BreakerRecord,
    BreakerReply,
)
from jetfleet.schemas.lease import Evidence
from jetfleet.services.leaser.breaker_commands import MARKER_MARGIN_S as FIRED_MARKER_MARGIN_S
from jetfleet.services.quarantine.breaker_windows import BreakerWindows, Opening
from jetfleet.services.quarantine.rule_windows import Seen
from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.breaker_book import BreakerBook
from jetfleet.metrics import CounterFamily
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_reply_decoder = msgspec.json.Decoder(BreakerReply)
ASK_TIMEOUT_S = 10.0
RETRY_FIRST_S = 1.0
RETRY_CAP_S = 30.0
NAMES_IN_REASON = 5
MAX_REASON_CHARS = 500


def _printable(text: str, limit: int) -> str:
    # Names are free text: the leaser takes only printable reasons (log lines).
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def opening_record(settings: Settings, opening: Opening) -> BreakerRecord:
    """The record an opening sets: its reason names the identities and the window."""
    breaker = settings.quarantine.breaker
    names = opening.identities
    shown = ", ".join(n[:64] for n in names[:NAMES_IN_REASON])
    more = f" and {len(names) - NAMES_IN_REASON} more" if len(names) > NAMES_IN_REASON else ""
    reason = (
        f"{len(names)} identities refused ({'/'.join(breaker.reasons)}) on {opening.target} "
        f"within {breaker.window_s:g} s: {shown}{more}"
    )
    return BreakerRecord(
        target=opening.target,
        cool_s=breaker.cool_s,
        reason=_printable(reason, MAX_REASON_CHARS),
        opened_by="breaker",
        identities=[_printable(n, 300) for n in names[:1000]],
        evidence=[_evidence(s) for s in opening.evidence[-settings.quarantine.max_evidence :]],
    )


def _evidence(seen: Seen) -> Evidence:
    event = seen.outcome
    return Evidence(job_id=event.job_id[:128], seq=seen.seq, reason=event.reason[:64])


@dataclass
class Ask:
    """A command the leaser has not answered yet."""

    command: BreakerOpen | BreakerClose
    opening: Opening | None
    what: str
    """What a ``set`` answer counts as (opened, probe-closed, probe-reopened)."""
    attempts: int = 0
    due: float = 0.0
    first: float = field(default_factory=time.monotonic)


class BreakerWatch:
    """Feeds the breaker from the outcome events one quarantine replica reads."""

    def __init__(self, settings: Settings, nc: NatsClient) -> None:
        self.settings = settings
        self.nc = nc
        self.windows = BreakerWindows(settings.quarantine.breaker)
        self.fired = CounterFamily(
            "jetfleet_breaker_fired_total",
            "Circuit breaker asks of the quarantine service by target and outcome (opened, "
            "kept, already-fired, stale, failed, probe-closed, probe-reopened, "
            "probe-inconclusive)",
        )
        self.pending: list[Ask] = []
        self.book: BreakerBook | None = None
        self.clock = ServerClock(nc, subjects.STREAM_OUTCOMES)

    async def start(self, control: KeyValue) -> None:
        """Follow the breakers in force (to know a probe's outcome when it comes)."""
        self.book = BreakerBook(self.nc.jetstream(), control)
        await self.book.start()

    async def stop(self) -> None:
        """Stop following; asks still unanswered are logged (a replay asks again)."""
        for ask in self.pending:
            log.error("stopping: breaker %s unsent", ask.what)
        if self.book is not None:
            await self.book.stop()

    async def observe(self, seen: Seen) -> None:
        """Count one outcome event of a declared target, and ask what it makes."""
        # Disabled, it opens nothing (BreakerWindows counts nothing) but still judges the
        # probes of breakers open already, so they close.
        if self.book is None:
            return
        target = seen.outcome.target
        if self.book.known(target) and seen.outcome.fence and await self._judge_probe(seen):
            return
        opening = self.windows.observe(seen)
        if opening is None:
            return
        # Asked even when the breaker is open already: the leaser then moves the fired
        # marker over this evidence (and answers kept), so a replay after the breaker
        # closed does not open it again from refusals that came in while it was open.
        if await self._outlived(opening):
            log.error(
                "breaker of %s met on evidence older than its fired marker lives: skipped", target
            )
            self.fired.inc(target=target, outcome="stale")
            return
        record = opening_record(self.settings, opening)
        await self._ask(Ask(BreakerOpen(record=record), opening, "opened"))

    async def _judge_probe(self, seen: Seen) -> bool:
        """If ``seen`` is the outcome of the target's probe lease (its fence), ask for
        the verdict; whether it was."""
        assert self.book is not None
        event = seen.outcome
        found = await self.book.probe(event.target)
        if found is None:
            return False
        probe = found[0]
        # The worker too: an outcome of another worker naming the probe's job and fence
        # (forged, or a stale worker's) decides nothing.
        if (probe.job_id, probe.fence, probe.worker) != (event.job_id, event.fence, event.worker):
            return False
        record, _ = await self.book.record(event.target)
        if record is None:
            return False
        breaker = self.settings.quarantine.breaker
        # attempts-exhausted: the last attempt's timeout or 5xx, made final; no verdict.
        inconclusive = event.kind == "retryable" or event.reason == "attempts-exhausted"
        if inconclusive or not event.called:
            # A timeout or a 5xx says nothing of whether the site still refuses us, nor
            # does a job judged without a request (expired, robots-disallowed...). A
            # lease handed back frees the probe as it is released; one that ended here
            # (the job settled unsent) frees it now, so another probe goes at once.
            if not event.called or event.kind != "retryable":
                # Settled here: no release will free it.
                await self.book.free_probe(event.target, probe)
            self.fired.inc(target=event.target, outcome="probe-inconclusive")
        elif self.windows.counts(seen):
            cool_s = min(record.cool_s * 2, max(breaker.max_cool_s, record.cool_s))
            again = msgspec.structs.replace(
                record,
                cool_s=cool_s,
                opens=record.opens + 1,
                opened_by="probe",
                reason=_printable(
                    f"the probe (job {event.job_id[:64]}, identity "
                    f"{(event.identity or event.worker)[:64]}) was refused again "
                    f"({event.reason}); {record.reason}",
                    MAX_REASON_CHARS,
                ),
                evidence=[_evidence(seen)],
            )
            reopen = BreakerOpen(record=again, after_opens=record.opens)
            await self._ask(Ask(reopen, None, "probe-reopened"))
        else:
            close = BreakerClose(
                target=event.target,
                opens=record.opens,
                by="probe",
                reason=f"the probe (job {event.job_id[:64]}) was answered: {event.kind}",
            )
            await self._ask(Ask(close, None, "probe-closed"))
        return True

    async def retry_due(self) -> None:
        """Ask again what no leaser answered, once its wait is over; give up on what
        waited longer than the breaker's window (its evidence is stale by then)."""
        now = time.monotonic()
        due = [a for a in self.pending if a.due <= now]
        self.pending = [a for a in self.pending if a.due > now]
        for ask in due:
            if now - ask.first > self.settings.quarantine.breaker.window_s:
                log.error("breaker %s given up: no leaser answered", ask.what)
                self.fired.inc(target=_target(ask), outcome="failed")
                continue
            await self._ask(ask)

    async def _ask(self, ask: Ask) -> None:
        target = _target(ask)
        try:
            answer = await self.nc.request(
                subjects.BREAKER, _encoder.encode(ask.command), timeout=ASK_TIMEOUT_S
            )
            reply = _reply_decoder.decode(answer.data)
        except (NatsTimeoutError, NoRespondersError, TimeoutError) as exc:
            log.warning("breaker %s of %s: no leaser answered: %r", ask.what, target, exc)
            self._queue(ask)
            return
        except Exception as exc:  # a garbled answer: asking again would get the same
            reply = BreakerReply(ok=False, detail=f"{type(exc).__name__}: {exc}")
        if not reply.ok and reply.retry_after_s > 0:
            # Busy, or JetStream did not answer the leaser: nothing is wrong with the ask.
            log.warning(
                "breaker %s of %s: the leaser could not now: %s", ask.what, target, reply.detail
            )
            self._queue(ask, reply.retry_after_s)
            return
        if not reply.ok:
            log.error("breaker %s of %s refused by the leaser: %s", ask.what, target, reply.detail)
            self.fired.inc(target=target, outcome="failed")
        elif reply.fired_seq and ask.opening is not None:
            # The same evidence opened it before (a replay): newer events count on.
            self.windows.restore(ask.opening, after_seq=reply.fired_seq)
            self.fired.inc(target=target, outcome="already-fired")
        elif reply.detail:  # nothing changed: open already, or changed by another replica
            log.info("breaker %s of %s: %s", ask.what, target, reply.detail)
            self.fired.inc(target=target, outcome="kept")
        else:
            self.fired.inc(target=target, outcome=ask.what)

    def _queue(self, ask: Ask, at_least_s: float = 0.0) -> None:
        ask.attempts += 1
        wait = min(RETRY_FIRST_S * 2 ** (ask.attempts - 1), RETRY_CAP_S)
        ask.due = time.monotonic() + max(wait, min(at_least_s, RETRY_CAP_S))
        self.pending.append(ask)

    async def _outlived(self, opening: Opening) -> bool:
        """Whether the opening's newest evidence is older than the target's fired marker
        lives, by the server's now (this replica lags far behind): the marker may have
        lapsed, and the leaser would open a closed breaker again on old evidence."""
        now = await self.clock.now()
        # The leaser writes the marker with the service's longest window (a restart
        # reads back that far), not the breaker's own.
        ttl_s = self.settings.quarantine.longest_window_s + FIRED_MARKER_MARGIN_S
        return now is not None and opening.evidence[-1].at_s <= now.timestamp() - ttl_s


def _target(ask: Ask) -> str:
    command = ask.command
    return command.target if isinstance(command, BreakerClose) else command.record.target
