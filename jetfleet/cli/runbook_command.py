"""``jetfleet runbook``: the fleet runbook from the live configuration (docs/runbook.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from jetfleet.cli.progress import print_json
from jetfleet.connection import connect_nats
from jetfleet.ops.runbook import Runbook, build_runbook
from jetfleet.settings import Settings

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 3.0


def register(commands: Any) -> None:
    """Add ``runbook`` to the parser."""
    parser = commands.add_parser(
        "runbook",
        help="print the fleet runbook from the live configuration",
        description="The lease contract, the dedupe key per job kind with its TTL and "
        "store, the quarantine triggers, the version tuple and approved set, and the "
        "escape hatch (pause, and who may use it): from the settings and the servers.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=_run)


async def runbook_for(settings: Settings) -> Runbook:
    """The runbook, with what the servers say when they can be reached."""
    try:
        nc = await asyncio.wait_for(
            connect_nats(settings.nats, "jetfleet-runbook", role="operator"), CONNECT_TIMEOUT_S
        )
    except Exception as exc:  # the settings alone still make a runbook
        log.warning("NATS not reachable (%s): the runbook is from the settings alone", exc)
        return await build_runbook(settings, None)
    try:
        return await build_runbook(settings, nc.jetstream())
    finally:
        await nc.close()


def _run(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    book = asyncio.run(runbook_for(settings_from(args)))
    if args.json:
        print_json(book.as_json())
    else:
        print(book.markdown())
    return 0
