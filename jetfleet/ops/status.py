"""Fleet status computed from durable state (streams, consumers, and the rate limiter's
Redis), never from counters a service keeps in memory, so any process can answer and a
restart changes nothing."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.inflight_caps import CapsUnavailable
from jetfleet.ops.breaker_status import open_breakers
from jetfleet.ops.dead_letters import purged_counts
from jetfleet.ops.limiter_state import LimiterHealth, TargetHold, limiter_state
from jetfleet.ops.pause_status import pauses_in_force
from jetfleet.ops.quarantine_view import ProposalShown, RecordShown, read_quarantines
from jetfleet.schemas.breaker import BreakerView
from jetfleet.schemas.control import PauseView
from jetfleet.settings import Settings
from jetfleet.stream_reader import count_messages
from jetfleet.target_places import TargetPlaces
from jetfleet.work_lanes import LaneMap

# Reads of one kind in flight at once: enough to hide round trips at thousands of
# targets, few enough not to flood the server's API with ephemeral consumers.
READS_IN_FLIGHT = 32

# A read that does not add up is read again, up to this many reads in all, this far
# apart: a job caught between two states (acked in one stream, not yet stored in the
# next) is counted once a moment later, so only a lasting difference is flagged.
CONFIRM_READS = 3
CONFIRM_GAP_S = 0.25

FIELDS = ("submitted", "queued", "leased", "committed", "dead", "rejected")


class TargetCounts(msgspec.Struct):
    """The six counts of one target (or of the whole fleet)."""

    submitted: int = 0
    queued: int = 0
    leased: int = 0
    committed: int = 0
    dead: int = 0
    rejected: int = 0

    def add(self, other: TargetCounts) -> None:
        """Add ``other`` into this one."""
        for field in FIELDS:
            setattr(self, field, getattr(self, field) + getattr(other, field))


class FleetStatus(msgspec.Struct):
    """What ``jetfleet status --json`` prints."""

    totals: TargetCounts
    targets: dict[str, TargetCounts]
    admitting: int = 0
    """Submissions the scheduler has not decided yet (not attributed to a target)."""
    unaccounted: int = 0
    """submitted - (queued + leased + committed + dead + rejected) - admitting, in total.
    Non-zero for a moment while a job changes state; a lasting difference means a job
    went missing (or was counted twice) and is flagged."""
    conserved: bool = True
    """Whether every submitted job is in exactly one state right now (see ``unaccounted``)."""
    reads: int = 1
    """How many reads this answer took: each earlier one did not add up (see
    ``confirmed_status``)."""
    rate_limiter: LimiterHealth = "ok"
    """``ok``, or ``failing-closed``: the limiter's Redis does not answer, so no permits
    are given and nothing is sent (jetfleet/ops/limiter_state.py)."""
    rate_limiter_detail: str = ""
    """Why it is failing closed."""
    holds: list[TargetHold] = msgspec.field(default_factory=list)
    """Targets held fleet-wide and the seconds left, longest first, at most
    ``MAX_HOLDS_SHOWN`` of them."""
    held: int = 0
    """How many targets are held in all (``holds`` may list fewer)."""
    quarantines: list[RecordShown] = msgspec.field(default_factory=list)
    """The quarantine records in force (worker, identity and egress), with time left."""
    proposals: list[ProposalShown] = msgspec.field(default_factory=list)
    """Egress proposals waiting for an operator (and rejected ones until they lapse)."""
    second_order: int = 0
    """Retirements in force that followed a neighbour's on the same subnet and target."""
    breakers: list[BreakerView] = msgspec.field(default_factory=list)
    """Targets whose circuit breaker is open, probing or half-open (paused fleet-wide)."""
    pauses: list[PauseView] = msgspec.field(default_factory=list)
    """The pauses in force (docs/pause.md), widest scope first."""


async def confirmed_status(
    js: JetStreamContext,
    settings: Settings,
    reads: int = CONFIRM_READS,
    gap_s: float = CONFIRM_GAP_S,
) -> FleetStatus:
    """``fleet_status``, read again while it does not add up (``reads`` reads at most,
    ``gap_s`` apart): the first read that adds up, or the last one."""
    return await read_until_conserved(lambda: fleet_status(js, settings), reads, gap_s)


async def read_until_conserved(
    read: Callable[[], Awaitable[FleetStatus]], reads: int, gap_s: float
) -> FleetStatus:
    """Call ``read`` until its answer is conserved, at most ``reads`` times."""
    if reads < 1:
        raise ValueError(f"reads must be at least 1, not {reads}")
    n = 1
    status = await read()
    while not status.conserved and n < reads:
        await asyncio.sleep(gap_s)
        n += 1
        status = await read()
    status.reads = n
    return status


async def fleet_status(js: JetStreamContext, settings: Settings) -> FleetStatus:
    """Read the counts of every target from the streams and consumers.

    The reads are independent and run at once (at most ``READS_IN_FLIGHT`` per kind), so
    the moment they describe is short and the cost grows slowly with the targets.
    """
    declared = list(settings.targets)
    lanes = LaneMap(settings)
    dedicated = [t for t in declared if not lanes.is_shared(t)]
    # Groups only because asyncio.gather is typed for at most six awaitables; all start
    # at once (gather schedules its tasks when called).
    first = asyncio.gather(
        _per_target(js, subjects.STREAM_SUBMIT, "jf.submit.>"),
        _per_target(js, subjects.STREAM_WORK, "jf.work.>"),
        _per_target(js, subjects.STREAM_DUPLICATES, "jf.duplicates.>"),
        _per_target(js, subjects.STREAM_REJECTED, "jf.rejected.>"),
        _admitting(js),
        # Purged dead letters stay counted as dead, so purging cannot unbalance the totals.
        purged_counts(js, declared),
    )
    second = asyncio.gather(
        _each(declared, lambda t: count_messages(js, subjects.STREAM_RESULTS, subjects.results(t))),
        _each(declared, lambda t: count_messages(js, subjects.STREAM_DLQ, subjects.dlq(t))),
        _each(dedicated, lambda t: _leased(js, t)),
        _shared_leased(settings, [t for t in declared if lanes.is_shared(t)]),
        limiter_state(settings),
    )
    # The JetStream context's own connection: the server's clock judges timed pauses.
    third = asyncio.gather(read_quarantines(js), open_breakers(js), pauses_in_force(js._nc))
    (
        (submitted, in_work, duplicates, rejected, admitting, purged),
        (results, dead_letters, leased_by_consumers, shared_leased, limiter),
        (quarantines, breakers, pauses),
    ) = await asyncio.gather(first, second, third)
    committed = Counter(results) + duplicates
    dead = Counter(dead_letters) + Counter(purged)
    names = sorted(set(settings.targets) | set(submitted) | set(rejected))
    targets: dict[str, TargetCounts] = {}
    for name in names:
        if name in shared_leased:
            # A place outlives its job by the release round trip after the ack.
            leased = min(shared_leased[name], in_work[name])
        else:
            leased = leased_by_consumers.get(name, 0)
        targets[name] = TargetCounts(
            submitted=submitted[name],
            queued=max(0, in_work[name] - leased),
            leased=leased,
            committed=committed[name],
            dead=dead[name],
            rejected=rejected[name],
        )
    totals = TargetCounts()
    for counts in targets.values():
        totals.add(counts)
    placed = sum(getattr(totals, f) for f in FIELDS[1:])
    unaccounted = totals.submitted - placed - admitting
    return FleetStatus(
        totals=totals,
        targets=targets,
        admitting=admitting,
        unaccounted=unaccounted,
        conserved=unaccounted == 0,
        rate_limiter=limiter.health,
        rate_limiter_detail=limiter.detail,
        holds=limiter.holds,
        held=limiter.held,
        quarantines=quarantines.records,
        proposals=quarantines.proposals,
        second_order=quarantines.second_order,
        breakers=breakers,
        pauses=pauses,
    )


async def _per_target(js: JetStreamContext, stream: str, filter_: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    try:
        info = await js.stream_info(stream, subjects_filter=filter_)
    except NotFoundError:
        return counts
    for subject, n in (info.state.subjects or {}).items():
        counts[subjects.target_of(subject)] += n
    return counts


async def _each(
    targets: list[str], count: Callable[[str], Coroutine[Any, Any, int]]
) -> dict[str, int]:
    """``count(target)`` for each target, ``READS_IN_FLIGHT`` at a time."""
    limit = asyncio.Semaphore(READS_IN_FLIGHT)

    async def one(target: str) -> tuple[str, int]:
        async with limit:
            return target, await count(target)

    return dict(await asyncio.gather(*(one(t) for t in targets)))


async def _leased(js: JetStreamContext, target: str) -> int:
    leased = 0
    for tier in subjects.TIERS:
        try:
            info = await js.consumer_info(
                subjects.STREAM_WORK, subjects.work_consumer(target, tier)
            )
        except NotFoundError:
            continue
        leased += info.num_ack_pending or 0
    return leased


async def _shared_leased(settings: Settings, shared: list[str]) -> dict[str, int]:
    """Leased jobs of each partitioned target: its places under the in-flight cap (a
    shared consumer's unacked count cannot be split by target). Unknown while Redis is
    unreachable: then they count as queued, and the total still adds up."""
    if not shared:
        return {}
    places = TargetPlaces(settings)
    try:
        return await places.caps.counts(shared)
    except CapsUnavailable:
        return dict.fromkeys(shared, 0)
    finally:
        await places.close()


async def _admitting(js: JetStreamContext) -> int:
    try:
        info = await js.consumer_info(subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER)
    except NotFoundError:
        return 0
    return (info.num_pending or 0) + (info.num_ack_pending or 0)
