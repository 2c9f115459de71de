"""The JetStream topology, declared in one place and created idempotently.

Creating is safe to repeat from every replica. An existing stream or consumer whose
settings differ from these is never changed silently (nats-py's ``add_consumer`` is
create-OR-update): the difference is logged and returned, and only ``update=True``
(``jetfleet topology apply``) changes it. See docs/topology.md for every setting and why.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.client import KV_STREAM_TEMPLATE
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from jetfleet import subjects
from jetfleet.pause_book import consumer_pauses, read_pauses, rfc3339
from jetfleet.settings import Settings
from jetfleet.work_lanes import LaneMap, WorkLane

log = logging.getLogger(__name__)

# Publish retries that reuse a Nats-Msg-Id inside this window cannot duplicate a message.
MIN_DUPLICATE_WINDOW_S = 120.0


@dataclass(frozen=True)
class Drift:
    """One setting of a live stream or consumer that differs from the declared one."""

    what: str
    field: str
    live: object
    declared: object

    def __str__(self) -> str:
        return f"{self.what}: {self.field} is {self.live!r}, declared {self.declared!r}"


def results_max_age(settings: Settings) -> float:
    """How long results are kept: at least the dedupe TTL, as the result is the key
    (docs/commit.md); objects a result refers to are kept exactly as long."""
    return max(settings.fleet.retention_s, settings.fleet.dedupe_ttl_s)


def stream_configs(settings: Settings) -> list[js_api.StreamConfig]:
    """Every stream jetfleet uses, configured from ``settings``."""
    fleet = settings.fleet
    window = max(MIN_DUPLICATE_WINDOW_S, 2 * fleet.ack_wait_s)

    def stream(
        name: str, subject: str, retention: js_api.RetentionPolicy, max_age: float
    ) -> js_api.StreamConfig:
        return js_api.StreamConfig(
            name=name,
            subjects=[subject],
            retention=retention,
            storage=js_api.StorageType.FILE,
            num_replicas=settings.nats.replicas,
            max_age=max_age,
            duplicate_window=window,
            allow_direct=True,
        )

    limits, work_queue = js_api.RetentionPolicy.LIMITS, js_api.RetentionPolicy.WORK_QUEUE
    keep = fleet.retention_s
    return [
        stream(subjects.STREAM_SUBMIT, "jf.submit.>", limits, keep),
        # WorkQueue: a message is gone once acked or terminated; one consumer per target.
        stream(subjects.STREAM_WORK, "jf.work.>", work_queue, 0),
        # One subject per idempotency key: the result record is the key (docs/commit.md),
        # so it is kept at least as long as the dedupe TTL.
        stream(subjects.STREAM_RESULTS, "jf.results.>", limits, results_max_age(settings)),
        stream(subjects.STREAM_DUPLICATES, "jf.duplicates.>", limits, keep),
        stream(subjects.STREAM_DLQ, "jf.dlq.>", limits, keep),
        stream(subjects.STREAM_REJECTED, "jf.rejected.>", limits, keep),
        stream(subjects.STREAM_OUTCOMES, "jf.outcome.>", limits, keep),
        # Few and small: every breaker opening and closing, kept for operators to read.
        stream(subjects.STREAM_ALERTS, "jf.alert.>", limits, keep),
        # WorkQueue: an advisory is gone once the sink has ended its job.
        stream(
            subjects.STREAM_ADVISORIES,
            subjects.max_deliveries_advisories(subjects.STREAM_WORK),
            work_queue,
            0,
        ),
        # Limits, kept fleet.audit_max_age_s (a year by default): an audit log is read
        # back months later, and is never consumed away.
        stream(subjects.STREAM_AUDIT, f"{subjects.AUDIT}.>", limits, fleet.audit_max_age_s),
    ]


SCHEDULER_ACK_WAIT_S = 30.0
"""The ``scheduler`` consumer's ack wait: a submission not acked (or nakked) by then is
delivered again, to any replica."""


def consumer_configs(settings: Settings) -> list[tuple[str, js_api.ConsumerConfig]]:
    """Every durable consumer, as (stream, config)."""
    configs = [
        (
            subjects.STREAM_SUBMIT,
            js_api.ConsumerConfig(
                durable_name=subjects.CONSUMER_SCHEDULER,
                ack_policy=js_api.AckPolicy.EXPLICIT,
                ack_wait=SCHEDULER_ACK_WAIT_S,
                max_ack_pending=2000,
                deliver_policy=js_api.DeliverPolicy.ALL,
            ),
        ),
        (
            subjects.STREAM_ADVISORIES,
            js_api.ConsumerConfig(
                durable_name=subjects.CONSUMER_MAX_DELIVERIES,
                ack_policy=js_api.AckPolicy.EXPLICIT,
                ack_wait=30.0,
                max_ack_pending=100,
                deliver_policy=js_api.DeliverPolicy.ALL,
            ),
        ),
    ]
    for lane in LaneMap(settings).lanes:
        for tier in subjects.TIERS:
            configs.append((subjects.STREAM_WORK, _work_consumer(settings, lane, tier)))
    return configs


def _work_consumer(settings: Settings, lane: WorkLane, tier: str) -> js_api.ConsumerConfig:
    filters = lane.filters(tier)
    return js_api.ConsumerConfig(
        durable_name=lane.consumer(tier),
        # A lane of its own keeps the single filter (as consumers made before partitions
        # have it); a partition lists one subject per member target.
        filter_subject=None if lane.shared else filters[0],
        filter_subjects=filters if lane.shared else None,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        ack_wait=settings.fleet.ack_wait_s,
        # Attempts are counted in code; max_deliver is only the backstop for jobs that
        # never end (pinned to nobody, handed back for ever): the sink dead-letters them
        # from the server's advisory (services/sink/exhausted.py). No BackOff (see
        # docs/topology.md).
        max_deliver=settings.fleet.max_deliver,
        # Per tier: a target's three tiers together may hold up to 3x this. A partition
        # may hold the sum of its members' caps; the leaser caps each member.
        max_ack_pending=lane.max_in_flight,
        deliver_policy=js_api.DeliverPolicy.ALL,
    )


def bucket_ttls(settings: Settings) -> dict[str, float]:
    """Each KV bucket and the age after which its entries (and delete markers) go.

    Leases carry their own per-key TTL; the bucket's only clears release markers. A
    job's history (its id claim, fences and seal) must outlive any retry of its job and
    everything else kept under its id (its dead letter and outcome events, kept for
    ``retention_s``), since admission refuses the id only while it lives. Control
    records last until removed. Identity claims and hand-back notes expire by
    their own TTL.
    """
    fleet = settings.fleet
    return {
        subjects.BUCKET_LEASES: max(3600.0, 10 * fleet.ack_wait_s),
        subjects.BUCKET_FENCES: max(fleet.dedupe_ttl_s, fleet.retention_s),
        subjects.BUCKET_CONTROL: 0.0,
        # Keys carry their own short TTL (jetfleet/identity_presence.py).
        subjects.BUCKET_WORKERS: 3600.0,
        subjects.BUCKET_TARGETS: 0.0,
        # The bucket's max age is the robots.txt cache's expiry.
        subjects.BUCKET_ROBOTS: fleet.robots_ttl_s,
    }


_STREAM_FIELDS = ("subjects", "retention", "max_age", "duplicate_window", "num_replicas")
_CONSUMER_FIELDS = (
    "filter_subject",
    "filter_subjects",
    "ack_wait",
    "max_deliver",
    "max_ack_pending",
    "backoff",
)


async def declare(js: JetStreamContext, settings: Settings, update: bool = False) -> list[Drift]:
    """Create every stream, consumer and KV bucket that is missing.

    Args:
        js: a JetStream context.
        settings: the fleet's settings.
        update: also change existing ones whose settings drifted.

    Returns:
        The drifts found (already applied when ``update`` is true).
    """
    drifts: list[Drift] = []
    for stream_config in stream_configs(settings):
        drifts += await _ensure_stream(js, stream_config, update)
    for bucket, ttl in bucket_ttls(settings).items():
        drifts += await _ensure_bucket(js, bucket, ttl, settings, update)
    drifts += await _ensure_object_store(js, settings, update)
    await _remove_pre_tier_consumers(js, settings)
    # A work consumer made (or updated) while a fleet or target pause covers it is
    # paused from birth until the pause's end (docs/pause.md).
    held = consumer_pauses(settings, await read_pauses(js))
    configs = [(stream, _paused(config, held)) for stream, config in consumer_configs(settings)]
    work = [c for s, c in configs if s == subjects.STREAM_WORK]
    lane_drifts, held_back = await _follow_lane_changes(js, work, apply=update)
    drifts += lane_drifts
    for stream, config in configs:
        if config.durable_name in held_back:
            continue
        drifts += await _ensure_consumer(js, stream, config, update)
    for drift in drifts:
        log.warning("topology drift %s%s", drift, " (updated)" if update else "")
    return drifts


def _paused(
    config: js_api.ConsumerConfig, held: dict[str, datetime.datetime]
) -> js_api.ConsumerConfig:
    until = held.get(config.durable_name or "")
    if until is None:
        return config
    return dataclasses.replace(config, pause_until=rfc3339(until))


async def _remove_pre_tier_consumers(js: JetStreamContext, settings: Settings) -> None:
    """Remove the one-per-target work consumers of jetfleet before priority tiers.

    Their filter overlaps the per-tier consumers', which a WorkQueue stream refuses, so
    an old data folder would stop every service at start. Their unacked messages stay in
    the stream and are delivered again through the tier consumers.
    """
    # A target named like another's tier consumer ("shop-high" beside "shop") must not
    # take that live consumer with it.
    current = {lane.consumer(tier) for lane in LaneMap(settings).lanes for tier in subjects.TIERS}
    for name in settings.targets:
        old = f"work-{name}"
        if old in current:
            continue
        try:
            await js.delete_consumer(subjects.STREAM_WORK, old)
        except NotFoundError:
            continue
        log.warning(
            "removed pre-tier consumer %s/%s; its jobs go to the tier consumers",
            subjects.STREAM_WORK,
            old,
        )


def _filter_set(config: js_api.ConsumerConfig) -> frozenset[str]:
    if config.filter_subjects:
        return frozenset(config.filter_subjects)
    return frozenset([config.filter_subject] if config.filter_subject else [])


async def _live_consumers(js: JetStreamContext, stream: str) -> list[js_api.ConsumerInfo]:
    found: list[js_api.ConsumerInfo] = []
    while True:
        page = await js.consumers_info(stream, offset=len(found))
        found += page
        if not page:
            return found


async def _follow_lane_changes(
    js: JetStreamContext, declared: list[js_api.ConsumerConfig], apply: bool
) -> tuple[list[Drift], set[str]]:
    """Find (and with ``apply``, make room for) targets that moved between lanes.

    A WorkQueue stream refuses two consumers that take the same subject, so a live work
    consumer that takes a subject now declared for another lane must go (a target that
    became partitioned, or a partition whose members changed). A lane whose members
    changed is deleted and made again rather than updated: a consumer whose filters are
    widened does not go back for the older messages of the new subject, which would be
    stranded. Jobs held through a deleted consumer are delivered again through the new
    one; their leases keep them from running twice (docs/topology.md).

    Without ``apply`` nothing changes: each such consumer is a drift, and the declared
    consumers that would clash with it are not created (``jetfleet topology apply``
    moves the lanes). Returns the drifts and the declared consumers left alone.
    """
    wanted = {str(c.durable_name): _filter_set(c) for c in declared}
    claimed = {subject: name for name, subs in wanted.items() for subject in subs}
    drifts: list[Drift] = []
    held_back: set[str] = set()
    for info in await _live_consumers(js, subjects.STREAM_WORK):
        name = info.name
        live = _filter_set(info.config)
        if name in wanted and live == wanted[name]:
            continue
        clashes = {claimed[s] for s in live if claimed.get(s, name) != name}
        if name not in wanted and not clashes:
            continue  # a lane of targets no longer declared: left alone (docs/topology.md)
        declared_filters = sorted(wanted[name]) if name in wanted else "(none: removed)"
        drifts.append(
            Drift(
                f"consumer {subjects.STREAM_WORK}/{name}",
                "filter_subjects",
                sorted(live),
                declared_filters,
            )
        )
        if apply:
            await js.delete_consumer(subjects.STREAM_WORK, name)
        else:
            held_back |= clashes | ({name} if name in wanted else set())
    if drifts and not apply:
        log.warning(
            "targets moved between work lanes; their consumers are unchanged and %d "
            "declared consumer(s) are not made until `jetfleet topology apply` moves them "
            "(jobs wait in %s meanwhile)",
            len(held_back),
            subjects.STREAM_WORK,
        )
    return drifts, held_back


async def _ensure_stream(
    js: JetStreamContext, config: js_api.StreamConfig, update: bool
) -> list[Drift]:
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
        return []
    drifts = _diff(f"stream {config.name}", info.config, config, _STREAM_FIELDS)
    if drifts and update:
        await js.update_stream(config)
    return drifts


async def _ensure_consumer(
    js: JetStreamContext, stream: str, config: js_api.ConsumerConfig, update: bool
) -> list[Drift]:
    assert config.durable_name is not None
    try:
        info = await js.consumer_info(stream, config.durable_name)
    except NotFoundError:
        await js.add_consumer(stream, config)
        return []
    drifts = _diff(
        f"consumer {stream}/{config.durable_name}", info.config, config, _CONSUMER_FIELDS
    )
    if drifts and update:
        await js.add_consumer(stream, config)
    return drifts


async def _ensure_bucket(
    js: JetStreamContext, bucket: str, ttl_s: float, settings: Settings, update: bool
) -> list[Drift]:
    stream = KV_STREAM_TEMPLATE.format(bucket=bucket)
    try:
        await js.key_value(bucket)
    except BucketNotFoundError:
        await js.create_key_value(
            bucket=bucket,
            history=1,
            ttl=ttl_s or None,
            storage=js_api.StorageType.FILE,
            replicas=settings.nats.replicas,
            direct=True,
        )
        await _refuse_rollups(js, stream, update=True)
        return []
    return await _refuse_rollups(js, stream, update)


async def _ensure_object_store(
    js: JetStreamContext, settings: Settings, update: bool
) -> list[Drift]:
    stream = OBJ_STREAM_TEMPLATE.format(bucket=subjects.OBJECTS_RESULTS)
    try:
        await js.object_store(subjects.OBJECTS_RESULTS)
    except BucketNotFoundError:
        await js.create_object_store(
            subjects.OBJECTS_RESULTS,
            config=js_api.ObjectStoreConfig(
                ttl=results_max_age(settings),
                storage=js_api.StorageType.FILE,
                replicas=settings.nats.replicas,
            ),
        )
        await _refuse_rollups(js, stream, update=True)
        return []
    return await _refuse_rollups(js, stream, update)


async def _refuse_rollups(js: JetStreamContext, stream: str, update: bool) -> list[Drift]:
    """Turn off ``allow_rollup_hdrs`` on a bucket's or object store's backing stream.

    nats-py makes both with rollups allowed (its ``kv.purge`` and object ``put`` use
    them), and nats-server grants publishes by subject, not header: a role allowed one
    key or chunk subject could send ``Nats-Rollup: all`` there and empty the whole
    bucket. jetfleet never rolls up (it deletes keys, and writes objects without
    purging, jetfleet/worker/result_objects.py), so the server may refuse every rollup
    (docs/security.md). A fresh bucket is changed at once; an older one is a drift
    that ``jetfleet topology apply`` fixes.
    """
    config = (await js.stream_info(stream)).config
    if not config.allow_rollup_hdrs:
        return []
    if update:
        await js.update_stream(dataclasses.replace(config, allow_rollup_hdrs=False))
    return [Drift(f"stream {stream}", "allow_rollup_hdrs", True, False)]


def _diff(what: str, live: object, declared: object, fields: tuple[str, ...]) -> list[Drift]:
    drifts = []
    for field in fields:
        want, have = getattr(declared, field), getattr(live, field)
        if _normalise(want) != _normalise(have):
            drifts.append(Drift(what, field, have, want))
    return drifts


def _normalise(value: object) -> object:
    # The server reports unset limits as 0/-1/None interchangeably, and floats of seconds.
    if value in (None, 0, -1, 0.0, []):
        return None
    if isinstance(value, float):
        return round(value, 3)
    return value
