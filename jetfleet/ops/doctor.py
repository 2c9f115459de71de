"""``jetfleet doctor``: check the fleet's timeouts against the attempt durations it saw.

The doctor reads outcome events (``jf.outcome.<target>``, and ``jf.outcome.<target>.<job_id>``
from before, in ``JF_OUTCOMES``),
keeps the attempts that ran a handler to an end (kinds ``ok``, ``retryable`` and
``permanent``; ``blocked`` attempts are refusals by the target and are skipped), and
computes per target the count, p50, p95, p99 and max of their durations. It then checks
the settings that must fit those durations, showing the arithmetic of every rule:

* Lease TTL (jobs with heartbeats). A worker renews its lease and sends ``+WPI``
  (``msg.in_progress()``) every ``lease_ttl_s / 3``, so the TTL only has to outlive a
  renewal hiccup, never the job: ``lease_ttl_s >= 10 s``, and ``ack_wait_s >=
  lease_ttl_s + max(5 s, 0.5 x lease_ttl_s)`` so that JetStream redelivers a job only
  after its lease is long gone.
* Visibility timeout (jobs without heartbeats: a handler that blocks the event loop, so
  the worker can neither renew nor send ``+WPI``). Then ``ack_wait_s`` alone has to cover
  the job: ``ack_wait_s >= 3 x p95``; below the p99, slow jobs would be delivered twice.
* Target timeout. A p99 at or above 80 % of ``timeout_s`` means jobs are being cut off;
  so does a share of attempts ending with reason ``timeout``.

The read is bounded: the most recent ``limit`` outcome events (100,000 by default; a
worker's batch of ``ok`` events counts as the events it holds), and with ``since_s`` only
those stored in the last ``since_s`` seconds by the server's message timestamps. See
docs/doctor.md.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import FetchTimeoutError, NotFoundError

from jetfleet import durability, subjects
from jetfleet.outcome_events import (
    read_outcomes,
)
from jetfleet.schemas import Outcome
from jetfleet.settings import Settings

DEFAULT_LIMIT = 100_000
"""How many of the most recent outcome events are read at most."""
MIN_LEASE_TTL_S = 10.0
"""Below this, a short stall (GC pause, NATS leader change) outlives the lease."""
MIN_CLUSTER_LEASE_TTL_S = 30.0
"""The same on replicated streams (nats.replicas > 1): a lease bucket's leader election
took up to 12 s on a 3-node loopback cluster, and a 10 s TTL then let a second holder
run a job whose first holder had already sent its request (over-apply 1.01-1.03 in
tests/test_cluster_failover.py; 30 s gave 1.00 in every run, docs/cluster.md)."""


def min_lease_ttl_s(settings: Settings) -> float:
    """The shortest lease TTL the doctor accepts for ``settings``' NATS replicas."""
    return MIN_CLUSTER_LEASE_TTL_S if settings.nats.replicas > 1 else MIN_LEASE_TTL_S


ACK_WAIT_MARGIN_MIN_S = 5.0
ACK_WAIT_MARGIN_SHARE = 0.5
"""ack_wait_s >= lease_ttl_s + max(ACK_WAIT_MARGIN_MIN_S, ACK_WAIT_MARGIN_SHARE x ttl)."""
NO_HEARTBEAT_FACTOR = 3.0
"""ack_wait_s >= NO_HEARTBEAT_FACTOR x p95 for jobs without heartbeats."""
TIMEOUT_NEAR_SHARE = 0.8
"""Warn when p99 >= this share of the target's timeout_s."""
TIMEOUT_REASON_SHARE = 0.05
"""Warn when at least this share of a target's attempts ended with reason timeout."""
COUNTED_KINDS = frozenset({"ok", "retryable", "permanent"})
# A handler's own timeout, and the worker's stop of a handler past its budget.
TIMEOUT_REASONS = ("timeout", "handler-timeout")
NO_ATTEMPTS = "no attempts observed yet; run some jobs first"

_BATCH = 500
_SKIPS_LOGGED = 5  # one by one; beyond, a count (a flood must not flood the log too)
log = logging.getLogger(__name__)
_MAX_PROBES = 8

WarningCode = Literal[
    "lease-ttl-short",
    "ack-wait-close-to-lease",
    "ack-wait-not-above-lease",
    "ack-wait-below-p99",
    "timeout-near-p99",
    "timeouts-observed",
    # Durability (docs/cluster.md), checked by ``durability_warnings``.
    "replicas-below-3",
    "stream-replicas-below-3",
    "sync-not-always",
    "sync-unreadable",
]


class Attempt(msgspec.Struct, frozen=True):
    """One observed attempt: what the doctor keeps of an outcome event."""

    target: str
    duration_s: float
    timed_out: bool = False
    """The attempt ended with reason ``timeout`` or ``handler-timeout`` (also when that
    exhausted the attempts)."""


class DurationStats(msgspec.Struct, frozen=True, kw_only=True):
    """Observed attempt durations of one target, in seconds."""

    count: int
    p50_s: float
    p95_s: float
    p99_s: float
    max_s: float
    timeouts: int
    """Attempts that ended with reason ``timeout``."""


class Recommendation(msgspec.Struct, frozen=True, kw_only=True):
    """A setting, its current value, the least value the rule asks for, and why."""

    setting: str
    """The key in jetfleet.toml, such as ``fleet.ack_wait_s``."""
    applies_to: str
    """Which jobs the rule protects, such as ``jobs without heartbeats``."""
    current_s: float
    recommended_s: float
    """The least value the rule accepts (keep a larger current value)."""
    rule: str
    """The rule with its arithmetic, such as ``3 x p95 = 3 x 0.31 s = 0.93 s``."""
    ok: bool
    """The current value already meets the rule."""


class DoctorWarning(msgspec.Struct, frozen=True, kw_only=True):
    """Something to fix, with the numbers that show it."""

    code: WarningCode
    message: str
    target: str = ""
    """The target concerned; empty for a fleet-wide setting."""


class TargetReport(msgspec.Struct, frozen=True, kw_only=True):
    """What the doctor found for one target."""

    target: str
    stats: DurationStats
    recommendations: list[Recommendation]
    warnings: list[DoctorWarning]
    declared: bool = True
    """False when the target is not declared in the settings (its timeout is unknown)."""


class ReadSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What was read from JF_OUTCOMES, and with which bounds."""

    stream: str = subjects.STREAM_OUTCOMES
    filter_subject: str
    limit: int
    since_s: float | None = None
    events: int = 0
    """Outcome events read (after the bounds), including skipped ones."""
    attempts: int = 0
    """Events counted as attempts (kinds ok, retryable, permanent)."""
    skipped_blocked: int = 0
    skipped_undecodable: int = 0
    """Events ``read_outcomes`` refused: oversized, undecodable, not matching their
    subject's job and target, or with an impossible duration (each logged)."""
    limit_reached: bool = False
    """The ``limit`` bound was hit: older matching events may have been left out."""
    oldest: str = ""
    """Server timestamp of the oldest event read (ISO 8601, UTC)."""
    newest: str = ""


class FleetSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The fleet settings the rules were checked against."""

    ack_wait_s: float
    lease_ttl_s: float
    leases: bool


class DoctorReport(msgspec.Struct, frozen=True, kw_only=True):
    """The doctor's findings: per-target stats, recommendations and warnings."""

    read: ReadSummary
    fleet: FleetSnapshot
    recommendations: list[Recommendation]
    """Fleet-wide rules (lease TTL, ack_wait for jobs with heartbeats)."""
    warnings: list[DoctorWarning]
    """Fleet-wide warnings; each target's are in its report."""
    targets: list[TargetReport]
    message: str = ""
    """Set when there was nothing to check, e.g. ``no attempts observed yet; ...``."""
    notes: list[str] = msgspec.field(default_factory=list)
    """What was not checked and why, or (on ``jetfleet dev``'s own server) what would be
    a warning in production: no effect on the exit code."""

    def all_warnings(self) -> list[DoctorWarning]:
        """Fleet-wide warnings, then each target's, in target order."""
        return [*self.warnings, *(w for t in self.targets for w in t.warnings)]

    @property
    def exit_code(self) -> int:
        """0 when there is nothing to warn about (or nothing observed), else 1."""
        return 1 if self.all_warnings() else 0


# ----------------------------------------------------------------------------- arithmetic


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, interpolating linearly between closest ranks.

    This is the common "type 7" definition (numpy's default): the value at position
    ``(n - 1) x q / 100`` of the sorted values, interpolated between its neighbours.

    Args:
        sorted_values: the observations, sorted ascending; at least one.
        q: the percentile, 0 to 100.

    Returns:
        The percentile, in the unit of the values.

    Raises:
        ValueError: if there are no values or ``q`` is outside 0..100.
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def duration_stats(attempts: Iterable[Attempt]) -> DurationStats:
    """Count, p50, p95, p99 and max of the attempts' durations.

    Args:
        attempts: the attempts of one target; at least one.

    Returns:
        Their statistics.

    Raises:
        ValueError: if there are no attempts.
    """
    items = list(attempts)
    durations = sorted(a.duration_s for a in items)
    return DurationStats(
        count=len(durations),
        p50_s=percentile(durations, 50),
        p95_s=percentile(durations, 95),
        p99_s=percentile(durations, 99),
        max_s=durations[-1],
        timeouts=sum(a.timed_out for a in items),
    )


def lease_margin_s(lease_ttl_s: float) -> float:
    """How much longer than the lease TTL ack_wait_s should be: max(5 s, 0.5 x ttl)."""
    return max(ACK_WAIT_MARGIN_MIN_S, ACK_WAIT_MARGIN_SHARE * lease_ttl_s)


def fleet_rules(settings: Settings) -> tuple[list[Recommendation], list[DoctorWarning]]:
    """The fleet-wide rules for jobs with heartbeats (they need no observations).

    With ``fleet.leases = false`` there is no lease to size, so there are none.

    Args:
        settings: the fleet's settings (possibly built without validation).

    Returns:
        The recommendations for ``fleet.lease_ttl_s`` and ``fleet.ack_wait_s``, and the
        warnings for current values that break them.
    """
    fleet = settings.fleet
    if not fleet.leases:
        return [], []
    ttl, ack_wait = fleet.lease_ttl_s, fleet.ack_wait_s
    heartbeats = "jobs with heartbeats"
    least = min_lease_ttl_s(settings)
    why = "a GC pause" if least == MIN_LEASE_TTL_S else "a GC pause, a stream leader election"
    ttl_rec = max(ttl, least)
    margin = lease_margin_s(ttl_rec)
    ack_rec = ttl_rec + margin
    recommendations = [
        Recommendation(
            setting="fleet.lease_ttl_s",
            applies_to=heartbeats,
            current_s=ttl,
            recommended_s=ttl_rec,
            rule=f"renewed (with +WPI) every ttl/3, so the TTL covers renewal hiccups ({why}), "
            f"not the job: max(current {ttl:g} s, {least:g} s) = {ttl_rec:g} s",
            ok=ttl >= least,
        ),
        Recommendation(
            setting="fleet.ack_wait_s",
            applies_to=heartbeats,
            current_s=ack_wait,
            recommended_s=ack_rec,
            rule=f"lease_ttl_s + max({ACK_WAIT_MARGIN_MIN_S:g} s, "
            f"{ACK_WAIT_MARGIN_SHARE:g} x lease_ttl_s) = {ttl_rec:g} s + "
            f"max({ACK_WAIT_MARGIN_MIN_S:g} s, {ACK_WAIT_MARGIN_SHARE * ttl_rec:g} s) = "
            f"{ack_rec:g} s (with lease_ttl_s = {ttl_rec:g} s), so JetStream redelivers "
            f"only after a lease is long gone",
            ok=ack_wait >= ack_rec,
        ),
    ]
    warnings: list[DoctorWarning] = []
    if ttl < least:
        warnings.append(
            DoctorWarning(
                code="lease-ttl-short",
                message=f"fleet.lease_ttl_s = {ttl:g} s is below {least:g} s: "
                f"renewals go every {ttl / 3:.2f} s, and any stall longer than {ttl:g} s "
                f"({why}) loses the lease and restarts the job; set it to at least "
                f"{least:g} s",
            )
        )
    if ack_wait <= ttl:
        warnings.append(
            DoctorWarning(
                code="ack-wait-not-above-lease",
                message=f"fleet.ack_wait_s = {ack_wait:g} s is not above fleet.lease_ttl_s = "
                f"{ttl:g} s: JetStream may redeliver a job while its lease is still held "
                f"(settings validation refuses this; these settings skipped it)",
            )
        )
    else:
        needed = ttl + lease_margin_s(ttl)
        if ack_wait < needed:
            warnings.append(
                DoctorWarning(
                    code="ack-wait-close-to-lease",
                    message=f"fleet.ack_wait_s = {ack_wait:g} s is less than lease_ttl_s + "
                    f"max({ACK_WAIT_MARGIN_MIN_S:g} s, {ACK_WAIT_MARGIN_SHARE:g} x "
                    f"lease_ttl_s) = {ttl:g} s + {lease_margin_s(ttl):g} s = {needed:g} s: "
                    f"a lease that just expired may still be in use when JetStream "
                    f"redelivers; set fleet.ack_wait_s to at least {needed:g} s",
                )
            )
    return recommendations, warnings


def target_rules(target: str, attempts: Sequence[Attempt], settings: Settings) -> TargetReport:
    """Stats, recommendations and warnings of one target from its observed attempts.

    Args:
        target: the target's name.
        attempts: its observed attempts; at least one.
        settings: the fleet's settings; a target missing from them gets no timeout rule.

    Returns:
        The target's report.
    """
    stats = duration_stats(attempts)
    ack_wait = settings.fleet.ack_wait_s
    no_heartbeat_rec = NO_HEARTBEAT_FACTOR * stats.p95_s
    recommendations = [
        Recommendation(
            setting="fleet.ack_wait_s",
            applies_to="jobs without heartbeats (handler blocks the event loop)",
            current_s=ack_wait,
            recommended_s=_round_up(no_heartbeat_rec),
            rule=f"{NO_HEARTBEAT_FACTOR:g} x p95 = {NO_HEARTBEAT_FACTOR:g} x "
            f"{stats.p95_s:.3f} s = {no_heartbeat_rec:.3f} s",
            ok=ack_wait >= no_heartbeat_rec,
        )
    ]
    warnings: list[DoctorWarning] = []
    if ack_wait < stats.p99_s:
        longer = sum(a.duration_s > ack_wait for a in attempts)
        warnings.append(
            DoctorWarning(
                code="ack-wait-below-p99",
                target=target,
                message=f"fleet.ack_wait_s = {ack_wait:g} s is below the p99 of "
                f"{stats.p99_s:.3f} s: without heartbeats, slow jobs would be delivered "
                f"twice: {longer} of {stats.count} observed attempts "
                f"({100 * longer / stats.count:.1f} %) ran longer than ack_wait_s; set "
                f"fleet.ack_wait_s to at least {_round_up(no_heartbeat_rec):g} s "
                f"({NO_HEARTBEAT_FACTOR:g} x p95)",
            )
        )
    declared = target in settings.targets
    if declared:
        timeout = settings.targets[target].timeout_s
        timeout_rec = stats.p99_s / TIMEOUT_NEAR_SHARE
        recommendations.append(
            Recommendation(
                setting=f"targets.{target}.timeout_s",
                applies_to="every job of the target",
                current_s=timeout,
                recommended_s=_round_up(timeout_rec),
                rule=f"p99 / {TIMEOUT_NEAR_SHARE:g} = {stats.p99_s:.3f} s / "
                f"{TIMEOUT_NEAR_SHARE:g} = {timeout_rec:.3f} s (p99 below "
                f"{100 * TIMEOUT_NEAR_SHARE:g} % of the timeout)",
                ok=stats.p99_s < TIMEOUT_NEAR_SHARE * timeout,
            )
        )
        if stats.p99_s >= TIMEOUT_NEAR_SHARE * timeout:
            warnings.append(
                DoctorWarning(
                    code="timeout-near-p99",
                    target=target,
                    message=f"p99 = {stats.p99_s:.3f} s is {100 * stats.p99_s / timeout:.0f} %"
                    f" of targets.{target}.timeout_s = {timeout:g} s (warning at "
                    f">= {100 * TIMEOUT_NEAR_SHARE:g} %): jobs are being cut off; raise the "
                    f"timeout to at least {_round_up(timeout_rec):g} s or find why the "
                    f"target is slow",
                )
            )
    if stats.timeouts and stats.timeouts >= TIMEOUT_REASON_SHARE * stats.count:
        warnings.append(
            DoctorWarning(
                code="timeouts-observed",
                target=target,
                message=f"{stats.timeouts} of {stats.count} observed attempts "
                f"({100 * stats.timeouts / stats.count:.1f} %) ended with reason timeout "
                f"(warning at >= {100 * TIMEOUT_REASON_SHARE:g} %): the target does not "
                f"answer within its timeout_s",
            )
        )
    return TargetReport(
        target=target,
        stats=stats,
        recommendations=recommendations,
        warnings=warnings,
        declared=declared,
    )


def build_report(
    attempts: Iterable[Attempt], settings: Settings, read: ReadSummary
) -> DoctorReport:
    """Apply every rule to the observed attempts.

    Args:
        attempts: the observed attempts, any targets, any order.
        settings: the fleet's settings.
        read: what was read (copied into the report).

    Returns:
        The report; with no attempts it holds only ``message`` (nothing is checked).
    """
    fleet = FleetSnapshot(
        ack_wait_s=settings.fleet.ack_wait_s,
        lease_ttl_s=settings.fleet.lease_ttl_s,
        leases=settings.fleet.leases,
    )
    by_target: dict[str, list[Attempt]] = {}
    for attempt in attempts:
        by_target.setdefault(attempt.target, []).append(attempt)
    if not by_target:
        return DoctorReport(
            read=read, fleet=fleet, recommendations=[], warnings=[], targets=[], message=NO_ATTEMPTS
        )
    recommendations, warnings = fleet_rules(settings)
    targets = [target_rules(t, by_target[t], settings) for t in sorted(by_target)]
    return DoctorReport(
        read=read,
        fleet=fleet,
        recommendations=recommendations,
        warnings=warnings,
        targets=targets,
    )


def _round_up(seconds: float) -> float:
    """Round a recommended duration up to 0.1 s (1 s above 10 s), never below it."""
    step = 1.0 if seconds > 10 else 0.1
    return round(math.ceil(seconds / step - 1e-9) * step, 1)


def attempt_of(event: Outcome) -> Attempt | None:
    """The attempt an outcome event records, or None for a ``blocked`` one.

    An attempt that timed out on its last try is published as ``permanent`` with reason
    ``attempts-exhausted`` and detail ``last: timeout ...``; it counts as a timeout too.
    """
    if event.kind not in COUNTED_KINDS:
        return None
    timed_out = event.reason in TIMEOUT_REASONS or (
        event.reason == "attempts-exhausted"
        and any(event.detail.startswith(f"last: {r}") for r in TIMEOUT_REASONS)
    )
    return Attempt(target=event.target, duration_s=event.duration_s, timed_out=timed_out)


# ---------------------------------------------------------------------------------- reading


def outcome_filters(target: str | None) -> list[str]:
    """The JF_OUTCOMES filters for one target's events (per-target subject, and the
    per-job ones of events from before it), or every target's."""
    return subjects.outcome_filters(target) if target else [f"{subjects.PREFIX}.outcome.>"]


async def read_attempts(
    js: JetStreamContext,
    target: str | None = None,
    since_s: float | None = None,
    limit: int = DEFAULT_LIMIT,
    now: datetime.datetime | None = None,
) -> tuple[list[Attempt], ReadSummary]:
    """Read the most recent outcome events and keep the attempts among them.

    Only events stored now are read (a live fleet keeps publishing; those are left for the
    next run). The bound is the most recent ``limit`` events matching the filter and, with
    ``since_s``, those whose server timestamp is within the last ``since_s`` seconds.

    Args:
        js: a JetStream context.
        target: one target, or None for all.
        since_s: only events of the last this many seconds; None for no time bound.
        limit: at most this many of the most recent events.
        now: the time ``since_s`` counts back from (default: the current time, UTC).

    Returns:
        The attempts (blocked events skipped), and a summary of the read.

    Raises:
        ValueError: if ``limit`` < 1 or ``since_s`` <= 0.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if since_s is not None and since_s <= 0:
        raise ValueError(f"since must be > 0 seconds, got {since_s:g}")
    filters = outcome_filters(target)
    summary = ReadSummary(filter_subject=" ".join(filters), limit=limit, since_s=since_s)
    cutoff = None
    if since_s is not None:
        cutoff = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(seconds=since_s)
    reader = _BoundedReader(js, filters, limit, cutoff)
    read = await reader.read()
    attempts: list[Attempt] = []
    counts: Counter[str] = Counter()
    for data in read:
        event = data.event
        if isinstance(event, str):
            counts["undecodable"] += 1
            if counts["undecodable"] <= _SKIPS_LOGGED:
                log.warning("skipped outcome event %d on %s: %s", data.seq, data.subject, event)
            continue
        attempt = attempt_of(event)
        if attempt is None:
            counts["blocked"] += 1
        else:
            attempts.append(attempt)
    if counts["undecodable"] > _SKIPS_LOGGED:
        log.warning("skipped %d outcome events in all", counts["undecodable"])
    summary = msgspec.structs.replace(
        summary,
        events=len(read),
        attempts=len(attempts),
        skipped_blocked=counts["blocked"],
        skipped_undecodable=counts["undecodable"],
        limit_reached=reader.limit_reached,
        oldest=read[0].timestamp.isoformat() if read else "",
        newest=read[-1].timestamp.isoformat() if read else "",
    )
    return attempts, summary


async def diagnose(
    js: JetStreamContext,
    settings: Settings,
    target: str | None = None,
    since_s: float | None = None,
    limit: int = DEFAULT_LIMIT,
    now: datetime.datetime | None = None,
) -> DoctorReport:
    """Read the observed attempts and check the settings against them.

    Args:
        js: a JetStream context.
        settings: the settings to check (need not have been validated).
        target: one target, or None for all.
        since_s: only events of the last this many seconds.
        limit: at most this many of the most recent events.
        now: the time ``since_s`` counts back from (default: the current time).

    Returns:
        The report.
    """
    attempts, read = await read_attempts(js, target, since_s, limit, now)
    return build_report(attempts, settings, read)


async def durability_warnings(
    js: JetStreamContext, settings: Settings
) -> tuple[list[DoctorWarning], list[str]]:
    """Replicas (the setting and the live streams and buckets) and each server's sync
    (through ``nats.monitor_url``) against docs/cluster.md: warnings, and notes.

    On ``jetfleet dev``'s embedded server (``nats.dev``) the findings are one note, not
    warnings: it is single-node by design.
    """
    findings = durability.replica_findings(settings)
    if not findings:
        # Declared R3, but a bucket made before keeps its replicas (docs/topology.md).
        findings += await durability.live_replica_findings(js)
    urls = durability.monitor_urls(settings)
    notes = []
    if urls:
        findings += durability.sync_findings(await durability.read_sync(urls))
    else:
        notes.append(
            "sync_interval not checked: no client API tells it; list each server's "
            "monitoring endpoint in nats.monitor_url (http://nats-1:8222,...) to check it "
            f"({durability.DOCS})"
        )
    if settings.nats.dev:
        line = durability.start_line(findings, bool(urls), dev=True)
        return [], [line, *notes] if line else notes
    return [DoctorWarning(code=f.code, message=f.message) for f in findings], notes


class _Event(msgspec.Struct, frozen=True):
    """One event read (an event of a batch shares its message's sequence and time)."""

    seq: int
    subject: str
    timestamp: datetime.datetime
    event: Outcome | str
    """The event, or why ``read_outcomes`` skipped it."""


class _BoundedReader:
    """Reads the most recent matching messages of JF_OUTCOMES that hold ``limit`` events
    (and only those after ``cutoff``) through short-lived ephemeral consumers, without a
    full scan; ``read_attempts`` keeps the newest ``limit`` events of them.

    A consumer's ``num_pending`` at creation counts the matching messages from its start.
    With a time bound, a consumer starting at ``cutoff`` is used when it has at most
    ``limit`` messages. Otherwise the start sequence is searched backwards from the end
    of the stream, widening the window by the density of matching messages seen, until
    it holds at least ``limit`` of them (or reaches the first message); the read then
    keeps the last ``limit``.
    """

    def __init__(
        self,
        js: JetStreamContext,
        filters: list[str],
        limit: int,
        cutoff: datetime.datetime | None,
    ) -> None:
        self.js = js
        self.filters = filters
        self.limit = limit
        self.cutoff = cutoff
        self.limit_reached = False

    async def read(self) -> list[_Event]:
        """The bounded events, oldest first; empty when the stream is missing or empty."""
        try:
            info = await self.js.stream_info(subjects.STREAM_OUTCOMES)
        except NotFoundError:
            return []
        if info.state.messages == 0:
            return []
        first, last = info.state.first_seq, info.state.last_seq
        opened = None
        if self.cutoff is not None:
            name, pending = await self._open(start_time=self.cutoff)
            if pending <= self.limit:
                opened = name, pending
            else:
                await self._close(name)
        if opened is None:
            opened = await self._search(first, last)
            if self.cutoff is not None:
                self.limit_reached = True  # the window held more than limit events
        return await self._drain(*opened)

    async def _search(self, first: int, last: int) -> tuple[str, int]:
        """Open a consumer from a start sequence with >= limit matching messages after it
        (or from ``first``); returns its name and pending count."""
        window = self.limit
        for _ in range(_MAX_PROBES):
            start = max(first, last - window + 1)
            name, pending = await self._open(start_seq=start)
            if pending >= self.limit or start == first:
                self.limit_reached = pending > self.limit or (
                    start > first and pending == self.limit
                )
                return name, pending
            await self._close(name)
            # Widen by the density seen: limit matching messages need about
            # window x limit / pending stream messages (at least double it).
            factor = max(2.0, 1.25 * self.limit / max(pending, 1))
            window = math.ceil(window * factor)
        name, pending = await self._open(start_seq=first)
        self.limit_reached = pending > self.limit
        return name, pending

    async def _open(
        self, start_seq: int | None = None, start_time: datetime.datetime | None = None
    ) -> tuple[str, int]:
        name = f"jf-doctor-{uuid.uuid4().hex[:16]}"
        config = js_api.ConsumerConfig(
            name=name,
            filter_subject=self.filters[0] if len(self.filters) == 1 else None,
            filter_subjects=self.filters if len(self.filters) > 1 else None,
            ack_policy=js_api.AckPolicy.NONE,
            deliver_policy=js_api.DeliverPolicy.BY_START_TIME
            if start_time is not None
            else js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            opt_start_time=start_time,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        info = await self.js.add_consumer(subjects.STREAM_OUTCOMES, config)
        return name, info.num_pending or 0

    async def _close(self, name: str) -> None:
        with contextlib.suppress(NotFoundError):  # already gone (inactive_threshold)
            await self.js.delete_consumer(subjects.STREAM_OUTCOMES, name)

    async def _drain(self, name: str, pending: int) -> list[_Event]:
        # The newest `limit` events, each message read as it comes (a batch is the
        # events it holds, decoded: never its header's word, never its bytes kept).
        kept: deque[_Event] = deque()
        remaining = pending
        sub = await self.js.pull_subscribe_bind(consumer=name, stream=subjects.STREAM_OUTCOMES)
        try:
            while remaining > 0:
                try:
                    msgs = await sub.fetch(min(_BATCH, remaining), timeout=2.0)
                except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
                    break  # the rest expired while we read
                for msg in msgs:
                    meta = msg.metadata
                    remaining = min(remaining - 1, meta.num_pending)
                    if self.cutoff is None or meta.timestamp >= self.cutoff:
                        kept.extend(_read_events(msg))
                        while len(kept) > self.limit:
                            kept.popleft()
                            self.limit_reached = True
        finally:
            await sub.unsubscribe()
            await self._close(name)
        return list(kept)


def _read_events(msg: Msg) -> list[_Event]:
    # Up to `limit` events are held at once, decoded: each at most MAX_OUTCOME_BYTES (as
    # read_outcomes bounds them), or the reason it was skipped.
    meta = msg.metadata
    return [
        _Event(meta.sequence.stream, msg.subject, meta.timestamp, event)
        for event in read_outcomes(msg.subject, msg.data, msg.headers)
    ]
