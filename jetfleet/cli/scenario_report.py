"""What ``jetfleet scenario`` runs and prints (imported only by that command)."""

from __future__ import annotations

import argparse
import asyncio

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


def run_scenario(args: argparse.Namespace) -> int:
    """Run the walkthroughs ``args`` asks for and print them; the exit code."""
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
