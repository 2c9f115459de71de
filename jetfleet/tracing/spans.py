"""Starting spans and noting their outcome, at no cost while tracing is off.

Attribute names follow OpenTelemetry's messaging conventions (``messaging.*``, with
``messaging.system = "nats"``, a custom value) and name jetfleet's own facts under
``jetfleet.*``. Control-flow outcomes (retry later, lost lease, refused) set the span's
status with a reason; only exceptions are recorded as exceptions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from jetfleet.tracing.export_setup import tracer

JOB_ID = "jetfleet.job.id"
TARGET = "jetfleet.target"
ATTEMPT = "jetfleet.attempt"
WORKER_ID = "jetfleet.worker.id"
IDENTITY = "jetfleet.identity"
VERSION_TUPLE_ID = "jetfleet.version_tuple.id"
OUTCOME = "jetfleet.outcome"
REASON = "jetfleet.reason"
FENCE = "jetfleet.fence"

Attributes = Mapping[str, AttributeValue]

# One shared do-nothing context: the off path builds nothing per call.
_OFF: AbstractContextManager[Span] = contextlib.nullcontext(INVALID_SPAN)


def span(
    name: str,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: Context | None = None,
    attributes: Attributes | None = None,
) -> AbstractContextManager[Span]:
    """A span made current for the ``with`` block; ``parent`` None: the current context.

    An exception leaving the block is recorded on it with status ERROR (cancellation is
    not). Off: a shared no-op context yielding the invalid span.
    """
    active = tracer()
    if active is None:
        return _OFF
    return active.start_as_current_span(name, context=parent, kind=kind, attributes=attributes)


def messaging(subject: str, operation: str) -> dict[str, AttributeValue]:
    """The messaging attributes of a span about ``subject`` (send, receive, process, settle)."""
    return {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.operation.type": operation,
    }


def note(outcome: str, reason: str = "", error: bool = False, target: Span | None = None) -> None:
    """Set ``jetfleet.outcome`` (and ``jetfleet.reason``) on ``target`` (default: the
    current span); ``error`` sets status ERROR with the reason, not an exception."""
    current = target if target is not None else trace.get_current_span()
    if not current.is_recording():
        return
    current.set_attribute(OUTCOME, outcome)
    if reason:
        current.set_attribute(REASON, reason)
    if error:
        current.set_status(Status(StatusCode.ERROR, reason or outcome))


def annotate(attributes: Attributes, target: Span | None = None) -> None:
    """Add ``attributes`` to ``target`` (default: the current span), learnt mid-way."""
    current = target if target is not None else trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


def record_error(exc: BaseException) -> None:
    """Record ``exc`` on the current span with status ERROR (a failure, not a signal)."""
    current = trace.get_current_span()
    if current.is_recording():
        current.record_exception(exc)
        current.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
