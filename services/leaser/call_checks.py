"""What the leaser refuses in a lease call or quarantine command that its type admits:
a target it does not declare, a quarantine record out of bounds. The wire types bound
the rest (schemas/names.py); a quarantine record is checked here instead, because the
same type is what ``jf-control`` keeps, and records kept before these bounds must still
be read."""

from __future__ import annotations

import msgspec
from jetfleet.schemas.lease import (
    LeaseCall,
    LeaseRefusal,
    LeaseRequest,
    QuarantineCommand,
    QuarantineRecord,
    QuarantineReply,
    QuarantineSet,
)
from jetfleet.schemas.names import RequiredName, TargetName

from jetfleet.errors import ConfigError
from jetfleet.settings import Settings

UNKNOWN_TARGET = "unknown-target"
QUARANTINE_MAX_FOR_S = 366 * 24 * 3600.0
"""The longest timed quarantine (a year); for longer, quarantine until released."""
QUARANTINE_MAX_REASON_CHARS = 1024
QUARANTINE_MAX_SET_BY_CHARS = 128
QUARANTINE_MAX_EVIDENCE = 100
"""As many outcome events as ``quarantine.max_evidence`` may name."""


def undeclared(settings: Settings, target: str, service: str) -> str | None:
    """What to fix when ``target`` is not declared in ``service``'s settings, or None."""
    try:
        settings.target(target)
    except ConfigError as exc:
        return f"{exc} of the {service} (and restart it), or use a declared target"
    return None


def refuse_lease_call(settings: Settings, call: LeaseCall) -> LeaseRefusal | None:
    """A grant for a target the leaser does not declare is refused, never granted: no
    cap, quarantine or pause of this leaser could apply to it."""
    if not isinstance(call, LeaseRequest):
        return None
    why = undeclared(settings, call.target, "leaser")
    return LeaseRefusal(reason=UNKNOWN_TARGET, detail=why) if why else None


def refuse_command(settings: Settings, command: QuarantineCommand) -> QuarantineReply | None:
    """A quarantine set that is out of bounds, with what to fix. A release may name any
    valid target (one dropped from the settings may still have records to lift)."""
    if not isinstance(command, QuarantineSet):
        return None
    why = record_objection(settings, command.record)
    return QuarantineReply(ok=False, detail=f"quarantine not set: {why}") if why else None


def record_objection(settings: Settings, record: QuarantineRecord) -> str | None:
    """What is wrong with a quarantine record to be set, or None."""
    for field, value, bound in (
        ("name", record.name, RequiredName),
        ("target", record.target, TargetName),
    ):
        try:
            msgspec.convert(value, bound)
        except msgspec.ValidationError as exc:
            return f"record.{field}: {exc}"
    why = undeclared(settings, record.target, "leaser")
    if why:
        return f"record.target: {why}"
    if not 0 <= record.for_s <= QUARANTINE_MAX_FOR_S:
        return (
            f"record.for_s is {record.for_s}: give a duration from 0 (until released) to "
            f"{QUARANTINE_MAX_FOR_S:.0f} s (366 days); for longer, use 0 and release it"
        )
    if len(record.reason) > QUARANTINE_MAX_REASON_CHARS or not record.reason.isprintable():
        return (
            f"record.reason: at most {QUARANTINE_MAX_REASON_CHARS} printable characters "
            f"(it is {len(record.reason)}, shown in every refusal and log line)"
        )
    return _provenance_objection(record)


def _provenance_objection(record: QuarantineRecord) -> str | None:
    """What is wrong with who set the record and the evidence it names, or None."""
    if len(record.set_by) > QUARANTINE_MAX_SET_BY_CHARS or not record.set_by.isprintable():
        return f"record.set_by: at most {QUARANTINE_MAX_SET_BY_CHARS} printable characters"
    if len(record.evidence) > QUARANTINE_MAX_EVIDENCE:
        return (
            f"record.evidence names {len(record.evidence)} outcome events: at most "
            f"{QUARANTINE_MAX_EVIDENCE}"
        )
    for n, item in enumerate(record.evidence):
        if len(item.job_id) > 128 or len(item.reason) > 64 or item.seq < 0:
            return (
                f"record.evidence[{n}]: a job id of at most 128 characters, a reason of at "
                "most 64 and a stream sequence >= 0"
            )
    return None
