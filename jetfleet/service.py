"""Running a service: start, serve until SIGINT/SIGTERM, drain, close."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import Protocol

from jetfleet.metrics import MetricFamily, MetricsServer

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
) -> None:
    """Start ``service`` and run it until SIGINT or SIGTERM (or until ``stop`` is set, by
    the service itself), then drain it.

    With ``metrics_port`` (0 picks a free one) its counters are served on ``/metrics``.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    exporter = None
    if metrics_port is not None:
        exporter = MetricsServer(service.metrics, port=metrics_port)
        log.info("%s metrics on http://127.0.0.1:%d/metrics", service.name, await exporter.start())
    log.info("%s started", service.name)
    await stop.wait()
    log.info("%s draining", service.name)
    await service.drain(drain_timeout_s)
    if exporter is not None:
        await exporter.stop()
    log.info("%s stopped", service.name)
