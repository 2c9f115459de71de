"""A real stack with a gateway in front, for the dashboard's tests: scheduler, leaser,
sink, ratelimit and a worker with an identity, over the real nats-server and Redis."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from jetfleet.schemas.lease import QuarantineProposal
from jetfleet.services.gateway import Gateway
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet.audit import AuditRecord, read_actions
from jetfleet.auth.credentials import settings_for_role
from jetfleet.connection import connect_nats
from jetfleet.ops.status import fleet_status
from jetfleet.quarantine_proposals import proposal_id, write_proposal
from jetfleet.settings import GatewaySettings, Settings
from tests.conftest import wait_for
from tests.stack import running_stack

TOKEN = "dashboard-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OK_JOBS = 6
DEAD_JOBS = 2
WORKER = "w-dash"
IDENTITY = "id-dash"


@dataclass
class DashboardStack:
    """The running stack, its gateway and an HTTP session."""

    settings: Settings
    nc: NatsClient
    gateway: Gateway
    http: aiohttp.ClientSession

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    async def post(
        self, path: str, body: Any = None, token: bool = True, raw: bytes | None = None
    ) -> tuple[int, Any]:
        data = raw if raw is not None else msgspec.json.encode(body if body is not None else {})
        headers = {"Content-Type": "application/json", **(AUTH if token else {})}
        async with self.http.post(self.gateway.url + path, data=data, headers=headers) as r:
            return r.status, await r.json()

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.gateway.url + path) as r:
            return r.status, await r.json()

    async def known_run(self) -> None:
        """Submit ``OK_JOBS`` pages and ``DEAD_JOBS`` missing pages through the gateway;
        return once each is committed or dead-lettered."""
        jobs = [{"id": f"ok-{n}", "url": f"/page/{n}"} for n in range(OK_JOBS)]
        jobs += [{"id": f"gone-{n}", "url": f"/missing/{n}"} for n in range(DEAD_JOBS)]
        status, answer = await self.post("/v1/targets/demo/jobs", jobs)
        assert status == 202, answer

        async def settled() -> bool:
            totals = (await fleet_status(self.js, self.settings)).totals
            return (totals.committed, totals.dead) == (OK_JOBS, DEAD_JOBS)

        await wait_for(settled, 60, "the known run to settle")

    async def propose(self, subnet: str) -> str:
        """Store an egress proposal for ``subnet`` on ``demo`` as the quarantine service
        would (scripted: no rule has to fire); its id."""
        id_ = proposal_id(subnet, "demo")
        proposal = QuarantineProposal(
            id=id_,
            subnet=subnet,
            target="demo",
            reason="3 identities blocked",
            for_s=600.0,
            set_by="rule:egress-test",
            identities=["id-x", "id-y"],
        )
        await write_proposal(self.js, proposal, ttl_s=600.0)
        return id_

    async def audit(self) -> list[AuditRecord]:
        return [record async for record in read_actions(self.js, None)]


@contextlib.asynccontextmanager
async def dashboard_stack(settings: Settings, nc: NatsClient) -> AsyncIterator[DashboardStack]:
    """The services, a worker with an identity, and a gateway with a token (reads open)."""
    async with running_stack(settings) as stack:
        await stack.add_worker(WORKER, identity=IDENTITY)
        own = msgspec.structs.replace(
            settings, gateway=GatewaySettings(port=0, token=TOKEN, open_reads=True)
        )
        conn = await connect_nats(settings.nats, "gateway", role="gateway")
        gateway = Gateway(settings_for_role(own, "gateway"), conn)
        await gateway.start()
        try:
            async with aiohttp.ClientSession() as http:
                yield DashboardStack(settings, nc, gateway, http)
        finally:
            await gateway.drain(5.0)
            await conn.close()
