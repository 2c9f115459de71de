"""The dashboard's control actions: pause and resume, approve or reject an egress
proposal, replay a dead letter (docs/dashboard.md#the-token-and-the-control-actions).

Each builds its command with the CLI's own code (``command_of`` for pause, the quarantine
command builder, ``replay_recorded``), so the checks, messages and audit entries are the
CLI's; the actor is ``ACTOR`` (the holder of the gateway token), the reason the body's
``why``. Pause and proposal answers are executed and recorded by the leaser; a replay is
recorded here, as the CLI records its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import msgspec
from aiohttp import web
from jetfleet.schemas.control import PauseMode, PauseScope
from jetfleet.services.gateway.refusal import Refused
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.cli.dlq_commands import replay_recorded
from jetfleet.cli.pause_commands import ask_pause, command_of
from jetfleet.cli.quarantine_commands import _command as quarantine_command
from jetfleet.cli.quarantine_commands import ask_quarantine
from jetfleet.errors import JetfleetError
from jetfleet.settings import Settings

T = TypeVar("T")
R = TypeVar("R")
ACTOR = "dashboard"
"""Who the audit log says acted: the holder of the gateway token."""


class PauseBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/pause`` and ``/v1/resume``: the CLI's flags as JSON."""

    scope: PauseScope = "fleet"
    name: str = ""
    for_: str | float | None = msgspec.field(default=None, name="for")
    """A duration as ``jetfleet pause --for`` takes it (``30s``, ``2h``; a number is
    seconds); none: until resumed."""
    mode: PauseMode = "drain"
    why: str = ""


class ProposalBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/proposals/{id}/approve|reject``."""

    why: str = ""
    reason: str = ""
    """With reject: kept with the proposal."""


class ReplayBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/dead-letters/{id}/replay``."""

    why: str = ""


def require_json(request: web.Request) -> None:
    """Refuse a control request not sent as JSON.

    With no token configured a loopback gateway takes writes from anyone on the
    machine, and that includes a page open in the operator's browser: a cross-site form
    or ``fetch`` reaches 127.0.0.1 too. The write check refuses one that names another
    origin in ``Origin`` (``access.check_origin``); one that leaves ``Origin`` out cannot
    send a JSON content type without a CORS preflight, which the gateway never grants
    (415 here).

    Raises:
        Refused: 415 not ``application/json``.
    """
    if request.content_type != "application/json":
        raise Refused(
            415,
            f"send the body as JSON with 'Content-Type: application/json' (not "
            f"{request.content_type!r})",
        )


def decode_body(body: bytes, type_: type[T]) -> T:
    """The request body as ``type_`` (an empty body is ``{}``).

    Raises:
        Refused: 400, saying which field is wrong.
    """
    try:
        return msgspec.json.decode(body or b"{}", type=type_)
    except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: nested too deep
        raise Refused(400, f"bad request body: {exc}") from None


def _args(**fields: Any) -> argparse.Namespace:
    return argparse.Namespace(actor=ACTOR, **fields)


def _refused(exc: JetfleetError) -> Refused:
    return Refused(400, str(exc))


def leaser_wait_s(settings: Settings) -> float:
    """How long a control action waits for the leaser: half the request's own budget
    (``gateway.request_timeout_s``), at most 10 s as the CLI waits, so a leaser that never
    answers is a 503 that names it, never the request's bare 504."""
    return min(10.0, settings.gateway.request_timeout_s / 2)


async def pause(
    nc: NatsClient, settings: Settings, body: PauseBody, resume: bool
) -> dict[str, Any]:
    """Pause (or resume) the scope ``body`` names through the leaser.

    Raises:
        Refused: 400 bad input; 409 the leaser refused; 503 busy or no leaser answered.
    """
    flags: dict[str, str | None] = dict.fromkeys(("target", "region", "worker", "identity"))
    if body.scope != "fleet":
        flags[body.scope] = body.name
    elif body.name:
        raise Refused(400, "a fleet pause names nothing: leave name empty")
    for_ = None if body.for_ is None else str(body.for_)
    args = _args(
        list=False, resume=resume, for_=for_, now=body.mode == "now", why=body.why, **flags
    )
    try:
        command = command_of(args)
    except JetfleetError as exc:
        raise _refused(exc) from None
    reply = await _asked(lambda: ask_pause(nc, command, leaser_wait_s(settings)))
    return _answer(reply.ok, reply.detail, reply.retry_after_s, msgspec.to_builtins(reply))


async def answer_proposal(
    nc: NatsClient,
    settings: Settings,
    id_: str,
    action: Literal["approve", "reject"],
    body: ProposalBody,
) -> dict[str, Any]:
    """Approve or reject egress proposal ``id_`` through the leaser.

    Raises:
        Refused: 400 not a proposal id; 409 the leaser refused; 503 no leaser.
    """
    args = _args(quarantine_action=action, id=id_, why=body.why, reason=body.reason)
    try:
        command = quarantine_command(args, settings)
    except JetfleetError as exc:
        raise _refused(exc) from None
    # The gateway may send proposal answers only (jetfleet/auth/roles.py), on their subject.
    wait_s = leaser_wait_s(settings)
    reply = await _asked(lambda: ask_quarantine(nc, command, subjects.QUARANTINE_ANSWER, wait_s))
    return _answer(reply.ok, reply.detail, reply.retry_after_s, msgspec.to_builtins(reply))


async def replay_letter(
    nc: NatsClient, settings: Settings, letter: str, body: ReplayBody
) -> dict[str, Any]:
    """Replay dead letter ``letter`` (its id), recorded as ``dlq.replay`` by ``ACTOR``.

    Raises:
        Refused: 400 not an id; 404 no such letter; 409 admission would refuse the replay
            (or it would lose the letter's idempotency key).
    """
    if not letter.isdigit() or int(letter) < 1:
        raise Refused(400, f"{letter!r} is not a dead letter id (a positive stream sequence)")
    try:
        new_ids = await replay_recorded(
            nc.jetstream(), settings, int(letter), None, None, ACTOR, body.why[:256]
        )
    except JetfleetError as exc:
        # get_dead_letter's refusal of a missing letter starts so (jetfleet/ops/dead_letters.py).
        missing = str(exc).startswith("no dead letter")
        raise Refused(404 if missing else 409, str(exc)) from None
    return {"ok": True, "replayed": new_ids}


async def _asked(ask: Callable[[], Awaitable[R]]) -> R:
    try:
        reply = await ask()
    except JetfleetError as exc:  # no leaser answered
        raise Refused(503, str(exc), {"Retry-After": "1"}) from None
    return reply


def _answer(ok: bool, detail: str, retry_after_s: float, reply: Any) -> dict[str, Any]:
    if ok:
        return {"ok": True, "reply": reply}
    if retry_after_s:
        raise Refused(
            503,
            f"the leaser is busy: {detail}; retry",
            {"Retry-After": str(max(1, round(retry_after_s)))},
            reply=reply,
        )
    raise Refused(409, f"the leaser refused: {detail}", reply=reply)
