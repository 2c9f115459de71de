"""``jetfleet scenario``: replay the leasing walkthrough against the real services."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec

from jetfleet.cli.progress import print_json, print_table
from jetfleet.scenario.ledger import METRIC_ORDER, Run
from jetfleet.scenario.walkthrough import SCALE, run_walkthrough


class ScenarioOutput(msgspec.Struct):
    """What ``--json`` prints."""

    runs: list[Run]


def register(commands: Any) -> None:
    """Add ``scenario`` to the parser."""
    parser = commands.add_parser(
        "scenario",
        help="replay the leasing walkthrough against real services",
        description="Three workers with skewed clocks, a 30 s lease (run 10x faster on the "
        "server's real clock), a stolen lease, a lost ack, an overrun, a quarantine, an "
        "identity pin and a poison message; once without and once with idempotency keys. "
        "Starts its own nats-server; needs nothing running.",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--no-dedupe", action="store_true", help="only the run without keys")
    which.add_argument("--dedupe-only", action="store_true", help="only the run with keys")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    modes = [False] if args.no_dedupe else [True] if args.dedupe_only else [False, True]
    runs = [asyncio.run(run_walkthrough(dedupe)) for dedupe in modes]
    if args.json:
        print_json(ScenarioOutput(runs=runs))
        return 0
    for run in runs:
        _print_run(run)
    if len(runs) > 1:
        print("\nside by side:")
        print_table(
            ["metric", *("dedupe" if r.dedupe else "no dedupe" for r in runs)],
            [[m, *(r.metrics[m] for r in runs)] for m in METRIC_ORDER]
            + [["over_apply_ratio", *(f"{r.over_apply_ratio:.2f}" for r in runs)]],
        )
    return 0


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
