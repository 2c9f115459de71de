"""Record control actions in ``JF_AUDIT``, and read them back (docs/audit.md).

An action is recorded by whatever executes it, after it took effect, with its outcome.
Writing the entry never fails the action: the action has happened (leases revoked, a
breaker closed), and refusing the escape hatch because the audit stream is unavailable
would turn an audit outage into an incident of its own. So a failed write is logged at
ERROR with the whole entry (the log is the audit of last resort) and reported to the
caller as ``False``, which services put in their answer's detail.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
from jetfleet.errors import JetfleetError
from jetfleet.schemas.audit import AuditEntry, AuditOutcome
from jetfleet.stream_reader import read_stream

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AuditEntry)
WRITE_TIMEOUT_S = 2.0
NOT_RECORDED = "; the audit entry could not be written (see the service's log)"
"""What a service adds to its answer's detail when ``record_action`` returned False."""


async def record_action(
    js: JetStreamContext,
    action: str,
    who: str,
    what: str,
    why: str = "",
    detail: str = "",
    *,
    outcome: AuditOutcome = "done",
) -> bool:
    """Record one control action on ``jf.audit.<action>``; True once the server stored it.

    Never raises (an action it records must not fail because of it): a bad action name
    or a write the server did not confirm is logged at ERROR, with the entry, and False
    comes back.

    Args:
        js: A JetStream context.
        action: Dotted lower-case tokens: ``quarantine.set``, ``pause``, ``versions.approve``.
        who: Who asked (``--as NAME`` or the OS user; ``rule:<name>`` for a rule).
        what: The scope acted on, in words.
        why: The reason given (``--why``).
        detail: What came of it, or why it was refused.
        outcome: ``done``, ``refused`` or ``failed``.
    """
    try:
        entry = msgspec.convert(
            {
                "action": action,
                "who": who or "unknown",
                "what": what,
                "why": why,
                "outcome": outcome,
                "detail": detail,
            },
            AuditEntry,
        )
        await js.publish(subjects.audit(action), _encoder.encode(entry), timeout=WRITE_TIMEOUT_S)
    except Exception as exc:  # never fail the action recorded
        log.error(
            "AUDIT NOT WRITTEN (%s: %s): action=%s who=%s what=%s why=%s outcome=%s detail=%s",
            type(exc).__name__,
            exc,
            action,
            who,
            what,
            why,
            outcome,
            detail,
        )
        return False
    return True


async def record_raised(
    js: JetStreamContext, action: str, who: str, what: str, why: str, exc: BaseException
) -> bool:
    """Record an action that raised before it was done: ``refused`` when it raised a
    ``JetfleetError`` (what the operator asked cannot be done: no such letter, a replay
    admission would refuse), else ``failed``. For the commands that execute their
    actions themselves (the CLI's ``target``, ``dlq replay`` and ``dlq purge``), so a
    refused or broken attempt is in the log like the leaser's."""
    outcome: AuditOutcome = "refused" if isinstance(exc, JetfleetError) else "failed"
    return await record_action(js, action, who, what, why, str(exc)[:1024], outcome=outcome)


@dataclass(frozen=True)
class AuditRecord:
    """An entry as read back, with when the server stored it."""

    entry: AuditEntry
    at: datetime
    seq: int


async def read_actions(js: JetStreamContext, since: datetime | None) -> AsyncIterator[AuditRecord]:
    """Every audit entry stored at or after ``since`` (server time; None: all), in order."""
    try:
        async for msg in read_stream(js, subjects.STREAM_AUDIT, f"{subjects.AUDIT}.>", since):
            try:
                entry = _decoder.decode(msg.data)
            except msgspec.MsgspecError as exc:
                log.warning(
                    "skipped an undecodable audit entry (seq %d): %s",
                    msg.metadata.sequence.stream,
                    exc,
                )
                continue
            yield AuditRecord(entry, msg.metadata.timestamp, msg.metadata.sequence.stream)
    except NotFoundError:
        return
