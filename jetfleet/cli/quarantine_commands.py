"""``jetfleet quarantine set|release|list``: operator quarantines of a (worker or
identity, target) scope. Setting one revokes the scope's live leases on that target and
requeues their jobs at once."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec

from jetfleet import subjects
from jetfleet.cli.breaker_commands import BREAKER_COLUMNS, breaker_rows, send_breaker
from jetfleet.cli.progress import print_json, print_table
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.schemas.breaker import BreakerList
from jetfleet.schemas.lease import (
    QuarantineCommand,
    QuarantineList,
    QuarantineRecord,
    QuarantineRelease,
    QuarantineReply,
    QuarantineScope,
    QuarantineSet,
)
from jetfleet.settings import Settings

_decoder = msgspec.json.Decoder(QuarantineReply)


def register(commands: Any) -> None:
    """Add ``quarantine`` to the parser."""
    parser = commands.add_parser(
        "quarantine",
        help="quarantine a worker or identity on a target",
        description="Set, release or list quarantines. A quarantined (worker or identity, "
        "target) gets no leases there; its held leases are revoked and requeued at once.",
    )
    actions = parser.add_subparsers(dest="quarantine_action", required=True)
    for name, text in (("set", "quarantine a scope"), ("release", "lift a quarantine")):
        action = actions.add_parser(name, help=text)
        scope = action.add_mutually_exclusive_group(required=True)
        scope.add_argument("--worker", help="a worker id")
        scope.add_argument("--identity", help="an identity")
        action.add_argument("--target", required=True, help="a declared target")
        if name == "set":
            action.add_argument("--reason", default="operator", help="why (shown in refusals)")
            action.add_argument(
                "--for",
                dest="for_s",
                type=float,
                default=0.0,
                help="seconds it lasts, by the server's clock (default: until released)",
            )
        action.add_argument("--json", action="store_true", help="print the answer as JSON")
        action.set_defaults(run=_run)
    listing = actions.add_parser(
        "list", help="list quarantines in force, and the targets' circuit breakers open"
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(run=_run)


def _command(args: argparse.Namespace, settings: Settings) -> QuarantineCommand:
    if args.quarantine_action == "list":
        return QuarantineList()
    scope: QuarantineScope = "worker" if args.worker else "identity"
    name = args.worker or args.identity
    if args.quarantine_action == "release":
        # A target since dropped from the settings may still hold records to lift: the
        # leaser takes any valid name here, so the CLI must not refuse it first.
        if not subjects.TARGET_NAME_RE.match(args.target):
            raise JetfleetError(
                f"--target {args.target!r} is not a target name (lowercase letters, digits, "
                "'-' or '_', at most 64)"
            )
        return QuarantineRelease(scope=scope, name=name, target=args.target)
    settings.target(args.target)
    if args.for_s < 0:
        raise JetfleetError("--for must be >= 0 seconds")
    return QuarantineSet(
        record=QuarantineRecord(
            scope=scope,
            name=name,
            target=args.target,
            reason=args.reason,
            for_s=args.for_s,
            set_by="operator",
        )
    )


def _run(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    settings = settings_from(args)
    reply = asyncio.run(send(settings, _command(args, settings)))
    if args.json:
        print_json(reply)
    elif not reply.ok:
        raise JetfleetError(f"the leaser refused: {reply.detail}")
    elif args.quarantine_action == "list":
        print_table(
            ["target", "scope", "name", "reason", "for_s", "set_by"],
            [
                [r.target, r.scope, r.name, r.reason, r.for_s or "-", r.set_by or "-"]
                for r in reply.records
            ],
        )
        _print_breakers(settings)
    elif args.quarantine_action == "set":
        print(
            f"quarantined; revoked and requeued {len(reply.revoked)} job(s)"
            + (f": {', '.join(reply.revoked)}" if reply.revoked else "")
        )
    else:
        print("released")
    return 0 if reply.ok else 1


def _print_breakers(settings: Settings) -> None:
    """The circuit breakers open or half-open, under the quarantines (a whole target
    paused is the widest quarantine there is)."""
    try:
        reply = asyncio.run(send_breaker(settings, BreakerList()))
    except JetfleetError as exc:
        print(f"\ncircuit breakers: unknown ({exc})")
        return
    if reply.breakers:
        print("\ncircuit breakers (`jetfleet breaker close --target T` closes one):")
        print_table(BREAKER_COLUMNS, breaker_rows(reply.breakers))


async def send(settings: Settings, command: QuarantineCommand) -> QuarantineReply:
    """Send one quarantine command to the leaser and return its answer."""
    nc = await connect_nats(settings.nats, "jetfleet-cli")
    try:
        answer = await nc.request(subjects.QUARANTINE, msgspec.json.encode(command), timeout=10.0)
    except Exception as exc:
        raise JetfleetError(
            f"no leaser answered on {subjects.QUARANTINE}: {exc}; is "
            "`jetfleet serve leaser` running?"
        ) from exc
    finally:
        await nc.close()
    return _decoder.decode(answer.data)
