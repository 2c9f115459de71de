"""OpenTelemetry tracing: one job is one trace, across every process and attempt.

``setup_tracing`` installs an exporter from the standard ``OTEL_*`` variables (none set:
nothing is installed, and every helper here returns at once); ``inject``/``extract`` carry
W3C trace context in NATS headers; ``span`` and ``note`` make and describe spans;
``shutdown_tracing`` flushes at exit. docs/tracing.md lists the spans.
"""

from jetfleet.tracing.calls import call_attributes, call_name, note_reply
from jetfleet.tracing.export_setup import (
    TraceExport,
    setup_tracing,
    shutdown_tracing,
    traced_process,
    tracing_on,
)
from jetfleet.tracing.headers import extract, inject, trace_headers
from jetfleet.tracing.http_spans import http_trace_config
from jetfleet.tracing.spans import (
    ATTEMPT,
    FENCE,
    IDENTITY,
    JOB_ID,
    OUTCOME,
    REASON,
    TARGET,
    VERSION_TUPLE_ID,
    WORKER_ID,
    annotate,
    messaging,
    note,
    record_error,
    span,
)

__all__ = [
    "ATTEMPT",
    "FENCE",
    "IDENTITY",
    "JOB_ID",
    "OUTCOME",
    "REASON",
    "TARGET",
    "VERSION_TUPLE_ID",
    "WORKER_ID",
    "TraceExport",
    "annotate",
    "call_attributes",
    "call_name",
    "extract",
    "http_trace_config",
    "inject",
    "messaging",
    "note",
    "note_reply",
    "record_error",
    "setup_tracing",
    "shutdown_tracing",
    "span",
    "trace_headers",
    "traced_process",
    "tracing_on",
]
