"""W3C trace context (``traceparent``, ``tracestate``) in NATS message headers."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate
from opentelemetry.context import Context

from jetfleet.tracing.export_setup import tracing_on

TRACE_HEADERS = ("traceparent", "tracestate")


def inject(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` with the current span's trace context added (a new dict when None).

    Off: ``headers`` as given, untouched (None stays None, so nothing is built).
    """
    if not tracing_on():
        return headers
    carrier = {} if headers is None else headers
    propagate.inject(carrier)
    return carrier or headers


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The trace context a message carries, to parent the span that handles it; None
    when off or when it carries none (the span is then a root)."""
    if not headers or not tracing_on() or "traceparent" not in headers:
        return None
    return propagate.extract(headers)


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """Only the trace context of ``headers``, to pass on unchanged (on or off)."""
    return {k: v for k, v in (headers or {}).items() if k in TRACE_HEADERS}
