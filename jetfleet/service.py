"""Running a service: start, serve until SIGINT/SIGTERM, drain, close."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from typing import Protocol

from jetfleet.metrics import MetricFamily, MetricsServer, ServiceMeters, otlp_requested

log = logging.getLogger(__name__)


class Service(Protocol):
    """What every jetfleet service (and the worker) provides."""

    name: str

    @property
    def metrics(self) -> Sequence[MetricFamily]:
        """What ``/metrics`` shows for it."""

    async def start(self) -> None:
        """Connect, declare what it needs, and start serving."""

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking new work; finish or release in-flight work; then close."""


async def serve_until_signalled(
    service: Service,
    drain_timeout_s: float = 30.0,
    metrics_port: int | None = None,
    stop: asyncio.Event | None = None,
    metrics_host: str = "127.0.0.1",
) -> None:
    """Start ``service`` and run it until SIGINT or SIGTERM (or until ``stop`` is set, by
    the service itself), then drain it.

    With ``metrics_port`` (0 picks a free one) its metrics are served on ``/metrics`` at
    ``metrics_host`` (loopback unless told otherwise);
    with the standard ``OTEL_METRICS_EXPORTER=otlp`` or
    ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` they are also pushed over OTLP/HTTP.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    # After start: some families are made there (the sink's backstop).
    otlp = otlp_requested(os.environ)
    exporter = None
    meters = None
    if metrics_port is not None:
        exporter = MetricsServer(
            service.metrics, metrics_host, metrics_port, service=service.name, otlp=otlp
        )
        port = await exporter.start()
        log.info("%s metrics on http://%s:%d/metrics", service.name, metrics_host, port)
    elif otlp:
        meters = ServiceMeters(service.name, service.metrics, prometheus=False, otlp=True)
    log.info("%s started", service.name)
    try:
        await stop.wait()
        log.info("%s draining", service.name)
        await service.drain(drain_timeout_s)
    finally:
        # Whatever the drain did: no listener nor OTLP export thread outlives it.
        if exporter is not None:
            await exporter.stop()
        if meters is not None:
            meters.shutdown()
    log.info("%s stopped", service.name)
