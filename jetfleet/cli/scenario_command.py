"""``jetfleet scenario``: replay the leasing and containment walkthroughs against the
real services."""

from __future__ import annotations

import argparse
from typing import Any


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
    # Imported here: the walkthroughs pull in the services, the worker and the dev
    # stack, which every other command would otherwise pay for at start-up.
    from jetfleet.cli.scenario_report import run_scenario

    return run_scenario(args)
