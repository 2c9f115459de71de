"""``jetfleet versions list|approve|revoke|guard``: the approved version set
(docs/versions.md). Every command goes through the leaser on ``jf.versions``; ``by`` is
the OS user running the command."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import msgspec

from jetfleet import subjects
from jetfleet.cli.actor import actor, add_actor_arguments, audit_note_off
from jetfleet.cli.actor import why as reason
from jetfleet.cli.progress import print_json, print_table
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.schemas.report import Versions
from jetfleet.schemas.versions import (
    VersionsApprove,
    VersionsCommand,
    VersionsGuard,
    VersionsList,
    VersionsReply,
    VersionsRevoke,
    VersionView,
)
from jetfleet.settings import Settings
from jetfleet.version_tuple import local_tuple

_decoder = msgspec.json.Decoder(VersionsReply)


def register(commands: Any) -> None:
    """Add ``versions`` to the parser."""
    parser = commands.add_parser(
        "versions",
        help="list, approve or revoke worker version tuples; turn the rollout guard on/off",
        description="Every worker advertises a version tuple (code revision, config hash, "
        "runtime, browser, worker.version_fields). Once any tuple has been approved "
        "(versions.gate = when-set), the leaser refuses a worker whose tuple is not "
        "(version-not-approved) and its jobs run on approved workers. The rollout guard "
        "withdraws a newly approved tuple whose success rate falls below "
        "versions.guard_fraction x the incumbent's. See docs/versions.md.",
    )
    actions = parser.add_subparsers(dest="versions_action", required=True)
    listing = actions.add_parser(
        "list", help="approved, seen and withdrawn tuples, and this machine's tuple"
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    approve = actions.add_parser("approve", help="add a tuple to the approved set")
    which = approve.add_mutually_exclusive_group(required=True)
    which.add_argument("id", nargs="?", default="", help="a tuple id a leaser has seen")
    which.add_argument(
        "--current",
        action="store_true",
        help="the tuple this machine advertises (its install and --config)",
    )
    revoke = actions.add_parser("revoke", help="withdraw a tuple from the approved set")
    revoke.add_argument("id", help="the tuple id")
    guard = actions.add_parser("guard", help="turn the rollout guard on or off fleet-wide")
    guard.add_argument("state", choices=("on", "off"))
    for sub in (approve, revoke, guard):
        add_actor_arguments(sub)
        sub.add_argument("--json", action="store_true", help="print the answer as JSON")
    for sub in (listing, approve, revoke, guard):
        sub.set_defaults(run=_run)


def _command(args: argparse.Namespace, settings: Settings) -> VersionsCommand:
    action = args.versions_action
    if action == "list":
        return VersionsList()
    why = reason(args)
    if not why.isprintable():
        raise JetfleetError("--why: give printable text on one line")
    by = actor(args)
    if action == "approve":
        current = local_tuple(settings) if args.current else None
        return VersionsApprove(id=args.id, versions=current, by=by, why=why)
    if action == "revoke":
        return VersionsRevoke(id=_tuple_id(args.id), by=by, why=why)
    return VersionsGuard(on=args.state == "on", by=by, why=why)


def _tuple_id(text: str) -> str:
    if len(text) != 12 or any(c not in "0123456789abcdef" for c in text):
        raise JetfleetError(
            f"{text!r} is not a tuple id: give the 12 hex digits `jetfleet versions list` shows"
        )
    return text


def describe(versions: Versions) -> str:
    """One line naming a tuple's fields, for tables."""
    parts = [f"code {versions.code or versions.jetfleet}", f"config {versions.config or '?'}"]
    parts.append(f"python {versions.python or '?'}, nats-py {versions.nats_py or '?'}")
    if versions.browser:
        parts.append(f"browser {versions.browser}")
    parts += [f"{k}={v}" for k, v in sorted(versions.declared.items())]
    if versions.unpinned:
        parts.append(f"UNPINNED ({versions.unpinned_why})")
    return "; ".join(parts)


def _ago(age_s: float) -> str:
    if age_s < 0:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if age_s >= size:
            return f"{age_s / size:.1f}{unit} ago"
    return f"{age_s:.0f}s ago"


def print_view(view: VersionView, local: Versions) -> None:
    """The approved set, the tuples seen, the withdrawals with why, and this machine's."""
    print(f"gate: {view.gate or '?'}   rollout guard switch: {view.guard}")
    print(f"this machine advertises: {local.id}  {describe(local)}")
    print("\napproved:")
    print_table(
        ["id", "approved", "by", "incumbent", "tuple", "why"],
        [
            [a.id, _ago(a.age_s), a.by, "yes" if a.incumbent else "", describe(a.versions), a.why]
            for a in view.approved
        ],
    )
    print("\nseen (last day):")
    print_table(
        ["id", "seen", "worker", "approved", "tuple"],
        [
            [s.id, _ago(s.age_s), s.worker, "yes" if s.approved else "NO", describe(s.versions)]
            for s in view.seen
        ],
    )
    print("\nwithdrawn:")
    print_table(
        ["id", "withdrawn", "by", "why"],
        [[w.id, _ago(w.age_s), w.by, w.why] for w in view.withdrawn],
    )


def _run(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    settings = settings_from(args)
    reply = asyncio.run(send_versions(settings, _command(args, settings)))
    if args.versions_action == "list" and reply.view is not None:
        local = local_tuple(settings)
        if args.json:
            body = msgspec.to_builtins(reply.view)
            body["local"] = msgspec.to_builtins(local)
            print(json.dumps(body, indent=2))
        else:
            print_view(reply.view, local)
        return 0
    if args.json:
        print_json(reply)
    elif not reply.ok:
        raise JetfleetError(f"the leaser refused: {reply.detail}")
    else:
        print(audit_note_off(reply.detail))
    return 0 if reply.ok else 1


async def send_versions(settings: Settings, command: VersionsCommand) -> VersionsReply:
    """Send one versions command to the leaser and return its answer."""
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        answer = await nc.request(subjects.VERSIONS, msgspec.json.encode(command), timeout=10.0)
    except Exception as exc:
        raise JetfleetError(
            f"no leaser answered on {subjects.VERSIONS}: {exc}; is `jetfleet serve leaser` "
            "running (a leaser from before version approval does not answer there)?"
        ) from exc
    finally:
        await nc.close()
    return _decoder.decode(answer.data)
