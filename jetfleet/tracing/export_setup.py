"""Installing the process's tracer provider from the standard ``OTEL_*`` variables.

Nothing configured (no ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
or ``OTEL_TRACES_EXPORTER``), ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``:
no provider is installed, and every helper in ``jetfleet.tracing`` returns before it
touches the OpenTelemetry API (no span, no header, no exporter thread).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from jetfleet.errors import ConfigError

log = logging.getLogger(__name__)

ExporterName = Literal["none", "otlp", "console"]
_ENDPOINT_KEYS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_KEYS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
TRACER_NAME = "jetfleet"


@dataclass(frozen=True)
class TraceExport:
    """Where this process's spans go, read once from the environment."""

    exporter: ExporterName
    service_name: str = ""
    """``OTEL_SERVICE_NAME`` when set: it wins over the jetfleet service's own name."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TraceExport:
        """Read ``OTEL_SDK_DISABLED``, ``OTEL_TRACES_EXPORTER``, the OTLP endpoint and
        protocol variables, and ``OTEL_SERVICE_NAME`` from ``env``.

        Raises:
            ConfigError: an exporter or protocol jetfleet does not ship.
        """
        service_name = env.get("OTEL_SERVICE_NAME", "").strip()
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls("none", service_name)
        names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
        names = [n for n in names if n]
        if not names:
            configured = any(env.get(k, "").strip() for k in _ENDPOINT_KEYS)
            names = ["otlp" if configured else "none"]
        if len(names) > 1 or names[0] not in ("none", "otlp", "console"):
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER={env.get('OTEL_TRACES_EXPORTER')!r}: jetfleet exports "
                "traces with one of otlp (OTLP/HTTP), console or none; set one of those"
            )
        exporter: ExporterName = names[0]  # type: ignore[assignment]
        if exporter == "otlp":
            _refuse_grpc(env)
        return cls(exporter, service_name)


def _refuse_grpc(env: Mapping[str, str]) -> None:
    for key in _PROTOCOL_KEYS:
        protocol = env.get(key, "").strip()
        if protocol and protocol != "http/protobuf":
            raise ConfigError(
                f"{key}={protocol!r}: jetfleet ships the OTLP/HTTP exporter only; set it to "
                "http/protobuf (Jaeger and the OpenTelemetry Collector take it on :4318)"
            )


_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None


def setup_tracing(
    service: str, env: Mapping[str, str], attributes: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """Install a tracer provider for ``service`` if ``env`` asks for an exporter.

    ``service.name`` is ``OTEL_SERVICE_NAME`` when set, else ``service``; ``attributes``
    (a worker's id, say) join the resource, beside ``OTEL_RESOURCE_ATTRIBUTES``. Spans go
    through a ``BatchSpanProcessor``: call ``shutdown_tracing`` before exit.

    Returns:
        The provider, or None when tracing stays off (then nothing is installed).

    Raises:
        ConfigError: an exporter or protocol jetfleet does not ship.
    """
    global _provider, _tracer
    config = TraceExport.from_env(env)
    if config.exporter == "none":
        return None
    resource_attributes = {
        SERVICE_NAME: config.service_name or service,
        "jetfleet.service": service,
        **(attributes or {}),
    }
    if "jetfleet.worker.id" in resource_attributes:
        resource_attributes.setdefault(
            SERVICE_INSTANCE_ID, resource_attributes["jetfleet.worker.id"]
        )
    provider = TracerProvider(resource=Resource.create(resource_attributes))
    provider.add_span_processor(BatchSpanProcessor(_exporter(config.exporter)))
    trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer(TRACER_NAME)
    log.info("tracing on: %s spans exported (%s)", service, config.exporter)
    return provider


def _exporter(name: ExporterName) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    # Imported only when asked for: it pulls in requests and protobuf.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers and timeout from the OTEL_* variables


def tracer() -> trace.Tracer | None:
    """The jetfleet tracer, or None while tracing is off (the hot path's one check)."""
    return _tracer


def tracing_on() -> bool:
    """Whether ``setup_tracing`` installed a provider in this process."""
    return _provider is not None


@contextmanager
def traced_process(
    service: str, env: Mapping[str, str], attributes: Mapping[str, str] | None = None
) -> Iterator[TracerProvider | None]:
    """``setup_tracing`` for the block, then ``shutdown_tracing`` however it ends (so the
    spans of a graceful stop are exported before the process exits)."""
    provider = setup_tracing(service, env, attributes)
    try:
        yield provider
    finally:
        shutdown_tracing()


def shutdown_tracing() -> None:
    """Export the spans still queued, then stop the exporter (a no-op when off).

    Blocks for at most the exporter's timeout (``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s) when
    the collector does not answer."""
    global _provider, _tracer
    if _provider is None:
        return
    provider, _provider, _tracer = _provider, None, None
    provider.shutdown()
