"""Prometheus text exposition of the fleet status."""

from __future__ import annotations

from collections.abc import Collection

from jetfleet.metrics import OTHER
from jetfleet.ops.status import FIELDS, FleetStatus, TargetCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_UNDECLARED = 100
"""Undeclared targets (names anyone can submit to, refused) shown one by one at most;
the counts of the rest are summed under ``target="_other"``."""


def render_metrics(status: FleetStatus, declared: Collection[str]) -> str:
    """The status as Prometheus gauges.

    Every count is read from JetStream at scrape time, so any gateway replica gives the
    same answer and a restart resets nothing. Totals are left to PromQL (``sum``); a
    ``target="total"`` series would double-count in every aggregation.

    Args:
        status: what ``fleet_status`` returned.
        declared: the declared targets, each always shown on its own.

    Returns:
        The exposition text, ending in a newline.
    """
    lines = [
        "# HELP jetfleet_jobs Jobs per target and state, read from JetStream at scrape time.",
        "# TYPE jetfleet_jobs gauge",
    ]
    for name, counts in _bounded(status.targets, declared):
        label = _escape(name)
        for state in FIELDS:
            lines.append(
                f'jetfleet_jobs{{target="{label}",state="{state}"}} {getattr(counts, state)}'
            )
    lines += [
        "# HELP jetfleet_admitting Submissions the scheduler has not decided yet.",
        "# TYPE jetfleet_admitting gauge",
        f"jetfleet_admitting {status.admitting}",
    ]
    return "\n".join(lines + _limiter_lines(status)) + "\n"


def _limiter_lines(status: FleetStatus) -> list[str]:
    # Holds listed by the status only (at most MAX_HOLDS_SHOWN), so the series stay
    # bounded however many targets are held; the count covers them all.
    lines = [
        "# HELP jetfleet_ratelimit_ok 1 when the rate limiter's Redis answers; 0 while it "
        "fails closed (no permits, nothing sent).",
        "# TYPE jetfleet_ratelimit_ok gauge",
        f"jetfleet_ratelimit_ok {1 if status.rate_limiter == 'ok' else 0}",
        "# HELP jetfleet_targets_held Targets held fleet-wide now.",
        "# TYPE jetfleet_targets_held gauge",
        f"jetfleet_targets_held {status.held}",
        "# HELP jetfleet_target_hold_seconds Seconds left of a target's fleet-wide hold "
        "(the longest holds only, as jetfleet status lists them).",
        "# TYPE jetfleet_target_hold_seconds gauge",
    ]
    for hold in status.holds:
        lines.append(
            f'jetfleet_target_hold_seconds{{target="{_escape(hold.target)}"}} {hold.seconds_left}'
        )
    return lines


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


def _escape(value: str) -> str:
    # The exposition format's label-value escapes; target names are subject tokens and
    # should never need them, but a malformed series would break the whole scrape.
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
