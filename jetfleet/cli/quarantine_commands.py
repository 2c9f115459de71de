"""``jetfleet quarantine set|release|list|approve|reject``: operator quarantines of a
(worker, identity or egress subnet, target) scope, and the answers to egress proposals.
Setting or approving one revokes the scope's live leases on that target and requeues
their jobs at once."""

from __future__ import annotations

import argparse
import asyncio
import re
from collections.abc import Sequence
from typing import Any

import msgspec
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.cli.actor import actor, add_actor_arguments, audit_note_off, why
from jetfleet.cli.breaker_commands import BREAKER_COLUMNS, breaker_rows
from jetfleet.cli.progress import print_json, print_table
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.ops.breaker_status import open_breakers
from jetfleet.ops.quarantine_view import ProposalShown, RecordShown, read_quarantines
from jetfleet.schemas.breaker import BreakerView
from jetfleet.schemas.lease import (
    QuarantineApprove,
    QuarantineCommand,
    QuarantineRecord,
    QuarantineReject,
    QuarantineRelease,
    QuarantineReply,
    QuarantineScope,
    QuarantineSet,
)
from jetfleet.settings import Settings

_decoder = msgspec.json.Decoder(QuarantineReply)
_PROPOSAL_ID = re.compile(r"[0-9a-f]{16}")
REASON_SHOWN = 100
"""Characters of a reason a table shows (``--json`` shows all of it)."""


def register(commands: Any) -> None:
    """Add ``quarantine`` to the parser."""
    parser = commands.add_parser(
        "quarantine",
        help="quarantine a worker, identity or egress subnet on a target",
        description="Set, release or list quarantines, and approve or reject egress "
        "proposals. A quarantined (worker, identity or subnet, target) gets no leases "
        "there; its held leases are revoked and requeued at once.",
    )
    actions = parser.add_subparsers(dest="quarantine_action", required=True)
    for name, text in (("set", "quarantine a scope"), ("release", "lift a quarantine")):
        action = actions.add_parser(name, help=text)
        scope = action.add_mutually_exclusive_group(required=True)
        scope.add_argument("--worker", help="a worker id")
        scope.add_argument("--identity", help="an identity")
        scope.add_argument(
            "--subnet", help="an egress subnet, as worker.subnet spells it (10.1.0.0/24)"
        )
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
        add_actor_arguments(action)
        action.set_defaults(run=_run)
    listing = actions.add_parser(
        "list",
        help="list quarantines in force, egress proposals and open circuit breakers, "
        "with time left",
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(run=_run_list)
    for name, text in (
        ("approve", "approve an egress proposal: the subnet is quarantined on its target"),
        ("reject", "reject an egress proposal: nothing is quarantined"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("id", help="the proposal's id (jetfleet quarantine list)")
        if name == "reject":
            action.add_argument("--reason", default="", help="why (kept with the proposal)")
        action.add_argument("--json", action="store_true", help="print the answer as JSON")
        add_actor_arguments(action)
        action.set_defaults(run=_run)


def _scope(args: argparse.Namespace) -> tuple[QuarantineScope, str]:
    if args.worker:
        return "worker", args.worker
    if args.identity:
        return "identity", args.identity
    return "egress", args.subnet


def _command(args: argparse.Namespace, settings: Settings) -> QuarantineCommand:
    if args.quarantine_action in ("approve", "reject"):
        if not _PROPOSAL_ID.fullmatch(args.id):
            raise JetfleetError(
                f"{args.id!r} is not a proposal id (16 hex digits): `jetfleet quarantine "
                "list` shows the pending proposals and their ids"
            )
        if args.quarantine_action == "approve":
            return QuarantineApprove(id=args.id, by=actor(args), why=why(args))
        return QuarantineReject(id=args.id, reason=args.reason, by=actor(args), why=why(args))
    scope, name = _scope(args)
    if args.quarantine_action == "release":
        # A target since dropped from the settings may still hold records to lift: the
        # leaser takes any valid name here, so the CLI must not refuse it first.
        if not subjects.TARGET_NAME_RE.match(args.target):
            raise JetfleetError(
                f"--target {args.target!r} is not a target name (lowercase letters, digits, "
                "'-' or '_', at most 64)"
            )
        return QuarantineRelease(
            scope=scope, name=name, target=args.target, by=actor(args), why=why(args)
        )
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
        ),
        by=actor(args),
        why=why(args) or args.reason,
    )


def _run(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    settings = settings_from(args)
    reply = asyncio.run(send(settings, _command(args, settings)))
    if args.json:
        print_json(reply)
    elif not reply.ok:
        raise JetfleetError(f"the leaser refused: {reply.detail}")
    elif args.quarantine_action in ("set", "approve"):
        what = "approved: quarantined" if args.quarantine_action == "approve" else "quarantined"
        kept = audit_note_off(reply.detail)
        if kept:  # a record in force was kept
            what = kept
        print(
            f"{what}; revoked and requeued {len(reply.revoked)} job(s)"
            + (f": {', '.join(reply.revoked)}" if reply.revoked else "")
        )
    elif args.quarantine_action == "reject":
        audit_note_off(reply.detail)
        print("rejected: nothing is quarantined, and the same evidence proposes nothing again")
    else:
        audit_note_off(reply.detail)
        print("released")
    return 0 if reply.ok else 1


def _run_list(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    settings = settings_from(args)
    records, proposals, breakers = asyncio.run(_read(settings))
    if args.json:
        print_json({"ok": True, "records": records, "proposals": proposals, "breakers": breakers})
        return 0
    print_quarantines(records, proposals)
    if breakers:
        print("\ncircuit breakers (`jetfleet breaker close --target T` closes one):")
        print_table(BREAKER_COLUMNS, breaker_rows(breakers))
    return 0


async def _read(
    settings: Settings,
) -> tuple[list[RecordShown], list[ProposalShown], list[BreakerView]]:
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        view = await read_quarantines(nc.jetstream())
        breakers = await open_breakers(nc.jetstream())
    finally:
        await nc.close()
    return view.records, view.proposals, breakers


def _left(left_s: float | None, for_s: float, age_s: float | None) -> str:
    if left_s is not None:
        return f"{left_s:.0f} s"
    if age_s is not None or for_s == 0:
        return "until released"
    return f"for_s {for_s:g} (age unknown)"


def print_quarantines(
    records: Sequence[RecordShown], proposals: Sequence[ProposalShown], most: int = 0
) -> None:
    """Print the records in force, then the proposals (``most`` > 0: at most that many
    rows of each)."""
    shown = list(records[:most] if most else records)
    second_order = sum(1 for r in records if r.second_order_of)
    print(f"quarantines in force: {len(records)} ({second_order} second-order)")
    if shown:
        print_table(
            ["target", "scope", "name", "left", "set_by", "second-order of", "reason"],
            [
                [
                    r.target,
                    r.scope,
                    r.name,
                    _left(r.left_s, r.for_s, r.age_s),
                    f"{r.set_by} ({r.proposed_by})" if r.proposed_by else r.set_by or "-",
                    r.second_order_of or "-",
                    r.reason[:REASON_SHOWN],
                ]
                for r in shown
            ],
        )
    if len(records) > len(shown):
        print(f"  ... and {len(records) - len(shown)} more (jetfleet quarantine list)")
    pending = [p for p in proposals if p.state == "proposed"]
    print(
        f"\negress proposals: {len(pending)} pending, {len(proposals) - len(pending)} "
        "rejected (jetfleet quarantine approve|reject ID)"
    )
    listed = list(proposals[:most] if most else proposals)
    if listed:
        print_table(
            ["id", "state", "subnet", "target", "identities", "lapses in", "reason"],
            [
                [
                    p.id,
                    p.state,
                    p.subnet,
                    p.target,
                    ", ".join(p.identities),
                    "-" if p.left_s is None else f"{p.left_s:.0f} s",
                    (p.answered_by + ": " if p.answered_by else "") + p.reason[:REASON_SHOWN],
                ]
                for p in listed
            ],
        )
    if len(proposals) > len(listed):
        print(f"  ... and {len(proposals) - len(listed)} more (jetfleet quarantine list)")


async def send(settings: Settings, command: QuarantineCommand) -> QuarantineReply:
    """Send one quarantine command to the leaser and return its answer."""
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        return await ask_quarantine(nc, command)
    finally:
        await nc.close()


async def ask_quarantine(
    nc: NatsClient,
    command: QuarantineCommand,
    subject: str = subjects.QUARANTINE,
    timeout_s: float = 10.0,
) -> QuarantineReply:
    """Send one quarantine command to the leaser over ``nc`` (the CLI's or the gateway's),
    on ``subject`` (the gateway answers proposals on ``subjects.QUARANTINE_ANSWER``),
    waiting ``timeout_s`` for its answer.

    Raises:
        JetfleetError: no leaser answered.
    """
    try:
        answer = await nc.request(subject, msgspec.json.encode(command), timeout=timeout_s)
    except Exception as exc:
        raise JetfleetError(
            f"no leaser answered on {subject}: {exc}; is `jetfleet serve leaser` running?"
        ) from exc
    return _decoder.decode(answer.data)
