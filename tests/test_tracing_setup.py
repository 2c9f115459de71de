"""Tracing's set-up from the standard OTEL_* variables: nothing configured installs
nothing (no exporter, no provider, no headers); bad values are refused with the fix."""

from __future__ import annotations

import pytest
from opentelemetry import trace

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
