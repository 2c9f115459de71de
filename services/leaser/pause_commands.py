"""The leaser's side of the pause switch: the commands on ``jf.pause`` (pause, resume,
list), the server-side pause of the work consumers a fleet or target pause covers, and
the revocation of held leases for ``--now`` (docs/pause.md).

A pause is answered only once this replica's own book has it, so the next grant this
replica makes is refused; other replicas learn of it through their watch within
milliseconds, and ``--now`` sweeps the scope again ``PROPAGATION_S`` later for a grant
one of them made meanwhile. The consumers' pause state is always derived from every
record in force (``consumer_pauses``), by this replica on its commands, by every replica
on the changes its watch brings, and at start: overlapping pauses (a fleet pause over a
target pause) resume a consumer only when the last of them ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from jetfleet.schemas.control import (
    FLEET_NAME,
    PauseCommand,
    PauseList,
    PauseRecord,
    PauseReply,
    PauseResume,
    PauseSet,
)
from jetfleet.services.leaser.call_checks import undeclared
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.pause_book import (
    SCOPES,
    PauseBook,
    PauseEntry,
    consumer_pauses,
    pause_key,
    rfc3339,
)
from jetfleet.server_clock import ServerClock, parse_server_time
from jetfleet.settings import Settings
from jetfleet.work_lanes import LaneMap

log = logging.getLogger(__name__)
PROPAGATION_S = 1.0
# Consumer pause calls in flight at once (a fleet pause of many lanes).
CALLS_IN_FLIGHT = 16


def pause_objection(settings: Settings, command: PauseCommand) -> PauseReply | None:
    """What is wrong with a pause command its type admits, with what to fix; or None."""
    if isinstance(command, PauseList):
        return None
    if command.scope != "fleet" and not command.name:
        return PauseReply(ok=False, detail=f"name the {command.scope} to pause or resume")
    if command.scope == "target" and isinstance(command, PauseSet):
        # A resume may name a target since dropped from the settings.
        why = undeclared(settings, command.name, "leaser")
        if why is not None:
            return PauseReply(ok=False, detail=f"not paused: {why}")
    return None


def record_of(command: PauseSet) -> PauseRecord:
    """The record a pause command keeps."""
    return PauseRecord(
        scope=command.scope,
        name=FLEET_NAME if command.scope == "fleet" else command.name,
        for_s=command.for_s,
        mode=command.mode,
        by=command.by,
        why=command.why,
    )


class PauseCommands:
    """Applies pause commands for one leaser replica."""

    def __init__(
        self,
        settings: Settings,
        js: JetStreamContext,
        book: PauseBook,
        clock: ServerClock,
        revoke: Callable[[PauseRecord], Awaitable[list[str]]],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.settings = settings
        self.js = js
        self.book = book
        self.clock = clock
        self.revoke = revoke
        """Revokes the live leases a pause covers and requeues their jobs; the job ids."""
        self.spawn = spawn
        self._reconciling = asyncio.Lock()
        # Before the book starts, so no change is missed.
        book.on_change = self._changed

    async def command(self, command: PauseCommand) -> PauseReply:
        """Apply one pause command (one refused is answered here, not by the route's
        check, so the audit records the refusal too)."""
        objection = pause_objection(self.settings, command)
        if objection is not None:
            return objection
        if isinstance(command, PauseList):
            now = await self.clock.now()
            views = [e.view(now) for e in sorted(self.book.in_force(now), key=_order)]
            return PauseReply(ok=True, pauses=views)
        if isinstance(command, PauseResume):
            return await self._resume(command)
        return await self._pause(command)

    async def _pause(self, command: PauseSet) -> PauseReply:
        record = record_of(command)
        entry = await self.book.put(record)
        # From here this replica refuses grants in scope: the book has the record.
        await self.reconcile()
        consumers = sorted(consumer_pauses(self.settings, [entry]))
        revoked: list[str] = []
        if record.mode == "now":
            revoked = await self.revoke(record)
            self.spawn(self._sweep_again(entry))
        log.warning(
            "paused %s %s %s (%s, by %s: %s); %d consumer(s) paused at the server, "
            "%d lease(s) revoked",
            record.scope,
            record.name,
            f"for {record.for_s:g} s" if record.for_s else "until resumed",
            record.mode,
            record.by or "unknown",
            record.why,
            len(consumers),
            len(revoked),
        )
        return PauseReply(
            ok=True,
            pauses=[entry.view(await self.clock.now())],
            revoked=revoked,
            consumers=consumers,
        )

    async def _resume(self, command: PauseResume) -> PauseReply:
        name = FLEET_NAME if command.scope == "fleet" else command.name
        ended = await self.book.remove(command.scope, name)
        await self.reconcile()
        still = consumer_pauses(self.settings, self.book.in_force(await self.clock.now()))
        ended_held = consumer_pauses(self.settings, [ended]) if ended is not None else {}
        consumers = sorted(set(ended_held) - set(still))
        if ended is None:
            detail = f"not paused: {command.scope} {name} has no pause in force"
            return PauseReply(ok=True, detail=detail, consumers=consumers)
        log.warning(
            "resumed %s %s (by %s: %s); %d consumer(s) resumed at the server",
            command.scope,
            name,
            command.by or "unknown",
            command.why,
            len(consumers),
        )
        return PauseReply(ok=True, consumers=consumers)

    def _changed(self, key: str, entry: PauseEntry | None) -> None:
        """Another replica's command, as this replica's watch brings it."""
        self.spawn(self._reconcile_logged())
        if entry is not None and entry.record.mode == "now":
            self.spawn(self._sweep(entry, "as this replica's watch learned of its pause"))

    async def _reconcile_logged(self) -> None:
        try:
            await self.reconcile()
        except Exception as exc:  # the next change, or the next start, tries again
            log.error("could not set the work consumers' pause state: %r", exc)

    async def _sweep_again(self, entry: PauseEntry) -> None:
        await asyncio.sleep(PROPAGATION_S)
        await self._sweep(entry, "granted while the pause propagated")

    async def _sweep(self, entry: PauseEntry, when: str) -> None:
        """Revoke the leases a ``now`` pause covers if it is still in force."""
        key_entry = self.book.entries.get(pause_key(entry.record.scope, entry.record.name))
        if key_entry is None or key_entry.revision != entry.revision:
            return  # resumed or replaced since
        if not entry.in_force(await self.clock.now()):
            return
        late = await self.revoke(entry.record)
        if late:
            log.warning("revoked %d lease(s) %s: %s", len(late), when, ", ".join(late))

    async def reconcile(self) -> list[str]:
        """Set every work consumer's server-side pause to what the pauses in force say;
        the consumers changed. One at a time per replica, so a later call never runs
        with an older view than an earlier one."""
        async with self._reconciling:
            now = await self.clock.now()
            wanted = consumer_pauses(self.settings, self.book.in_force(now))
            current = await self._paused_now()
            calls: list[tuple[str, datetime.datetime | None]] = []
            for name in _work_consumers(self.settings):
                until = wanted.get(name)
                if until is not None and not _same_moment(current.get(name), until):
                    calls.append((name, until))
                elif until is None and name in current:
                    calls.append((name, None))
            gate = asyncio.Semaphore(CALLS_IN_FLIGHT)

            async def call(name: str, until: datetime.datetime | None) -> None:
                # A consumer not made yet is made paused by topology declare.
                async with gate:
                    with contextlib.suppress(NotFoundError):
                        if until is None:
                            await self.js.resume_consumer(subjects.STREAM_WORK, name)
                        else:
                            until_text = rfc3339(until)
                            await self.js.pause_consumer(subjects.STREAM_WORK, name, until_text)

            await asyncio.gather(*(call(name, until) for name, until in calls))
            return [name for name, _ in calls]

    async def _paused_now(self) -> dict[str, datetime.datetime]:
        """The work consumers paused at the server now, with their pause_until."""
        paused: dict[str, datetime.datetime] = {}
        offset = 0
        while True:
            try:
                page = await self.js.consumers_info(subjects.STREAM_WORK, offset=offset)
            except NotFoundError:  # no work stream yet: nothing is paused
                return paused
            for info in page:
                if info.paused and info.config.pause_until and info.name:
                    paused[info.name] = parse_server_time(info.config.pause_until)
            offset += len(page)
            if len(page) == 0:
                return paused


def _work_consumers(settings: Settings) -> list[str]:
    return [lane.consumer(tier) for lane in LaneMap(settings).lanes for tier in subjects.TIERS]


def _order(entry: PauseEntry) -> tuple[int, str]:
    return SCOPES.index(entry.record.scope), entry.record.name


def _same_moment(held: datetime.datetime | None, until: datetime.datetime) -> bool:
    """Whether a consumer paused until ``held`` is paused until ``until`` (a stored time
    read as a float of nanoseconds may be a microsecond off the same time read as text)."""
    return held is not None and abs((held - until).total_seconds()) < 0.001
