"""``jetfleet pause`` and ``jetfleet resume``: the pause switch (docs/pause.md).

Exit codes: 0 done (the leaser refuses grants in scope, or grants them again; a resume of
a scope not paused says so and is 0 too); 1 the leaser refused the command; 2 bad input
or no leaser answering.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from typing import Any

import msgspec
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.cli.actor import actor, add_actor_arguments, audit_note_off, why
from jetfleet.cli.progress import print_json, print_table
from jetfleet.connection import connect_nats
from jetfleet.errors import JetfleetError
from jetfleet.ops.pause_status import pause_lines
from jetfleet.schemas.control import (
    MAX_PAUSE_S,
    PauseCommand,
    PauseList,
    PauseReply,
    PauseResume,
    PauseScope,
    PauseSet,
    PauseView,
)
from jetfleet.settings import Settings

_decoder = msgspec.json.Decoder(PauseReply)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
SCOPE_FLAGS: tuple[tuple[str, PauseScope], ...] = (
    ("target", "target"),
    ("region", "region"),
    ("worker", "worker"),
    ("identity", "identity"),
)


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``90``, ``30s``, ``30m``, ``2h`` or ``1d``.

    Raises:
        JetfleetError: if ``text`` is not such a duration, or is 0 or over 30 days.
    """
    match = _DURATION.match(text)
    if match is None:
        raise JetfleetError(
            f"--for {text!r} is not a duration: give a number with s, m, h or d (30s, 30m, "
            "2h, 1d; a bare number is seconds), or leave --for out to pause until resumed"
        )
    seconds = float(match.group(1)) * _UNIT_S[match.group(2) or "s"]
    if not 0 < seconds <= MAX_PAUSE_S:
        raise JetfleetError(
            f"--for {text!r} is {seconds:g} s: give more than 0 and at most 30 days "
            "(leave --for out to pause until resumed)"
        )
    return seconds


def _scope_args(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--target", help="only this target's jobs (default: the whole fleet)")
    scope.add_argument("--region", help="only the workers of this region")
    scope.add_argument("--worker", help="only this worker (by its id)")
    scope.add_argument("--identity", help="only this identity, on whichever worker holds it")
    add_actor_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")


def register(commands: Any) -> None:
    """Add ``pause`` and ``resume`` to the parser."""
    pause = commands.add_parser(
        "pause",
        help="pause the fleet, a target, a region, a worker or an identity",
        description="Stop new leases in a scope within a second: the leaser refuses "
        "grants there (`paused`), and a fleet or target pause also pauses the work "
        "consumers at the server. Without a scope flag the whole fleet is paused. "
        "--drain (the default) lets held leases finish; --now revokes them and requeues "
        "their jobs (their attempt is given back). Survives restarts of every service. "
        "Exit codes: 0 done, 1 refused by the leaser, 2 bad input or no leaser.",
    )
    _scope_args(pause)
    pause.add_argument(
        "--for",
        dest="for_",
        metavar="DURATION",
        help="lapse by itself after this long by the server's clock (30s, 30m, 2h, 1d); "
        "default: until `jetfleet resume`",
    )
    mode = pause.add_mutually_exclusive_group()
    mode.add_argument("--drain", action="store_true", help="let held leases finish (the default)")
    mode.add_argument("--now", action="store_true", help="revoke held leases, requeue their jobs")
    pause.add_argument("--list", action="store_true", help="list the pauses in force instead")
    pause.set_defaults(run=_run, resume=False)
    resume = commands.add_parser(
        "resume",
        help="end a pause (same scope flags as pause)",
        description="End the pause of a scope (the fleet without a scope flag): grants "
        "resume, and its work consumers resume at the server unless another pause still "
        "covers them (a fleet pause over a target's). Exit codes as for pause.",
    )
    _scope_args(resume)
    resume.set_defaults(run=_run, resume=True, list=False)


def command_of(args: argparse.Namespace) -> PauseCommand:
    """The command the arguments ask for."""
    if args.list:
        return PauseList()
    scope: PauseScope = "fleet"
    name = ""
    for flag, flag_scope in SCOPE_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            if not value or not value.isprintable():
                raise JetfleetError(f"--{flag}: give a name (printable characters)")
            if flag == "target" and not subjects.TARGET_NAME_RE.match(value):
                raise JetfleetError(
                    f"--target {value!r} is not a target name (lowercase letters, digits, "
                    "'-' or '_', at most 64)"
                )
            scope, name = flag_scope, value
    if args.resume:
        return PauseResume(scope=scope, name=name, by=actor(args), why=why(args))
    for_s = parse_duration(args.for_) if args.for_ is not None else 0.0
    return PauseSet(
        scope=scope,
        name=name,
        for_s=for_s,
        mode="now" if args.now else "drain",
        by=actor(args),
        why=why(args),
    )


PAUSE_COLUMNS = ["scope", "name", "left", "mode", "by", "why"]


def pause_rows(views: list[PauseView]) -> list[list[object]]:
    """One table row per pause in force."""
    return [
        [
            v.record.scope,
            v.record.name,
            f"{v.left_s:.0f} s" if v.record.for_s > 0 else "until resumed",
            v.record.mode,
            v.record.by,
            v.record.why,
        ]
        for v in views
    ]


def _run(args: argparse.Namespace) -> int:
    from jetfleet.cli.main import settings_from

    command = command_of(args)
    reply = asyncio.run(send_pause(settings_from(args), command))
    if args.json:
        print_json(reply)
        return 0 if reply.ok else 1
    if not reply.ok:
        print(f"jetfleet: the leaser refused: {reply.detail}", file=sys.stderr)
        return 1
    reply = msgspec.structs.replace(reply, detail=audit_note_off(reply.detail))
    if isinstance(command, PauseList):
        if reply.pauses:
            print_table(PAUSE_COLUMNS, pause_rows(reply.pauses))
        else:
            print("no pause in force")
    elif isinstance(command, PauseSet):
        for line in pause_lines(reply.pauses):
            print(line)
        if reply.revoked:
            print(f"revoked and requeued {len(reply.revoked)} held lease(s)")
    else:
        held = f"; {len(reply.consumers)} work consumer(s) resumed at the server"
        print(reply.detail or f"resumed: grants in scope go on{held if reply.consumers else ''}")
    return 0


async def send_pause(settings: Settings, command: PauseCommand) -> PauseReply:
    """Send one pause command to the leaser and return its answer."""
    nc = await connect_nats(settings.nats, "jetfleet-cli", role="operator")
    try:
        return await ask_pause(nc, command)
    finally:
        await nc.close()


async def ask_pause(nc: NatsClient, command: PauseCommand, timeout_s: float = 10.0) -> PauseReply:
    """Send one pause command to the leaser over ``nc`` (the CLI's or the gateway's),
    waiting ``timeout_s`` for its answer.

    Raises:
        JetfleetError: no leaser answered.
    """
    try:
        answer = await nc.request(subjects.PAUSE, msgspec.json.encode(command), timeout=timeout_s)
    except Exception as exc:
        raise JetfleetError(
            f"no leaser answered on {subjects.PAUSE}: {exc}; is `jetfleet serve leaser` "
            "running (a leaser from before the pause switch does not answer there)?"
        ) from exc
    return _decoder.decode(answer.data)
