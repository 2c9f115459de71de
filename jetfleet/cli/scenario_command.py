"""``jetfleet scenario``: replay the leasing and containment walkthroughs against the
real services."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec

from jetfleet.cli.progress import print_json, print_table
from jetfleet.scenario.containment import ContainmentRun, run_containment
from jetfleet.scenario.ledger import METRIC_ORDER, Run
from jetfleet.scenario.walkthrough import SCALE, run_walkthrough


class ScenarioOutput(msgspec.Struct):
    """What ``--json`` prints."""

    runs: list[Run]
    containment: ContainmentRun | None = None
    """The containment walkthrough (absent with ``--leasing-only``)."""


def register(commands: Any) -> None:
    """Add ``scenario`` to the parser."""
    parser = commands.add_parser(
        "scenario",
        help="replay the leasing and containment walkthroughs against real services",
        description="Leasing: three workers with skewed clocks, a 30 s lease (run 10x "
        "faster on the server's real clock), a stolen lease, a lost ack, an overrun, a "
        "quarantine, an identity pin and a poison message; once without and once with "
        "idempotency keys. Containment: a block streak on one identity, its retirement by "
        "the quarantine service's default rule, and the requeue of its work to the other "
        "identities, with the figures expected. Starts its own nats-server and "
        "redis-server; needs nothing running. Exits 1 if containment's figures are not "
        "the expected ones.",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--no-dedupe", action="store_true", help="only the run without keys")
    which.add_argument("--dedupe-only", action="store_true", help="only the run with keys")
    part = parser.add_mutually_exclusive_group()
    part.add_argument(
        "--containment-only", action="store_true", help="only the containment walkthrough"
    )
    part.add_argument(
        "--leasing-only", action="store_true", help="leave the containment walkthrough out"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    modes = [False] if args.no_dedupe else [True] if args.dedupe_only else [False, True]
    if args.containment_only:
        modes = []
    runs = [asyncio.run(run_walkthrough(dedupe)) for dedupe in modes]
    containment = None if args.leasing_only else asyncio.run(run_containment())
    code = 0 if containment is None or containment.matches else 1
    if args.json:
        print_json(ScenarioOutput(runs=runs, containment=containment))
        return code
    for run in runs:
        _print_run(run)
    _print_leasing_side_by_side(runs)
    if containment is not None:
        _print_containment(containment)
    return code


def _print_leasing_side_by_side(runs: list[Run]) -> None:
    if len(runs) > 1:
        print("\nside by side:")
        print_table(
            ["metric", *("dedupe" if r.dedupe else "no dedupe" for r in runs)],
            [[m, *(r.metrics[m] for r in runs)] for m in METRIC_ORDER]
            + [["over_apply_ratio", *(f"{r.over_apply_ratio:.2f}" for r in runs)]],
        )


def _print_run(run: Run) -> None:
    title = "with idempotency keys" if run.dedupe else "without idempotency keys"
    print(f"\n== run {title} (time compressed {1 / SCALE:g}x on the server's clock) ==")
    for event in run.events:
        print(f"  {event.what:>10}  {event.detail}")
    print_table(
        ["metric", "value"],
        [[m, run.metrics[m]] for m in METRIC_ORDER]
        + [["over_apply_ratio", f"{run.over_apply_ratio:.2f}"]],
    )
    print(f"dead letter: {run.dead_letter}")
    for note in run.notes:
        print(f"note: {note}")


def _print_containment(run: ContainmentRun) -> None:
    print("\n== containment: a block streak, a retirement, the requeue ==")
    for event in run.events:
        print(f"  {event.what:>10}  {event.detail}")
    print_table(
        ["figure", "seen", "expected"],
        [[name, run.figures.get(name), want] for name, want in run.expected.items()]
        + [["shop_max_1s", run.shop_max_1s, f"<= {run.shop_cap_1s}"]],
    )
    print("containment: as expected" if run.matches else "containment: NOT as expected")
