"""An in-process stack of services over real servers, for tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from jetfleet.services.leaser import Leaser
from jetfleet.services.quarantine import QuarantineService
from jetfleet.services.ratelimit import RateLimiter
from jetfleet.services.scheduler import Scheduler
from jetfleet.services.sink import Sink
from nats.aio.client import Client as NatsClient

from jetfleet.auth.credentials import settings_for_role
from jetfleet.auth.roles import Role
from jetfleet.connection import connect_nats
from jetfleet.ops.status import FleetStatus, fleet_status
from jetfleet.settings import Settings
from jetfleet.topology import declare
from jetfleet.worker import Worker


class InProcessStack:
    """Scheduler, sink and N workers, each on its own NATS connection as in production."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.connections: list[NatsClient] = []
        self.scheduler: Scheduler | None = None
        self.sink: Sink | None = None
        self.leaser: Leaser | None = None
        self.ratelimit: RateLimiter | None = None
        self.workers: list[Worker] = []
        self.quarantines: list[QuarantineService] = []

    async def _connect(self, name: str, role: Role = "admin") -> NatsClient:
        """A connection of its own, as ``role`` (the test's control connection: admin)."""
        nc = await connect_nats(self.settings.nats, name, role=role)
        self.connections.append(nc)
        return nc

    def _as(self, role: Role) -> Settings:
        """The settings a process of ``role`` runs with (its own Redis user)."""
        return settings_for_role(self.settings, role)

    async def start(self, workers: int = 1) -> None:
        control = await self._connect("test-control")
        await declare(control.jetstream(), self.settings)
        self.scheduler = Scheduler(
            self._as("scheduler"), await self._connect("scheduler", "scheduler")
        )
        await self.scheduler.start()
        await self.start_ratelimit()
        self.leaser = Leaser(self._as("leaser"), await self._connect("leaser", "leaser"))
        await self.leaser.start()
        await self.start_sink()
        for n in range(workers):
            await self.add_worker(f"w-{n}")

    async def start_sink(self) -> None:
        """Start a sink (again, after a test drained the first one)."""
        self.sink = Sink(self._as("sink"), await self._connect("sink", "sink"))
        await self.sink.start()

    async def start_ratelimit(self) -> RateLimiter:
        """Start a ratelimit replica (again, after a test drained the first one)."""
        self.ratelimit = RateLimiter(
            self._as("ratelimit"), await self._connect("ratelimit", "ratelimit")
        )
        await self.ratelimit.start()
        return self.ratelimit

    async def start_leaser(self) -> None:
        """Start a leaser (again, after a test drained the first one)."""
        self.leaser = Leaser(self._as("leaser"), await self._connect("leaser", "leaser"))
        await self.leaser.start()

    async def add_quarantine(self) -> QuarantineService:
        """Start a quarantine replica (tests that need rules start one or more)."""
        replica = QuarantineService(
            self._as("quarantine"), await self._connect("quarantine", "quarantine")
        )
        await replica.start()
        self.quarantines.append(replica)
        return replica

    async def add_worker(
        self, worker_id: str, identity: str = "", targets: tuple[str, ...] = ()
    ) -> Worker:
        """Start a worker serving ``targets`` (every target when empty)."""
        nc = await self._connect(worker_id, "worker")
        worker = Worker(self._as("worker"), nc, worker_id, targets, identity=identity)
        await worker.start()
        self.workers.append(worker)
        return worker

    async def status(self) -> FleetStatus:
        return await fleet_status(self.connections[0].jetstream(), self.settings)

    async def stop(self) -> None:
        """Drain the workers together, and beside them what they do not need to finish
        (the scheduler, the sink's backstop); then the services they reported to. Each
        drain waits out one long-poll fetch (``fleet.long_poll_s``): one after another
        they would cost that much each."""
        first = [worker.drain(5.0) for worker in self.workers]
        if self.scheduler is not None:
            first.append(self.scheduler.drain(5.0))
        if self.sink is not None:
            first.append(self.sink.stop_backstop(5.0))
        first += [replica.drain(5.0) for replica in self.quarantines]
        await asyncio.gather(*first)
        services = (self.sink, self.leaser, self.ratelimit)
        await asyncio.gather(*(s.drain(5.0) for s in services if s is not None))
        for nc in self.connections:
            await nc.close()


@contextlib.asynccontextmanager
async def running_stack(settings: Settings, workers: int = 0) -> AsyncIterator[InProcessStack]:
    """The services and ``workers`` workers (none by default), stopped on the way out."""
    stack = InProcessStack(settings)
    await stack.start(workers=workers)
    try:
        yield stack
    finally:
        await stack.stop()
