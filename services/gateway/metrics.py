"""Prometheus text exposition of the fleet status."""

from __future__ import annotations

from jetfleet.ops.status import FIELDS, FleetStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(status: FleetStatus) -> str:
    """The status as Prometheus gauges.

    Every count is read from JetStream at scrape time, so any gateway replica gives the
    same answer and a restart resets nothing. Totals are left to PromQL (``sum``); a
    ``target="total"`` series would double-count in every aggregation.

    Args:
        status: what ``fleet_status`` returned.

    Returns:
        The exposition text, ending in a newline.
    """
    lines = [
        "# HELP jetfleet_jobs Jobs per target and state, read from JetStream at scrape time.",
        "# TYPE jetfleet_jobs gauge",
    ]
    for name, counts in sorted(status.targets.items()):
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
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    # The exposition format's label-value escapes; target names are subject tokens and
    # should never need them, but a malformed series would break the whole scrape.
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
