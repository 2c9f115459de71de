"""A CLIENT span per HTTP request a worker's handler sends (aiohttp trace hooks).

The span carries ``http.request.method``, ``url.full`` and ``http.response.status_code``
and is a child of the handler span that sent it. No trace context is sent to the target:
its site is not ours to put headers on.
"""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from jetfleet.tracing.export_setup import tracer

_SPAN_KEY = "jetfleet_span"


def http_trace_config() -> aiohttp.TraceConfig:
    """Hooks for ``aiohttp.ClientSession(trace_configs=[...])``; each does nothing while
    tracing is off."""
    config = aiohttp.TraceConfig()
    config.on_request_start.append(_started)
    config.on_request_end.append(_ended)
    config.on_request_exception.append(_failed)
    return config


async def _started(
    session: aiohttp.ClientSession,
    context: SimpleNamespace,
    params: aiohttp.TraceRequestStartParams,
) -> None:
    active = tracer()
    if active is None:
        return
    attributes = {"http.request.method": params.method, "url.full": str(params.url)}
    span = active.start_span(params.method, kind=SpanKind.CLIENT, attributes=attributes)
    setattr(context, _SPAN_KEY, span)


async def _ended(
    session: aiohttp.ClientSession, context: SimpleNamespace, params: aiohttp.TraceRequestEndParams
) -> None:
    span: Span | None = getattr(context, _SPAN_KEY, None)
    if span is None:
        return
    status = params.response.status
    span.set_attribute("http.response.status_code", status)
    if status >= 400:
        span.set_status(Status(StatusCode.ERROR, str(status)))
    span.end()


async def _failed(
    session: aiohttp.ClientSession,
    context: SimpleNamespace,
    params: aiohttp.TraceRequestExceptionParams,
) -> None:
    span: Span | None = getattr(context, _SPAN_KEY, None)
    if span is None:
        return
    span.record_exception(params.exception)
    span.set_attribute("error.type", type(params.exception).__name__)
    span.set_status(Status(StatusCode.ERROR, f"{type(params.exception).__name__}"))
    span.end()
