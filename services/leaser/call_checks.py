"""What the leaser refuses in a lease call or quarantine command that its type admits:
a target it does not declare, a quarantine record out of bounds. The wire types bound
the rest (schemas/names.py); a quarantine record is checked here instead, because the
same type is what ``jf-control`` keeps, and records kept before these bounds must still
be read."""

from __future__ import annotations

import ipaddress

import msgspec
from jetfleet.schemas.lease import (
    LeaseCall,
    LeaseRefusal,
    LeaseRequest,
    QuarantineCommand,
    QuarantineRecord,
    QuarantineReject,
    QuarantineRelease,
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
    if isinstance(command, QuarantineReject) and not command.reason.isprintable():
        return QuarantineReply(ok=False, detail="reason: printable characters only")
    if isinstance(command, QuarantineRelease) and command.scope == "egress":
        why = subnet_objection(command.name)
        return QuarantineReply(ok=False, detail=f"quarantine not released: {why}") if why else None
    if not isinstance(command, QuarantineSet):
        return None
    why = record_objection(settings, command.record)
    return QuarantineReply(ok=False, detail=f"quarantine not set: {why}") if why else None


def subnet_objection(subnet: str) -> str | None:
    """What is wrong with ``subnet`` as an egress record's name, or None. It is compared
    with what workers send (``worker.subnet``) as written, so only the canonical spelling
    of a network is taken: any other would quarantine nobody."""
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as exc:
        return f"{subnet!r} is not a network ({exc}): give one such as 10.1.0.0/24"
    if str(network) != subnet:
        return f"write the subnet {subnet!r} as {str(network)!r}, as worker.subnet spells it"
    return None


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
    if record.scope == "egress":
        why = subnet_objection(record.name)
        if why:
            return f"record.name: {why}"
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
    for field in ("subnet", "second_order_of", "proposed_by"):
        value = getattr(record, field)
        if len(value) > 256 or not value.isprintable():
            return f"record.{field}: at most 256 printable characters"
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
