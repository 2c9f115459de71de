"""The fleet status as Prometheus gauges, through the gateway's own OpenTelemetry meters.

Every value is read from JetStream (and the limiter's Redis) at scrape time, so any
gateway replica gives the same answer and a restart resets nothing. Totals are left to
PromQL (``sum``); a ``target="total"`` series would double-count in every aggregation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from jetfleet.metrics import OTHER, GaugeFamily, ServiceMeters
from jetfleet.ops.status import FIELDS, FleetStatus, TargetCounts

CONTENT_TYPE = METRICS_CONTENT_TYPE
MAX_UNDECLARED = 100
"""Undeclared targets (names anyone can submit to, refused) shown one by one at most;
the counts of the rest are summed under ``target="_other"``."""

QueueDepths = Counter[tuple[str, str]]
"""Messages in the work stream by (target, tier): queued or leased, not yet acked."""


class FleetGauges:
    """The gauges one gateway serves, set afresh from each scrape's read."""

    def __init__(self, declared: Collection[str]) -> None:
        self.declared = declared
        self.jobs = GaugeFamily(
            "jetfleet_jobs",
            "Jobs per target and state, read from JetStream at scrape time.",
            max_series=(len(declared) + MAX_UNDECLARED + 1) * len(FIELDS),
        )
        self.admitting = GaugeFamily(
            "jetfleet_admitting", "Submissions the scheduler has not decided yet."
        )
        self.unaccounted = GaugeFamily(
            "jetfleet_unaccounted_jobs",
            "Conservation mismatch: submitted minus every state (queued, leased, committed, "
            "dead, rejected) minus admitting. Non-zero for a moment while a job moves; a "
            "lasting value means a job went missing or was counted twice.",
        )
        self.queue = GaugeFamily(
            "jetfleet_queue_messages",
            "Messages in the work stream per target and tier (queued or leased, not yet acked).",
        )
        self.limiter_ok = GaugeFamily(
            "jetfleet_ratelimit_ok",
            "1 when the rate limiter's Redis answers; 0 while it fails closed (no permits, "
            "nothing sent).",
        )
        self.held = GaugeFamily("jetfleet_targets_held", "Targets held fleet-wide now.")
        self.hold_seconds = GaugeFamily(
            "jetfleet_target_hold_seconds",
            "Seconds left of a target's fleet-wide hold (the longest holds only, as "
            "jetfleet status lists them).",
        )
        self.breakers = GaugeFamily(
            "jetfleet_breaker_open",
            "1 for each target whose circuit breaker is open, probing or half-open (by "
            "state), with opens the times it opened in a row.",
        )
        self.quarantines = GaugeFamily(
            "jetfleet_quarantines_in_force", "Quarantine records in force (every scope)."
        )
        self.second_order = GaugeFamily(
            "jetfleet_second_order_in_force",
            "Retirements in force that followed a neighbour's on the same subnet and target.",
        )
        self.families = (
            self.jobs,
            self.admitting,
            self.unaccounted,
            self.queue,
            self.limiter_ok,
            self.held,
            self.hold_seconds,
            self.breakers,
            self.quarantines,
            self.second_order,
        )
        self.meters = ServiceMeters("gateway", self.families)

    def update(self, status: FleetStatus, queue: QueueDepths) -> None:
        """Replace every series with what ``status`` and ``queue`` say."""
        for family in self.families:
            family.clear()
        for name, counts in _bounded(status.targets, self.declared):
            for state in FIELDS:
                self.jobs.set(getattr(counts, state), target=name, state=state)
        for (target, tier), n in queue.items():
            self.queue.set(n, target=target, tier=tier)
        self.admitting.set(status.admitting)
        self.unaccounted.set(status.unaccounted)
        self.limiter_ok.set(1 if status.rate_limiter == "ok" else 0)
        # Holds listed by the status only (at most MAX_HOLDS_SHOWN), so the series stay
        # bounded however many targets are held; the count covers them all.
        self.held.set(status.held)
        for hold in status.holds:
            self.hold_seconds.set(hold.seconds_left, target=hold.target)
        for view in status.breakers:
            self.breakers.set(
                1, target=view.record.target, state=view.state, opens=str(view.record.opens)
            )
        self.quarantines.set(len(status.quarantines))
        self.second_order.set(status.second_order)

    def render(self, status: FleetStatus, queue: QueueDepths) -> bytes:
        """The exposition text of this scrape."""
        self.update(status, queue)
        return self.meters.render()


async def queue_depths(js: JetStreamContext, declared: Collection[str]) -> QueueDepths:
    """Messages per (target, tier) in the work stream, from one stream info read;
    undeclared targets' are summed under ``OTHER`` (nothing is routed to them)."""
    depths: QueueDepths = Counter()
    try:
        info = await js.stream_info(subjects.STREAM_WORK, subjects_filter="jf.work.>")
    except NotFoundError:
        return depths
    for subject, n in (info.state.subjects or {}).items():
        target = subjects.target_of(subject)
        tier = subject.rsplit(".", 1)[-1]
        depths[
            target if target in declared else OTHER, tier if tier in subjects.TIERS else OTHER
        ] += n
    return depths


def render_metrics(
    status: FleetStatus, declared: Collection[str], queue: QueueDepths | None = None
) -> str:
    """The status as Prometheus gauges (a fresh set of gauges: for one-off renders).

    Args:
        status: what ``fleet_status`` returned.
        declared: the declared targets, each always shown on its own.
        queue: what ``queue_depths`` returned (none shown when omitted).

    Returns:
        The exposition text, ending in a newline.
    """
    gauges = FleetGauges(declared)
    try:
        return gauges.render(status, queue or Counter()).decode()
    finally:
        gauges.meters.shutdown()


def _bounded(
    targets: dict[str, TargetCounts], declared: Collection[str]
) -> list[tuple[str, TargetCounts]]:
    # Submitting to a made-up target name costs one publish: the series must not grow
    # with such names, or one scrape could carry millions of them.
    undeclared = sorted(name for name in targets if name not in declared)
    shown = {name for name in targets if name in declared} | set(undeclared[:MAX_UNDECLARED])
    rows = [(name, targets[name]) for name in sorted(shown)]
    if len(undeclared) > MAX_UNDECLARED:
        folded = TargetCounts()
        for name in undeclared[MAX_UNDECLARED:]:
            folded.add(targets[name])
        rows.append((OTHER, folded))
    return rows
