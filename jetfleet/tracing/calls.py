"""Span names and attributes of the request/reply calls (lease, permit, report), the
same on the caller's CLIENT span and the service's SERVER span."""

from __future__ import annotations

from opentelemetry.util.types import AttributeValue

from jetfleet.schemas import Failure, SinkReply, Success
from jetfleet.schemas.lease import (
    LeaseAlreadyDone,
    LeaseGrant,
    LeaseRefusal,
    LeaseRelease,
    LeaseRenew,
    LeaseRequest,
)
from jetfleet.schemas.permit import (
    HoldPlaced,
    HoldRequest,
    PermitAllowed,
    PermitRefused,
    PermitRequest,
    PermitWait,
)
from jetfleet.schemas.report import Malformed
from jetfleet.tracing import spans

_NAMES: dict[type, str] = {
    LeaseRequest: "lease grant",
    LeaseRenew: "lease renew",
    LeaseRelease: "lease release",
    PermitRequest: "permit",
    HoldRequest: "hold",
    Success: "commit",
    Failure: "dead letter",
    Malformed: "keep malformed",
}
SINK_ERRORS = frozenset({"error"})
"""Sink answers that are failures; the rest (fenced out, expired, busy) are answers."""


def call_name(call: object, service: str = "") -> str:
    """The span name of a call: ``lease grant``, ``permit``, ``commit``, ...; another
    request is named by its service and type."""
    name = _NAMES.get(type(call))
    return name if name is not None else f"{service} {type(call).__name__}".strip()


def call_attributes(call: object) -> dict[str, AttributeValue]:
    """What a call says about its job: id, target, worker, identity, attempt, fence and
    version tuple id, as far as it carries them."""
    found: dict[str, AttributeValue] = {}
    if isinstance(call, LeaseRequest):
        found = {spans.JOB_ID: call.job_id, spans.TARGET: call.target, spans.WORKER_ID: call.worker}
        found[spans.VERSION_TUPLE_ID] = call.versions.id
        found[spans.IDENTITY] = call.identity
    elif isinstance(call, LeaseRenew | LeaseRelease):
        found = {spans.JOB_ID: call.job_id, spans.FENCE: call.fence}
    elif isinstance(call, PermitRequest | HoldRequest):
        found = {spans.TARGET: call.target, spans.WORKER_ID: call.worker}
        if isinstance(call, PermitRequest):
            found[spans.IDENTITY] = call.identity
    elif isinstance(call, Success | Failure):
        found = {
            spans.JOB_ID: call.order.job.id,
            spans.TARGET: call.order.target,
            spans.WORKER_ID: call.worker,
            spans.IDENTITY: call.identity,
            spans.FENCE: call.fence,
            spans.VERSION_TUPLE_ID: call.versions.id,
        }
        if isinstance(call, Success):
            found[spans.ATTEMPT] = call.attempt
    return {k: v for k, v in found.items() if v != ""}


def note_reply(reply: object) -> None:
    """Note a call's answer on the current span: granted, refused (reason), allowed,
    wait, committed, dead-lettered, ...; only a sink ``error`` is an ERROR status."""
    if isinstance(reply, SinkReply):
        spans.note(reply.status, reply.detail, error=reply.status in SINK_ERRORS)
    elif isinstance(reply, LeaseGrant):
        spans.note("granted")
        spans.annotate({spans.FENCE: reply.fence, spans.ATTEMPT: reply.attempt})
    elif isinstance(reply, LeaseRefusal):
        spans.note("refused", reply.reason)
    elif isinstance(reply, LeaseAlreadyDone):
        spans.note("already-done")
    elif isinstance(reply, PermitAllowed):
        spans.note("allowed")
    elif isinstance(reply, PermitWait):
        spans.note("wait", reply.limit)
    elif isinstance(reply, PermitRefused):
        spans.note("refused", reply.reason)
    elif isinstance(reply, HoldPlaced):
        spans.note("held")
    elif reply is not None:
        spans.note(type(reply).__name__)
    else:
        spans.note("unanswered", "no reply", error=True)
