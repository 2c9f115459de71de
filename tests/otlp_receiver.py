"""An in-process OTLP/HTTP trace receiver for tests: it keeps every span posted to it,
each with its resource's ``service.name``."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from jetfleet.dev.embedded import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as exported, with the service that sent it."""

    service: str
    span: Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    def attribute(self, key: str) -> object:
        for kv in self.span.attributes:
            if kv.key == key:
                return _value(kv.value)
        return None


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@dataclass
class OtlpReceiver:
    """Serves ``POST /v1/traces`` on a free loopback port."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        """The base URL to give as ``OTEL_EXPORTER_OTLP_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """Every span received so far of one trace."""
        return [s for s in self.spans if s.trace_id == trace_id]

    async def _traces(self, request: web.Request) -> web.Response:
        body = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in body.resource_spans:
            service = next(
                (
                    str(_value(kv.value))
                    for kv in resource_spans.resource.attributes
                    if kv.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(ReceivedSpan(service, s) for s in scope_spans.spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )
