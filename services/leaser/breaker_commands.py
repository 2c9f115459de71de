"""The leaser's side of the circuit breaker: the commands on ``jf.breaker`` (open, close,
list), each opening revoking the target's live leases, and the alerts on
``jf.alert.<target>`` (docs/quarantine.md#the-target-circuit-breaker).

Every write is a compare-and-set on the record's revision, so of two leaser replicas (or
two quarantine replicas asking at once) only one opens, re-opens or closes a breaker, and
only it alerts. Every opening asked (kept ones too) moves the target's fired marker over
its evidence, and a close moves it to the newest outcome event stored, so evidence read
again (a replica replaying the stream) never opens a closed breaker again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from jetfleet.schemas.breaker import (
    BreakerAlert,
    BreakerChange,
    BreakerClose,
    BreakerCommand,
    BreakerList,
    BreakerOpen,
    BreakerRecord,
    BreakerReply,
)
from jetfleet.services.leaser.call_checks import QUARANTINE_MAX_EVIDENCE, undeclared
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.breaker_book import BreakerBook, target_of
from jetfleet.metrics import CounterFamily
from jetfleet.settings import MAX_RULE_WINDOW_S, Settings

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
# Other replicas learn of an opening through their watch within milliseconds, and each
# sweeps the target itself as it learns; a grant made meanwhile is also revoked by a
# second sweep of the opener this much later.
PROPAGATION_S = 1.0
# A fired marker outlives the quarantine service's longest window (how far back a
# restarted replica reads) by this much, as the rules' markers do.
MARKER_MARGIN_S = 60.0
MAX_REASON_CHARS = 1024
MAX_IDENTITIES = 1000


def breaker_objection(settings: Settings, command: BreakerCommand) -> BreakerReply | None:
    """What is wrong with a breaker command its type admits, with what to fix; or None."""
    if not isinstance(command, BreakerOpen):
        # A close may name any valid target: one dropped from the settings may still
        # have a breaker to close.
        return None
    why = undeclared(settings, command.record.target, "leaser")
    if why is None:
        why = _record_objection(command.record)
    return BreakerReply(ok=False, detail=f"breaker not opened: {why}") if why else None


def _record_objection(record: BreakerRecord) -> str | None:
    if not 1 <= record.cool_s <= MAX_RULE_WINDOW_S:
        return f"record.cool_s is {record.cool_s}: give 1 to {MAX_RULE_WINDOW_S:g} seconds"
    if record.opens < 1:
        return f"record.opens is {record.opens}: give a whole number >= 1"
    for field, text, bound in (
        ("reason", record.reason, MAX_REASON_CHARS),
        ("opened_by", record.opened_by, 128),
    ):
        if len(text) > bound or not text.isprintable():
            return f"record.{field}: at most {bound} printable characters"
    if len(record.identities) > MAX_IDENTITIES or any(
        len(i) > 300 or not i.isprintable() for i in record.identities
    ):
        return (
            f"record.identities: at most {MAX_IDENTITIES} names of at most 300 printable characters"
        )
    if len(record.evidence) > QUARANTINE_MAX_EVIDENCE or any(
        len(e.job_id) > 128 or len(e.reason) > 64 or e.seq < 0 for e in record.evidence
    ):
        return (
            f"record.evidence: at most {QUARANTINE_MAX_EVIDENCE} events, each a job id of "
            "at most 128 characters, a reason of at most 64 and a stream sequence >= 0"
        )
    return None


class BreakerCommands:
    """Applies breaker commands for one leaser replica."""

    def __init__(
        self,
        settings: Settings,
        js: JetStreamContext,
        book: BreakerBook,
        revoke: Callable[[str], Awaitable[list[str]]],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.settings = settings
        self.js = js
        self.book = book
        self.revoke = revoke
        """Revokes every live lease of a target and requeues its job; the job ids."""
        self.spawn = spawn
        self.changes = CounterFamily(
            "jetfleet_breaker_changes_total",
            "Circuit breakers opened, re-opened (a probe refused) or closed, by target",
        )
        # Before the book starts, so no record appearing is missed.
        book.watch.on_new = lambda name: self.spawn(
            self._sweep(target_of(name), "as this replica's watch learned of its breaker")
        )
        self.marker_ttl_s = settings.quarantine.longest_window_s + MARKER_MARGIN_S

    async def command(self, command: BreakerOpen | BreakerClose | BreakerList) -> BreakerReply:
        """Apply one breaker command."""
        if isinstance(command, BreakerList):
            return BreakerReply(ok=True, breakers=await self.book.views())
        if isinstance(command, BreakerClose):
            return await self._close(command)
        return await self._open(command)

    async def _open(self, command: BreakerOpen) -> BreakerReply:
        record = command.record
        target = record.target
        if command.after_opens == 0 and record.evidence:
            # First, whether the breaker is open or not: evidence met while it is open
            # (answered kept) must not open it again once closed, when a replica replays.
            seqs = [e.seq for e in record.evidence]
            fired = await self.book.claim_fired(target, min(seqs), max(seqs), self.marker_ttl_s)
            if fired is not None:
                return BreakerReply(
                    ok=True,
                    detail=f"already-fired: this evidence opened {target}'s breaker before, "
                    "or came before it was last closed",
                    fired_seq=fired,
                )
        current, revision = await self.book.record(target)
        if command.after_opens == 0 and current is not None:
            return BreakerReply(
                ok=True,
                detail=f"kept: the breaker of {target} is open already",
                breakers=[await self.book.view(current)],
            )
        if command.after_opens and (current is None or current.opens != command.after_opens):
            return BreakerReply(
                ok=True, detail=f"stale: the breaker of {target} changed since the probe"
            )
        if not await self.book.open(record, revision):
            return BreakerReply(ok=True, detail=f"kept: another replica changed {target} first")
        revoked = await self.revoke(target)
        change: BreakerChange = "reopened" if command.after_opens else "opened"
        log.warning(
            "circuit breaker of %s %s for %g s (%s); revoked %d lease(s)",
            target,
            change,
            record.cool_s,
            record.reason,
            len(revoked),
        )
        self.spawn(self._sweep_again(target))  # also for a re-opening, which no watch learns
        await self._alert(record, change, record.opened_by)
        return BreakerReply(ok=True, breakers=[await self.book.view(record)], revoked=revoked)

    async def _close(self, command: BreakerClose) -> BreakerReply:
        target = command.target
        current, revision = await self.book.record(target)
        if current is None:
            return BreakerReply(ok=True, detail=f"not open: {target} has no breaker open")
        if command.opens and current.opens != command.opens:
            return BreakerReply(ok=True, detail=f"stale: the breaker of {target} changed")
        # The close's horizon, before the close: refusals stored before it (a replica
        # replaying them, or one still counting them) open nothing once it is closed.
        outcomes = await self.js.stream_info(subjects.STREAM_OUTCOMES)
        await self.book.hold_fired_at(target, outcomes.state.last_seq, self.marker_ttl_s)
        if not await self.book.close(target, revision):
            return BreakerReply(ok=True, detail=f"stale: another replica changed {target} first")
        log.warning("circuit breaker of %s closed by %s %s", target, command.by, command.reason)
        closed = msgspec.structs.replace(current, reason=command.reason or current.reason)
        await self._alert(closed, "closed", command.by)
        return BreakerReply(ok=True)

    async def _sweep_again(self, target: str) -> None:
        await asyncio.sleep(PROPAGATION_S)
        await self._sweep(target, "granted while its breaker's opening propagated")

    async def _sweep(self, target: str, when: str) -> None:
        """Revoke the target's live leases if its breaker is open (cooling): the grants
        made before its opening reached every replica (``when`` says which sweep)."""
        record, _ = await self.book.record(target)
        if record is None or not await self.book.cooling(target):
            return  # closed, or a probe may be in flight: not ours to revoke
        late = await self.revoke(target)
        if late:
            log.warning(
                "revoked %d lease(s) of %s %s",
                len(late),
                target,
                when,
            )

    async def _alert(self, record: BreakerRecord, change: BreakerChange, by: str) -> None:
        self.changes.inc(target=record.target, change=change)
        alert = BreakerAlert(
            target=record.target,
            change=change,
            reason=record.reason,
            by=by,
            cool_s=record.cool_s if change != "closed" else 0.0,
            opens=record.opens,
            identities=record.identities,
        )
        try:
            await self.js.publish(subjects.alert(record.target), _encoder.encode(alert))
        except Exception as exc:  # the change is made; an alert lost is logged, not fatal
            log.error("the %s alert of %s was not stored: %r", change, record.target, exc)
