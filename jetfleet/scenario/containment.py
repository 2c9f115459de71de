"""The containment walkthrough (issue 10): a block streak on one identity, its
retirement by the quarantine service's rule, and the requeue of its work elsewhere.

Real nats-server and redis-server (embedded, on free ports), real scheduler, ratelimit,
leaser, sink and quarantine service, and three real workers (``jetfleet.worker.Worker``)
with declared identities. The simulator plays the site: three of the shop's pages
challenge their first request. Every figure is read back from the streams, the
quarantine records and the simulator, never from a script's own counts.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.client import submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import EmbeddedNats, EmbeddedRedis
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.quarantine_view import read_quarantines
from jetfleet.outcome_events import read_outcomes
from jetfleet.results import iter_results
from jetfleet.scenario.ledger import Event
from jetfleet.schemas import Job, Outcome
from jetfleet.schemas.breaker import BreakerAlert
from jetfleet.schemas.lease import QuarantineRecord
from jetfleet.service import Service
from jetfleet.services.leaser import Leaser
from jetfleet.services.leaser.quarantine_book import QuarantineBook
from jetfleet.services.quarantine import QuarantineService
from jetfleet.services.ratelimit import RateLimiter
from jetfleet.services.scheduler import Scheduler
from jetfleet.services.sink import Sink
from jetfleet.settings import (
    FleetSettings,
    IdentitySettings,
    NatsSettings,
    RedisSettings,
    Settings,
    TargetSettings,
    WorkerSettings,
)
from jetfleet.simulator import SimulatorConfig, TargetSimulator, most_in_any_window
from jetfleet.stream_reader import read_stream
from jetfleet.topology import declare
from jetfleet.worker import Worker

SHOP = "shop"
NEWS = "news"
SHOP_RATE = 20.0
SHOP_BURST = 5
BLOCKED = ("w-north", "p-osaka")
OTHERS = (("w-south", "p-lisbon"), ("w-west", "p-aarhus"))
IDENTITIES = {
    "p-osaka": IdentitySettings(region="eu", subnet="10.1.0.0/24"),
    "p-lisbon": IdentitySettings(region="eu", subnet="10.1.0.0/24"),
    "p-aarhus": IdentitySettings(region="eu", subnet="10.2.0.0/24"),
}
STREAK = 3
"""Shop pages that challenge their first request: the default rule retires an identity
after three refusals on one target within 600 s."""
IN_FLIGHT = 4
SLOW_S = 12.0
"""The shop pages p-osaka is still waiting on when it is retired: their leases are
revoked and the jobs requeued at once."""
NEWS_PAGES = 3
DEADLINE_S = 60.0

EXPECTED = {
    "challenges_met": STREAK,
    "retirements": 1,
    "retired_on_other_targets": 0,
    "requeued_committed_elsewhere": IN_FLIGHT,
    "revoked_committed_by_retired": 0,
    "shop_requests_by_retired_after_retirement": 0,
    "news_commits_by_retired": NEWS_PAGES,
    "second_order_retirements": 0,
    "egress_proposals": 0,
    "breakers_opened": 0,
    "side_effects": STREAK + IN_FLIGHT + NEWS_PAGES,
    "distinct_jobs": STREAK + IN_FLIGHT + NEWS_PAGES,
}
"""What a run must show: the streak retires p-osaka on shop only, its work in flight
there is committed by the other identities, and it keeps committing for news."""


class ContainmentRun(msgspec.Struct):
    """One run of the containment walkthrough, as ``--json`` prints it."""

    events: list[Event]
    figures: dict[str, int]
    expected: dict[str, int]
    matches: bool
    shop_max_1s: int
    """The most requests the shop saw in any 1 s (its cap: rate + burst)."""
    shop_cap_1s: int


def containment_settings(nats_url: str, redis_url: str, shop_url: str, news_url: str) -> Settings:
    """Two targets on two simulators, three declared identities, the default rules."""

    def site(base_url: str, rate: float, burst: int) -> TargetSettings:
        return TargetSettings(
            base_url=base_url + "/",
            max_attempts=3,
            timeout_s=30.0,
            max_in_flight=16,
            rate=rate,
            burst=burst,
        )

    return Settings(
        nats=NatsSettings(url=nats_url),
        redis=RedisSettings(url=redis_url),
        fleet=FleetSettings(
            retry_base_s=0.2,
            # A challenge holds the shop for the worker that met it, at least this long,
            # growing with its streak: the streak of three takes a few seconds.
            retry_max_backoff_s=0.5,
            user_agent="jetfleet-scenario (+loopback)",
        ),
        worker=WorkerSettings(concurrency=8, region="eu"),
        targets={
            SHOP: site(shop_url, SHOP_RATE, SHOP_BURST),
            NEWS: site(news_url, 50.0, 10),
        },
        identities=IDENTITIES,
    )


async def run_containment() -> ContainmentRun:
    """One run against fresh servers; returns what it saw."""
    with tempfile.TemporaryDirectory(prefix="jetfleet-containment-") as folder:
        nats = await asyncio.to_thread(EmbeddedNats(Path(folder) / "nats").start)
        try:
            redis = await asyncio.to_thread(EmbeddedRedis(Path(folder) / "redis").start)
            try:
                async with (
                    TargetSimulator(SimulatorConfig()) as shop,
                    TargetSimulator(SimulatorConfig()) as news,
                ):
                    settings = containment_settings(
                        nats.url, redis.url, shop.base_url, news.base_url
                    )
                    return await _Containment(settings, shop).run()
            finally:
                await asyncio.to_thread(redis.stop)
        finally:
            await asyncio.to_thread(nats.stop)


class _Containment:
    def __init__(self, settings: Settings, shop: TargetSimulator) -> None:
        self.settings = settings
        self.shop = shop
        self.events: list[Event] = []
        self.conns: list[NatsClient] = []
        self.services: list[Service] = []
        self.workers: list[Worker] = []

    def log(self, what: str, detail: str) -> None:
        self.events.append(Event(what=what, detail=detail))

    async def connect(self, name: str) -> NatsClient:
        self.conns.append(await connect_nats(self.settings.nats, name, role="admin"))
        return self.conns[-1]

    async def run(self) -> ContainmentRun:
        control = await self.connect("scenario-control")
        self.js = control.jetstream()
        await declare(self.js, self.settings)
        try:
            await self._start_services()
            self.book = QuarantineBook(self.js, await self.js.key_value(subjects.BUCKET_CONTROL))
            await self.book.start()
            try:
                return await self._steps()
            finally:
                await self.book.stop()
        finally:
            for worker in self.workers:
                await worker.drain(10.0)
            for service in reversed(self.services):
                await service.drain(5.0)
            for nc in self.conns:
                await nc.close()

    async def _start_services(self) -> None:
        s = self.settings
        self.services = [
            Scheduler(s, await self.connect("scheduler")),
            RateLimiter(s, await self.connect("ratelimit")),
            Leaser(s, await self.connect("leaser")),
            Sink(s, await self.connect("sink")),
            QuarantineService(s, await self.connect("quarantine")),
        ]
        for service in self.services:
            await service.start()

    async def _add_worker(self, worker_id: str, identity: str, targets: tuple[str, ...]) -> None:
        nc = await self.connect(worker_id)
        worker = Worker(self.settings, nc, worker_id, targets, identity=identity)
        await worker.start()
        self.workers.append(worker)

    async def _steps(self) -> ContainmentRun:
        worker_id, identity = BLOCKED
        await self._add_worker(worker_id, identity, (SHOP, NEWS))
        slow = [Job(id=f"s-{n}", url=f"/slow/{n}?delay={SLOW_S:g}") for n in range(IN_FLIGHT)]
        streak = [Job(id=f"c-{n}", url=f"/challenge/{n}?times=1") for n in range(STREAK)]
        news = [Job(id=f"n-{n}", url=f"/page/{n}") for n in range(NEWS_PAGES)]
        await submit_jobs(self.js, self.settings, SHOP, slow)
        await submit_jobs(self.js, self.settings, NEWS, news)
        store = await LeaseStore.open(self.js)

        async def holding_slow() -> bool:
            live = [x.record for x in await store.all_live() if x.record.worker == worker_id]
            return sum(1 for r in live if r.job_id.startswith("s-")) == IN_FLIGHT

        await self._until(holding_slow, f"{worker_id} holding the {IN_FLIGHT} slow pages")
        self.log(
            "submit",
            f"{NEWS_PAGES} news pages, and {IN_FLIGHT} shop pages that take {SLOW_S:g} s "
            f"each; only {worker_id} ({identity}) is running, and holds them all",
        )
        await submit_jobs(self.js, self.settings, SHOP, streak)
        self.log("submit", f"{STREAK} shop pages that challenge their first request")
        (record,) = await self._until(self._shop_records, "the retirement of p-osaka on shop")
        self.sent_when_retired = self._sent_by(worker_id)
        self.log(
            "streak",
            f"{identity} met {len(record.evidence)} challenges on {SHOP}: "
            + ", ".join(e.job_id for e in record.evidence),
        )
        self.log(
            "retire", f"{record.scope} {record.name} retired on {record.target} by {record.set_by}"
        )
        for other_id, other_identity in OTHERS:
            await self._add_worker(other_id, other_identity, (SHOP,))
        self.log("start", "w-south (p-lisbon) and w-west (p-aarhus) start, for shop only")
        every = len(slow) + len(streak) + len(news)
        await self._until(lambda: self._all_committed(every), f"all {every} jobs committed")
        return await self._figures(record)

    def _sent_by(self, worker_id: str) -> int:
        """Requests the shop has seen from ``worker_id`` (the worker header)."""
        return int(self.shop.counts()["by_client"].get(worker_id, 0))

    async def _shop_records(self) -> list[QuarantineRecord]:
        return [r for r in await self.book.all() if r.target == SHOP]

    async def _all_committed(self, count: int) -> bool:
        return len([r async for r in iter_results(self.js)]) >= count

    async def _until(self, ready: Callable[[], Awaitable[object]], what: str):  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        while not (found := await ready()):
            if loop.time() > deadline:
                raise TimeoutError(f"containment walkthrough: no {what} in {DEADLINE_S:g} s")
            await asyncio.sleep(0.1)
        return found

    async def _figures(self, retirement: QuarantineRecord) -> ContainmentRun:
        worker_id, identity = BLOCKED
        results = [r async for r in iter_results(self.js)]
        records = await self.book.all()
        outcomes = await _outcomes(self.js)
        revoked = [r for r in results if r.job_id.startswith("s-")]
        elsewhere = [r for r in revoked if r.identity != identity]
        figures = {
            "challenges_met": sum(
                1 for _, o in outcomes if o.identity == identity and o.reason == "challenged"
            ),
            "retirements": sum(1 for r in records if r.scope == "identity"),
            "retired_on_other_targets": sum(1 for r in records if r.target != SHOP),
            "requeued_committed_elsewhere": len(elsewhere),
            "revoked_committed_by_retired": len(revoked) - len(elsewhere),
            "shop_requests_by_retired_after_retirement": (
                self._sent_by(worker_id) - self.sent_when_retired
            ),
            "news_commits_by_retired": sum(
                1 for r in results if r.target == NEWS and r.identity == identity
            ),
            "second_order_retirements": sum(1 for r in records if r.second_order_of),
            # One identity of its subnet refused: no egress proposal (two are needed),
            # and no circuit breaker (three identities are): containment stays narrow.
            "egress_proposals": len((await read_quarantines(self.js)).proposals),
            "breakers_opened": sum(1 for a in await _alerts(self.js) if a.change == "opened"),
            "side_effects": len(results),
            "distinct_jobs": len({r.job_id for r in results}),
        }
        self.log(
            "requeue",
            f"the {len(elsewhere)} shop pages p-osaka held when it was retired were "
            "revoked, requeued and committed by "
            + ", ".join(sorted({r.identity for r in elsewhere}) or ["nobody"])
            + f"; {worker_id} sent the shop nothing more, and kept committing for {NEWS}",
        )
        stamps = [a.at for a in self.shop.arrivals() if a.kind != "robots"]
        return ContainmentRun(
            events=self.events,
            figures=figures,
            expected=EXPECTED,
            matches=figures == EXPECTED,
            shop_max_1s=most_in_any_window(stamps, 1.0),
            shop_cap_1s=int(SHOP_RATE) + SHOP_BURST,
        )


async def _alerts(js: JetStreamContext) -> list[BreakerAlert]:
    decoder = msgspec.json.Decoder(BreakerAlert)
    return [
        decoder.decode(msg.data)
        async for msg in read_stream(js, subjects.STREAM_ALERTS, "jf.alert.>")
    ]


async def _outcomes(js: object) -> list[tuple[int, Outcome]]:
    found = []
    async for msg in read_stream(js, subjects.STREAM_OUTCOMES, "jf.outcome.>"):  # type: ignore[arg-type]
        for event in read_outcomes(msg.subject, msg.data, msg.headers):
            if not isinstance(event, str):
                found.append((msg.metadata.sequence.stream, event))
    return found
