"""What the audit log says of the quarantine, breaker and pause commands the leaser executes
(docs/audit.md): one entry per command, after it ran, with its outcome."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from jetfleet.schemas.audit import AuditOutcome
from jetfleet.schemas.breaker import (
    BreakerClose,
    BreakerCommand,
    BreakerList,
    BreakerOpen,
    BreakerReply,
)
from jetfleet.schemas.control import (
    PauseCommand,
    PauseList,
    PauseReply,
    PauseResume,
    PauseSet,
)
from jetfleet.schemas.lease import (
    QuarantineApprove,
    QuarantineCommand,
    QuarantineList,
    QuarantineReject,
    QuarantineRelease,
    QuarantineReply,
    QuarantineSet,
)
from jetfleet.schemas.versions import (
    VersionsApprove,
    VersionsCommand,
    VersionsGuard,
    VersionsList,
    VersionsReply,
    VersionsRevoke,
)
from nats.js import JetStreamContext

from jetfleet.audit import NOT_RECORDED, record_action
from jetfleet.version_tuple import tuple_id

Command = QuarantineCommand | BreakerCommand | PauseCommand | VersionsCommand
CommandReply = QuarantineReply | BreakerReply | PauseReply | VersionsReply
R = TypeVar("R", QuarantineReply, BreakerReply, PauseReply, VersionsReply)


def described(command: Command) -> tuple[str, str, str, str] | None:
    """(action, who, what, why) of a command the audit records; None for a listing."""
    if isinstance(command, QuarantineList | BreakerList | PauseList | VersionsList):
        return None
    if isinstance(command, VersionsApprove | VersionsRevoke | VersionsGuard):
        return _versions_described(command)
    if isinstance(command, PauseSet | PauseResume):
        return _pause_described(command)
    if isinstance(command, QuarantineSet):
        r = command.record
        return (
            "quarantine.set",
            command.by or r.set_by,
            f"{r.scope} {r.name} on {r.target} "
            + (f"for {r.for_s:g} s" if r.for_s else "until released"),
            command.why or r.reason,
        )
    if isinstance(command, QuarantineRelease):
        what = f"{command.scope} {command.name} on {command.target}"
        return "quarantine.release", command.by, what, command.why
    if isinstance(command, QuarantineApprove):
        return "quarantine.approve", command.by, f"egress proposal {command.id}", command.why
    if isinstance(command, QuarantineReject):
        what = f"egress proposal {command.id}"
        return "quarantine.reject", command.by, what, command.why or command.reason
    if isinstance(command, BreakerOpen):
        opened = command.record
        return "breaker.open", opened.opened_by, f"target {opened.target}", opened.reason
    assert isinstance(command, BreakerClose)
    return "breaker.close", command.by, f"target {command.target}", command.reason


def _pause_described(command: PauseSet | PauseResume) -> tuple[str, str, str, str]:
    scope = "the fleet" if command.scope == "fleet" else f"{command.scope} {command.name}"
    if isinstance(command, PauseResume):
        return "resume", command.by, scope, command.why
    lasts = f"for {command.for_s:g} s" if command.for_s else "until resumed"
    return "pause", command.by, f"{scope} {lasts}, {command.mode}", command.why


def _versions_described(
    command: VersionsApprove | VersionsRevoke | VersionsGuard,
) -> tuple[str, str, str, str]:
    if isinstance(command, VersionsGuard):
        return (
            "versions.guard",
            command.by,
            "rollout guard " + ("on" if command.on else "off"),
            command.why,
        )
    if isinstance(command, VersionsRevoke):
        return "versions.revoke", command.by, f"version tuple {command.id}", command.why
    # `versions approve --current` sends the tuple whole and no id: name the id the
    # leaser approves it under (computed from the fields, as the leaser does), so the
    # log says which tuple was approved, not only that one was.
    tid = command.id or (tuple_id(command.versions) if command.versions is not None else "")
    what = f"version tuple {tid}" if tid else "version tuple (none named)"
    return "versions.approve", command.by, what, command.why


def _outcome(reply: CommandReply) -> tuple[AuditOutcome, str]:
    """The outcome and detail an entry records for a command's reply."""
    if reply.ok:
        leases = [] if isinstance(reply, VersionsReply) else reply.revoked
        revoked = f"revoked {len(leases)} lease(s)" if leases else ""
        return "done", "; ".join(part for part in (reply.detail, revoked) if part)
    return ("failed" if reply.retry_after_s else "refused"), reply.detail


def _automatic_no_op(command: Command, reply: CommandReply) -> bool:
    """A rule's or probe's command that changed nothing (kept, stale, already fired):
    replicas replay these, and the log records changes, not replays."""
    automatic = (
        isinstance(command, BreakerOpen)
        or (isinstance(command, QuarantineSet) and command.record.set_by.startswith("rule:"))
        or (isinstance(command, BreakerClose) and command.opens > 0)
    )
    if isinstance(reply, VersionsReply):
        # Every quarantine replica's guard may send the same withdrawal; one changes it.
        guard = isinstance(command, VersionsRevoke) and command.figures is not None
        return guard and reply.detail.startswith(("not approved", "kept"))
    return automatic and bool(reply.detail) and not reply.revoked


async def audited(
    js: JetStreamContext,
    command: Command,
    run: Callable[[], Awaitable[R]],
    refusal: R | None = None,
) -> R:
    """Run ``command`` and record it with its outcome; the reply, noting in its detail an
    entry that could not be written. A command that raised is recorded ``failed`` and
    raises on. ``refusal``, what the route's bounds check objects to, is answered
    instead of running the command, and recorded ``refused`` like a refusal of its own:
    someone asked for the action, and the log says so."""
    about = described(command)
    if about is None:
        return refusal or await run()
    action, who, what, why = about
    try:
        reply = refusal or await run()
    except Exception as exc:
        await record_action(js, action, who, what, why, str(exc), outcome="failed")
        raise
    if _automatic_no_op(command, reply):
        return reply
    outcome, detail = _outcome(reply)
    if await record_action(js, action, who, what, why, detail, outcome=outcome):
        return reply
    return msgspec.structs.replace(reply, detail=reply.detail + NOT_RECORDED)
