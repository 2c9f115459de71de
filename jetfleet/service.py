"""Running a service: start, serve until SIGINT/SIGTERM, drain, close."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Protocol

log = logging.getLogger(__name__)


class Service(Protocol):
    """What every jetfleet service (and the worker) provides."""

    name: str

    async def start(self) -> None:
        """Connect, declare what it needs, and start serving."""

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking new work; finish or release in-flight work; then close."""


async def serve_until_signalled(service: Service, drain_timeout_s: float = 30.0) -> None:
    """Start ``service`` and run it until SIGINT or SIGTERM, then drain it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    log.info("%s started", service.name)
    await stop.wait()
    log.info("%s draining", service.name)
    await service.drain(drain_timeout_s)
    log.info("%s stopped", service.name)
