"""``jetfleet doctor``: check lease TTL, visibility timeout and target timeouts against the
attempt durations observed in ``JF_OUTCOMES`` (see docs/doctor.md).

Exit codes: 0 when nothing needs attention (also when no attempts were observed yet),
1 when there are warnings, 2 on errors (as every command).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec

from jetfleet.cli.progress import print_json, print_table
from jetfleet.connection import connect_nats
from jetfleet.ops.doctor import (
    DEFAULT_LIMIT,
    DoctorReport,
    Recommendation,
    diagnose,
    durability_warnings,
)
from jetfleet.settings import Settings


def register(commands: Any) -> None:
    """Add ``doctor`` to the parser.

    Args:
        commands: the subparsers object of the ``jetfleet`` parser.
    """
    parser = commands.add_parser(
        "doctor",
        help="check timeouts and lease settings against observed attempt durations, and "
        "NATS durability (replicas, sync)",
        description="Read the attempt durations in JF_OUTCOMES, show count, p50, p95, p99 "
        "and max per target, and check fleet.lease_ttl_s, fleet.ack_wait_s and each "
        "target's timeout_s against them, with the arithmetic. Also check NATS against "
        "docs/cluster.md: nats.replicas and the live streams' and buckets' replicas at 3, "
        "and each server's sync_interval always (read from /varz of the servers listed in "
        "nats.monitor_url; not checked without it). Exit code 0: nothing to fix (or no "
        "attempts yet); 1: warnings; 2: error.",
    )
    parser.add_argument("--target", default=None, help="only this declared target")
    parser.add_argument(
        "--since",
        dest="since_s",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="only attempts of the last SECONDS (by the server's message timestamps)",
    )
    parser.add_argument(
        "--limit",
        type=_positive_int,
        default=DEFAULT_LIMIT,
        help=f"read at most the most recent LIMIT outcome events (default {DEFAULT_LIMIT})",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=_run)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _run(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    settings = settings_from(args)
    report = asyncio.run(collect(settings, args.target, args.since_s, args.limit))
    return show(report, args.json)


async def collect(
    settings: Settings,
    target: str | None = None,
    since_s: float | None = None,
    limit: int = DEFAULT_LIMIT,
) -> DoctorReport:
    """Connect to NATS and build the doctor's report.

    Args:
        settings: the settings to check.
        target: one declared target, or None for all targets with events.
        since_s: only attempts of the last this many seconds.
        limit: at most this many of the most recent outcome events.

    Returns:
        The report.

    Raises:
        ConfigError: if ``target`` is not declared.
        JetfleetError: if NATS cannot be reached.
    """
    if target is not None:
        settings.target(target)
    nc = await connect_nats(settings.nats, "jetfleet-doctor", role="operator")
    try:
        js = nc.jetstream()
        report = await diagnose(js, settings, target, since_s, limit)
        warnings, notes = await durability_warnings(js, settings)
    finally:
        await nc.close()
    return msgspec.structs.replace(
        report, warnings=[*report.warnings, *warnings], notes=[*report.notes, *notes]
    )


def show(report: DoctorReport, as_json: bool = False) -> int:
    """Print the report (tables, or JSON) and return the exit code.

    Args:
        report: what ``collect`` found.
        as_json: print the report as JSON instead of tables.

    Returns:
        0 when there are no warnings (also when nothing was observed), else 1.
    """
    if as_json:
        print_json(report)
        return report.exit_code
    if report.message:
        print(report.message)
        _print_warnings(report)
        return report.exit_code
    read = report.read
    bounds = f"the last {read.since_s:g} s, " if read.since_s is not None else ""
    print(
        f"{read.attempts} attempts from {read.stream} ({read.filter_subject}; "
        f"{bounds}at most the newest {read.limit} events"
        f"{', limit reached' if read.limit_reached else ''}): {read.events} events, "
        f"{read.skipped_blocked} blocked skipped"
        + (f", {read.skipped_undecodable} undecodable" if read.skipped_undecodable else "")
        + f"; {read.oldest} .. {read.newest}"
    )
    fleet = report.fleet
    print(
        f"fleet: ack_wait_s = {fleet.ack_wait_s:g} s, lease_ttl_s = {fleet.lease_ttl_s:g} s, "
        f"leases {'on' if fleet.leases else 'off'}"
    )
    print()
    print("fleet-wide")
    _print_recommendations(report.recommendations)
    for target in report.targets:
        stats = target.stats
        print()
        print(f"target {target.target}" + ("" if target.declared else " (not declared)"))
        print_table(
            ["attempts", "p50_s", "p95_s", "p99_s", "max_s", "timeouts"],
            [
                [
                    stats.count,
                    f"{stats.p50_s:.3f}",
                    f"{stats.p95_s:.3f}",
                    f"{stats.p99_s:.3f}",
                    f"{stats.max_s:.3f}",
                    stats.timeouts,
                ]
            ],
        )
        _print_recommendations(target.recommendations)
    print()
    if not report.all_warnings():
        print("no warnings")
    _print_warnings(report)
    return report.exit_code


def _print_warnings(report: DoctorReport) -> None:
    """The warnings (none printed when there are none), then the notes."""
    warnings = report.all_warnings()
    if warnings:
        print(f"{len(warnings)} warning(s):")
    for warning in warnings:
        print(f"  [{warning.code}] {warning.target or 'fleet'}: {warning.message}")
    for note in report.notes:
        print(f"  note: {note}")


def _print_recommendations(recommendations: list[Recommendation]) -> None:
    for rec in recommendations:
        verdict = "ok" if rec.ok else "CHANGE"
        print(
            f"  {rec.setting} >= {rec.recommended_s:g} s  (now {rec.current_s:g} s: {verdict})"
            f"  for {rec.applies_to}: {rec.rule}"
        )
