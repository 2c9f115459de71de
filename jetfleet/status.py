"""Fleet status computed from durable state (streams, consumers), never from counters a
service keeps in memory, so any process can answer and a restart changes nothing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import msgspec
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.dead_letters import purged_counts
from jetfleet.inflight_caps import CapsUnavailable, InFlightCaps
from jetfleet.settings import Settings
from jetfleet.work_lanes import LaneMap

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


async def fleet_status(js: JetStreamContext, settings: Settings) -> FleetStatus:
    """Read the counts of every target from the streams and consumers."""
    submitted = await _per_target(js, subjects.STREAM_SUBMIT, "jf.submit.>")
    in_work = await _per_target(js, subjects.STREAM_WORK, "jf.work.>")
    committed = await _count_each(js, subjects.STREAM_RESULTS, subjects.results, settings)
    committed.update(await _per_target(js, subjects.STREAM_DUPLICATES, "jf.duplicates.>"))
    dead = Counter(
        {
            t: await count_messages(js, subjects.STREAM_DLQ, subjects.dlq(t))
            for t in settings.targets
        }
    )
    # Purged dead letters stay counted as dead, so purging cannot unbalance the totals.
    dead.update(await purged_counts(js, list(settings.targets)))
    rejected = await _per_target(js, subjects.STREAM_REJECTED, "jf.rejected.>")
    names = sorted(set(settings.targets) | set(submitted) | set(rejected))
    lanes = LaneMap(settings)
    shared_leased = await _shared_leased(settings, lanes)
    targets: dict[str, TargetCounts] = {}
    for name in names:
        if name in shared_leased:
            # A place outlives its job by the release round trip after the ack.
            leased = min(shared_leased[name], in_work[name])
        else:
            leased = await _leased(js, name) if name in settings.targets else 0
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
    admitting = await _admitting(js)
    placed = sum(getattr(totals, f) for f in FIELDS[1:])
    unaccounted = totals.submitted - placed - admitting
    return FleetStatus(
        totals=totals,
        targets=targets,
        admitting=admitting,
        unaccounted=unaccounted,
        conserved=unaccounted == 0,
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


async def _count_each(
    js: JetStreamContext, stream: str, filter_of: Callable[[str], str], settings: Settings
) -> Counter[str]:
    """Per declared target, how many messages match ``filter_of(target)``."""
    return Counter({t: await count_messages(js, stream, filter_of(t)) for t in settings.targets})


async def count_messages(js: JetStreamContext, stream: str, filter_: str) -> int:
    """How many messages of ``stream`` match ``filter_``, without listing subjects.

    Results are one subject per key, so the per-subject map of ``stream_info`` would grow
    with every job; an ephemeral consumer's pending count costs the same for any size.
    """
    config = js_api.ConsumerConfig(
        ack_policy=js_api.AckPolicy.NONE,
        deliver_policy=js_api.DeliverPolicy.ALL,
        filter_subject=filter_,
        inactive_threshold=5.0,
        mem_storage=True,
    )
    try:
        info = await js.add_consumer(stream, config)
    except NotFoundError:
        return 0
    try:
        return info.num_pending or 0
    finally:
        await js.delete_consumer(stream, info.name)


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


async def _shared_leased(settings: Settings, lanes: LaneMap) -> dict[str, int]:
    """Leased jobs of each partitioned target: its places under the in-flight cap (a
    shared consumer's unacked count cannot be split by target). Unknown while Redis is
    unreachable: then they count as queued, and the total still adds up."""
    shared = [t for lane in lanes.lanes if lane.shared for t in lane.targets]
    if not shared:
        return {}
    caps = InFlightCaps.connect(settings.redis.url)
    try:
        return {t: await caps.count(t) for t in shared}
    except CapsUnavailable:
        return dict.fromkeys(shared, 0)
    finally:
        await caps.close()


async def _admitting(js: JetStreamContext) -> int:
    try:
        info = await js.consumer_info(subjects.STREAM_SUBMIT, subjects.CONSUMER_SCHEDULER)
    except NotFoundError:
        return 0
    return (info.num_pending or 0) + (info.num_ack_pending or 0)
