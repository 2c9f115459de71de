"""The worker's spans: one CONSUMER span per delivery (an attempt, a sibling of the job's
other attempts under its submit span), the handler span inside it, and the settle span.

Each is a no-op while tracing is off (``jetfleet.tracing``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from jetfleet import tracing
from jetfleet.schemas import WorkOrder
from jetfleet.worker.verdict import Verdict

ERROR_KINDS = frozenset({"retryable", "permanent", "blocked", "lost"})
"""Verdicts that end an attempt without a result: status ERROR with the reason (never
an exception: they are answers, not crashes)."""


def delivery_span(
    msg: Msg, worker_id: str, identity: str, version_id: str
) -> AbstractContextManager[Span]:
    """The span of one delivery of a work order, parented on the trace context its
    headers carry (the submit span's)."""
    if not tracing.tracing_on():
        return tracing.span("")
    attributes = tracing.messaging(msg.subject, "process")
    attributes.update(
        {
            tracing.ATTEMPT: msg.metadata.num_delivered or 1,
            tracing.WORKER_ID: worker_id,
            tracing.TARGET: msg.subject.split(".")[2] if msg.subject.count(".") >= 2 else "",
            tracing.VERSION_TUPLE_ID: version_id,
        }
    )
    if identity:
        attributes[tracing.IDENTITY] = identity
    parent = tracing.extract(msg.headers)
    return tracing.span(f"process {msg.subject}", SpanKind.CONSUMER, parent, attributes)


def order_read(order: WorkOrder) -> None:
    """Note the job the delivery's work order names on the delivery span."""
    tracing.annotate({tracing.JOB_ID: order.job.id, "messaging.message.id": order.job.id})


def handler_span(order: WorkOrder, attempt: int) -> AbstractContextManager[Span]:
    """The span of one run of the job's handler (its HTTP requests are its children)."""
    if not tracing.tracing_on():
        return tracing.span("")
    attributes: dict[str, AttributeValue] = {
        tracing.JOB_ID: order.job.id,
        tracing.ATTEMPT: attempt,
        "url.full": order.job.url,
    }
    return tracing.span(f"handler {order.job.handler}", attributes=attributes)


def verdict_noted(verdict: Verdict) -> Verdict:
    """Note ``verdict`` on the current span and return it."""
    reason = verdict.reason or verdict.attempt_reason
    tracing.note(verdict.kind, reason, error=verdict.kind in ERROR_KINDS)
    return verdict


def settle_span(msg: Msg, operation: str) -> AbstractContextManager[Span]:
    """The span of an ack or term of a delivery (``messaging.operation.type`` settle)."""
    if not tracing.tracing_on():
        return tracing.span("")
    attributes = tracing.messaging(msg.subject, "settle")
    attributes["messaging.operation.name"] = operation
    return tracing.span(f"{operation} {msg.subject}", SpanKind.CLIENT, attributes=attributes)
