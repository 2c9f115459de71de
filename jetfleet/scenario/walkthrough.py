"""The leasing walkthrough (issue: leases with fencing tokens), step by step.

Real nats-server, real scheduler, leaser and sink; three scripted workers speaking the
real protocol. Time is compressed ``SCALE`` times (a 30 s lease runs as 3 s of real
server time); every expiry is the server's, never a fake clock.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import aiohttp
import msgspec
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.client import submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import EmbeddedNats, EmbeddedRedis
from jetfleet.errors import PermanentFailure
from jetfleet.lease_store import LeaseStore
from jetfleet.results import iter_results
from jetfleet.scenario.actors import Actor, Dispatcher, Holding
from jetfleet.scenario.ledger import Ledger, Run
from jetfleet.schemas import DeadLetter, Job, NoopOutput
from jetfleet.schemas.lease import QuarantineRecord, QuarantineReply, QuarantineSet
from jetfleet.service import Service
from jetfleet.services.leaser import Leaser
from jetfleet.services.ratelimit import RateLimiter
from jetfleet.services.scheduler import Scheduler
from jetfleet.services.sink import Sink
from jetfleet.services.sink.commit import CommitPolicy
from jetfleet.settings import FleetSettings, NatsSettings, RedisSettings, Settings, TargetSettings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import read_stream
from jetfleet.worker.builtin import http_get
from jetfleet.worker.handlers import HandlerContext

SCALE = 0.1
TARGET = "scenario"
LEASE_S = 30.0
OVERRUN_S = 5.0
WORKERS = (
    ("w-north", "p-osaka", 0.0),
    ("w-south", "p-lisbon", -37.0),
    ("w-west", "p-aarhus", 12.0),
)


def scenario_settings(nats_url: str, base_url: str, redis_url: str) -> Settings:
    """A 30 s lease and an attempt cap of 3, compressed ``SCALE`` times."""
    return Settings(
        nats=NatsSettings(url=nats_url),
        redis=RedisSettings(url=redis_url),
        fleet=FleetSettings(
            lease_ttl_s=LEASE_S * SCALE,
            ack_wait_s=40.0 * SCALE,
            retry_base_s=0.1,
            retry_max_backoff_s=0.5,
            dedupe_ttl_s=3600.0,
            user_agent="jetfleet-scenario (+loopback)",
        ),
        targets={
            TARGET: TargetSettings(
                base_url=base_url + "/",
                max_attempts=3,
                rate=100.0,
                burst=50,  # the walkthrough is about leases, never about its rate
                max_in_flight=64,
                timeout_s=5.0,
            )
        },
    )


def scenario_jobs(base_url: str) -> list[Job]:
    """The walkthrough's jobs; j-103 is the poison message."""
    page = base_url + "/page/{}"
    return [
        Job(id="j-101", url=page.format(101)),
        Job(id="j-102", url=page.format(102)),
        Job(id="j-103", url=base_url + "/noselector/103", args={"expect": 'id="content"'}),
        Job(id="j-105", url=page.format(105)),
        Job(id="j-106", url=page.format(106)),
        Job(id="j-107", url=page.format(107), pin_identity="p-lisbon"),
    ]


async def run_walkthrough(dedupe: bool) -> Run:
    """One run against a fresh nats-server; returns what it saw."""
    with tempfile.TemporaryDirectory(prefix="jetfleet-scenario-") as folder:
        server = await asyncio.to_thread(EmbeddedNats(Path(folder) / "nats").start)
        try:
            # Its own Redis too: the in-flight places and rate cells of a replay never
            # land in a server the user runs.
            redis = await asyncio.to_thread(EmbeddedRedis(Path(folder) / "redis").start)
            try:
                async with TargetSimulator(SimulatorConfig()) as sim:
                    settings = scenario_settings(server.url, sim.base_url, redis.url)
                    return await _run(settings, sim.base_url, dedupe)
            finally:
                await asyncio.to_thread(redis.stop)
        finally:
            await asyncio.to_thread(server.stop)


async def _run(settings: Settings, base_url: str, dedupe: bool) -> Run:
    ledger = Ledger()
    conns: list[NatsClient] = []

    async def connect(name: str) -> NatsClient:
        conns.append(await connect_nats(settings.nats, name, role="admin"))
        return conns[-1]

    control = await connect("scenario-control")
    from jetfleet.topology import declare

    await declare(control.jetstream(), settings)
    services: list[Service] = [
        Scheduler(settings, await connect("scheduler")),
        RateLimiter(settings, await connect("ratelimit")),
        Leaser(settings, await connect("leaser")),
        Sink(settings, await connect("sink"), CommitPolicy(dedupe=dedupe)),
    ]
    for service in services:
        await service.start()
    try:
        actors = {
            name: Actor(name, identity, offset * SCALE, await connect(name), ledger)
            for name, identity, offset in WORKERS
        }
        await submit_jobs(control.jetstream(), settings, TARGET, scenario_jobs(base_url))
        walk = _Walk(settings, control, actors, ledger, dedupe)
        await walk.steps()
        results = [r.job_id async for r in iter_results(control.jetstream(), TARGET)]
        dead = [f"{d.order.job.id}:{d.reason}" async for d in _dead_letters(control)]
        await walk.cleanup()
    finally:
        for service in services:
            await service.drain(5.0)
        for nc in conns:
            await nc.close()
    return ledger.finish(dedupe, results, dead)


async def _dead_letters(nc: NatsClient):  # type: ignore[no-untyped-def]
    decoder = msgspec.json.Decoder(DeadLetter)
    async for msg in read_stream(nc.jetstream(), subjects.STREAM_DLQ, "jf.dlq.>"):
        yield decoder.decode(msg.data)


class _Walk:
    """The five steps, in order."""

    def __init__(
        self,
        settings: Settings,
        control: NatsClient,
        actors: dict[str, Actor],
        ledger: Ledger,
        dedupe: bool,
    ) -> None:
        self.settings = settings
        self.control = control
        self.js = control.jetstream()
        self.north, self.south, self.west = (actors[n] for n, _, _ in WORKERS)
        self.ledger = ledger
        self.dedupe = dedupe
        self.dispatch = Dispatcher(control, TARGET)
        self.held: list[tuple[Actor, Holding]] = []

    async def steps(self) -> None:
        """Run steps 1 to 5."""
        self.store = await LeaseStore.open(self.js)
        await self.step1_stolen_lease_and_lost_ack()
        await self.step2_overrun()
        await self.step3_quarantine()
        await self.step4_identity_pin()
        await self.step5_poison()

    async def step1_stolen_lease_and_lost_ack(self) -> None:
        log = self.ledger.log
        msg, order = await self.dispatch.take("j-101")
        south = await self.south.take(msg, order, renew=False)
        plan = LEASE_S - self.south.clock_offset_s / SCALE
        log(
            "plan",
            f"w-south's clock is {self.south.clock_offset_s / SCALE:+g} s off: it "
            f"plans {plan:g} s of headroom on a {LEASE_S:g} s lease; its clock decides "
            "nothing, the server's per-key TTL does",
        )
        msg, order = await self.dispatch.take("j-102")
        self.held.append((self.west, await self.west.take(msg, order)))
        await self._wait_expired("j-101")
        log("expired", "j-101's lease expired by the server's clock while w-south worked on")
        msg, order = await self.dispatch.take("j-101")
        north = await self.north.take(msg, order)
        log("supersede", f"fence {north.fence} supersedes w-south's fence {south.fence}")
        first = await self.north.commit(north, NoopOutput())
        await self.south.commit(south, NoopOutput())
        report = _resend_payload(self.north, north)
        log("lost-ack", "the sink's answer to w-north was lost: its commit is delivered again")
        await self.north.send_report("j-101", report)
        if first.status == "committed":
            await self.north.ack(north)

    async def step2_overrun(self) -> None:
        msg, order = await self.dispatch.take("j-105")
        held = await self.north.take(msg, order, renew=False)
        await self._wait_expired("j-105")
        # The overrun itself: w-north is still working OVERRUN_S after the server expired it.
        await asyncio.sleep(OVERRUN_S * SCALE)
        self.ledger.log("overrun", f"w-north runs {OVERRUN_S:g} s past the TTL, then commits")
        await self.north.commit(held, NoopOutput())

    async def step3_quarantine(self) -> None:
        record = QuarantineRecord(
            scope="worker", name="w-west", target=TARGET, reason="scenario: too many blocks"
        )
        answer = await self.control.request(
            subjects.QUARANTINE, msgspec.json.encode(QuarantineSet(record=record)), timeout=5
        )
        reply = msgspec.json.decode(answer.data, type=QuarantineReply)
        self.ledger.count("quarantines")
        self.ledger.count("reaped", len(reply.revoked))
        self.ledger.count("requeued", len(reply.revoked))
        self.ledger.log(
            "quarantine",
            f"w-west quarantined on {TARGET}; revoked and requeued "
            f"at once: {', '.join(reply.revoked) or 'nothing'}",
        )
        west = next(h for a, h in self.held if a is self.west)
        await asyncio.wait_for(west.lost.wait(), 5 * LEASE_S * SCALE)
        msg, _ = await self.dispatch.take("j-102", timeout_s=5.0)
        self.ledger.log(
            "requeued",
            f"j-102 is delivered again at once (delivery "
            f"{msg.metadata.num_delivered}), not after the visibility timeout",
        )
        await msg.nak(delay=5.0)  # nobody runs it in this walkthrough
        await self._refused_then_granted("j-106", self.west, self.south)

    async def step4_identity_pin(self) -> None:
        await self._refused_then_granted("j-107", self.north, self.south)

    async def step5_poison(self) -> None:
        msg, order = await self.dispatch.take("j-103")
        held = await self.north.take(msg, order)
        reason = await _run_handler(self.settings, held, self.north)
        await self.north.fail(held, reason)
        self.ledger.note(
            "j-103 fails with selector-removed, which is classified permanent: it is "
            "dead-lettered on its first failure instead of after 3 attempts, so requeued is "
            "1 here, two fewer than the reference's 3 (j-102's requeue only)"
        )
        self.ledger.note(
            "grants counts j-103's one grant too (the reference leaves j-103's grants out): "
            "7 here against the reference's 6"
        )

    async def _refused_then_granted(self, job_id: str, refused: Actor, granted: Actor) -> None:
        msg, order = await self.dispatch.take(job_id)
        await refused.ask(msg, order)
        await refused.hand_back(msg)
        msg, order = await self.dispatch.take(job_id)
        self.held.append((granted, await granted.take(msg, order)))

    async def _wait_expired(self, job_id: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10 * LEASE_S * SCALE
        while await self.store.live(job_id) is not None:
            if loop.time() > deadline:
                raise TimeoutError(f"{job_id}'s lease did not expire")
            await asyncio.sleep(0.05)

    async def cleanup(self) -> None:
        """Give back every lease still held."""
        for actor, held in self.held:
            if not held.lost.is_set():
                await actor.release(held)


def _resend_payload(actor: Actor, held: Holding) -> bytes:
    from jetfleet.scenario.actors import VERSIONS
    from jetfleet.schemas import Success

    return msgspec.json.encode(
        Success(
            order=held.order,
            worker=actor.name,
            attempt=held.attempt,
            duration_s=0.1,
            output=NoopOutput(),
            versions=VERSIONS,
            identity=actor.identity,
            fence=held.fence,
        )
    )


async def _run_handler(settings: Settings, held: Holding, actor: Actor) -> str:
    """Run the real http.get handler on the poison page; return its failure reason."""
    async with aiohttp.ClientSession() as session:
        ctx = HandlerContext(
            order=held.order,
            target=settings.targets[TARGET],
            attempt=held.attempt,
            worker_id=actor.name,
            identity=actor.identity,
            user_agent=settings.fleet.user_agent,
            session=session,
        )
        try:
            await http_get(ctx)
        except PermanentFailure as exc:
            return exc.reason
    raise RuntimeError("the poison page unexpectedly succeeded")
