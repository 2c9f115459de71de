"""``jetfleet breaker list|close``: the per-target circuit breakers. The quarantine service
opens one when K distinct identities are refused on a target within the window; one probe
closes it after the cooling, or an operator does here."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec

from jetfleet import subjects
from jetfleet.cli.actor import actor, add_actor_arguments, audit_note_off, why
from jetfleet.cli.progress import print_json, print_table
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.schemas.breaker import (
    BreakerClose,
    BreakerCommand,
    BreakerList,
    BreakerReply,
    BreakerView,
)
from jetfleet.settings import Settings

_decoder = msgspec.json.Decoder(BreakerReply)


def register(commands: Any) -> None:
    """Add ``breaker`` to the parser."""
    parser = commands.add_parser(
        "breaker",
        help="list or close the targets' circuit breakers",
        description="A target's circuit breaker opens when refusals (blocks, challenges) "
        "on it come from quarantine.breaker.identities distinct identities within "
        "window_s: no lease is granted there for cool_s, then one probe decides. List the "
        "breakers open or half-open, or close one by hand (its jobs are granted again).",
    )
    actions = parser.add_subparsers(dest="breaker_action", required=True)
    listing = actions.add_parser("list", help="list the breakers open or half-open")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(run=_run)
    close = actions.add_parser("close", help="close a target's breaker now")
    close.add_argument("--target", required=True, help="the target whose breaker to close")
    close.add_argument("--reason", default="", help="why (kept in the closing alert)")
    close.add_argument("--json", action="store_true", help="print the answer as JSON")
    add_actor_arguments(close)
    close.set_defaults(run=_run)


def _command(args: argparse.Namespace) -> BreakerCommand:
    if args.breaker_action == "list":
        return BreakerList()
    # A target since dropped from the settings may still have a breaker to close.
    if not subjects.TARGET_NAME_RE.match(args.target):
        raise JetfleetError(
            f"--target {args.target!r} is not a target name (lowercase letters, digits, "
            "'-' or '_', at most 64)"
        )
    return BreakerClose(target=args.target, by=actor(args), reason=(why(args) or args.reason)[:256])


def breaker_rows(views: list[BreakerView]) -> list[list[object]]:
    """One table row per breaker: target, state, cooling, openings, identities, reason."""
    return [
        [
            v.record.target,
            v.state,
            f"{v.record.cool_s:g} s",
            v.record.opens,
            ", ".join(v.record.identities[:5]),
            v.record.reason,
        ]
        for v in views
    ]


BREAKER_COLUMNS = ["target", "state", "cool_s", "opens", "identities", "reason"]


def _run(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    reply = asyncio.run(send_breaker(settings_from(args), _command(args)))
    if args.json:
        print_json(reply)
    elif not reply.ok:
        raise JetfleetError(f"the leaser refused: {reply.detail}")
    elif args.breaker_action == "list":
        print_table(BREAKER_COLUMNS, breaker_rows(reply.breakers))
    else:
        detail = audit_note_off(reply.detail)
        print(detail or f"closed: jobs of {args.target} are granted again")
    return 0 if reply.ok else 1


async def send_breaker(settings: Settings, command: BreakerCommand) -> BreakerReply:
    """Send one breaker command to the leaser and return its answer."""
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        answer = await nc.request(subjects.BREAKER, msgspec.json.encode(command), timeout=10.0)
    except Exception as exc:
        raise JetfleetError(
            f"no leaser answered on {subjects.BREAKER}: {exc}; is `jetfleet serve leaser` "
            "running (a leaser from before circuit breakers does not answer there)?"
        ) from exc
    finally:
        await nc.close()
    return _decoder.decode(answer.data)
