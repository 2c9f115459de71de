"""Tracing's set-up from the standard OTEL_* variables: nothing configured installs
nothing (no exporter, no provider, no headers); bad values are refused with the fix."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.trace import StatusCode

from jetfleet import tracing
from jetfleet.errors import ConfigError
from jetfleet.tracing import TraceExport


def test_with_no_otel_variables_setup_installs_no_exporter() -> None:
    before = trace.get_tracer_provider()
    assert tracing.setup_tracing("worker", {}) is None
    assert not tracing.tracing_on()
    assert trace.get_tracer_provider() is before
    assert tracing.inject() is None, "no headers built while off"
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    with tracing.span("anything") as span:
        assert not span.is_recording()
    tracing.shutdown_tracing()  # a no-op when off


def test_while_off_the_helpers_touch_no_span_not_even_another_providers() -> None:
    # A span some other tracer made current (a library user's own provider): jetfleet's
    # notes must not reach it while jetfleet's tracing is off (docs/tracing.md: off, no
    # helper touches the OpenTelemetry API).
    assert not tracing.tracing_on()
    theirs = TracerProvider().get_tracer("theirs").start_span("theirs")
    with trace.use_span(theirs, end_on_exit=True):
        tracing.note("ok", "why", error=True)
        tracing.annotate({tracing.JOB_ID: "j-1"})
        tracing.record_error(RuntimeError("boom"))
    assert isinstance(theirs, ReadableSpan)
    assert not theirs.attributes and not theirs.events
    assert theirs.status.status_code == StatusCode.UNSET


def test_trace_context_passes_through_while_off() -> None:
    headers = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "Nats-Msg-Id": "x"}
    assert tracing.trace_headers(headers) == {"traceparent": headers["traceparent"]}


@pytest.mark.parametrize(
    ("env", "exporter"),
    [
        ({}, "none"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1", "OTEL_TRACES_EXPORTER": "none"}, "none"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1", "OTEL_SDK_DISABLED": "true"}, "none"),
    ],
)
def test_the_exporter_is_read_from_the_standard_variables(
    env: dict[str, str], exporter: str
) -> None:
    assert TraceExport.from_env(env).exporter == exporter


def test_otel_service_name_wins_over_the_services_own_name() -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "edge-sink"}
    assert TraceExport.from_env(env).service_name == "edge-sink"


@pytest.mark.parametrize(
    ("env", "fix"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp (OTLP/HTTP), console or none"),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, "one of otlp"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "set it to http/protobuf",
        ),
    ],
)
def test_an_exporter_jetfleet_does_not_ship_is_refused_with_the_fix(
    env: dict[str, str], fix: str
) -> None:
    with pytest.raises(ConfigError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        TraceExport.from_env(env)


@pytest.fixture
def unanswering_collector() -> Iterator[str]:
    """An OTLP endpoint that takes connections and never answers (a hung collector)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_hung_collector_holds_the_exit_no_longer_than_the_exporter_timeout(
    unanswering_collector: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several batches queued, each export waiting out its timeout: without a bound on the
    # shutdown as a whole, the SDK's own join waits 30 s (docs/tracing.md promises the
    # exporter's timeout).
    timeout_s = 2.0
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", unanswering_collector)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", str(timeout_s))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    assert tracing.setup_tracing("worker", os.environ) is not None
    try:
        for _ in range(2048):
            with tracing.span("queued"):
                pass
    finally:
        started = time.monotonic()
        tracing.shutdown_tracing()
        took_s = time.monotonic() - started
    assert not tracing.tracing_on()
    assert took_s < timeout_s + 2.0, f"shutdown held the exit {took_s:.1f} s"


def test_an_exporter_timeout_that_is_no_number_is_refused_with_the_fix() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318", "OTEL_EXPORTER_OTLP_TIMEOUT": "10s"}
    with pytest.raises(ConfigError, match="seconds, such as 10"):
        TraceExport.from_env(env)


def test_a_propagator_named_in_otel_propagators_does_not_stop_jetfleet() -> None:
    # jetfleet carries W3C trace context only (docs/tracing.md); the SDK's global
    # propagator, read from OTEL_PROPAGATORS at import, raised on a name not installed
    # and so broke every command, tracing on or off.
    env = {**os.environ, "OTEL_PROPAGATORS": "b3", "OTEL_TRACES_EXPORTER": "console"}
    script = (
        "import os\n"
        "from jetfleet import tracing\n"
        "tracing.setup_tracing('worker', os.environ)\n"
        "with tracing.span('s'):\n"
        "    headers = tracing.inject()\n"
        "assert headers is not None and 'traceparent' in headers, headers\n"
        "assert tracing.extract(headers) is not None\n"
        "print('carried')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "carried" in done.stdout
