"""Fixtures: real nats-server and redis-server processes, the target simulator, and an
in-process stack of services. Never mocks of NATS or Redis."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from nats.aio.client import Client as NatsClient

from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import EmbeddedNats, EmbeddedRedis
from jetfleet.lease_store import LeaseStore
from jetfleet.settings import (
    FleetSettings,
    NatsSettings,
    RedisSettings,
    Settings,
    TargetSettings,
    WorkerSettings,
)
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.topology import declare
from tests.stack import InProcessStack
from tests.user_servers import blocking, claim_redis_db, flush_test_db, redis_test_url, user_nats


@pytest.fixture(scope="session", autouse=True)
def _no_user_settings_leak_in() -> Iterator[None]:
    """In-process CLI calls read the environment: a user's ``JETFLEET_*`` overrides, config
    or dev stack must not reach them, nor a ``REDIS_URL`` naming the user's database."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("JETFLEET_")]:
            patch.delenv(name)
        if os.environ.get("REDIS_URL"):
            patch.setenv("REDIS_URL", redis_test_url(os.environ["REDIS_URL"]))
        yield


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    """A fresh nats-server (JetStream, temporary store) per test; or the server of
    NATS_URL, only while it has no jetfleet streams, which the test deletes when it ends
    (tests/user_servers.py)."""
    user_url = os.environ.get("NATS_URL")
    if user_url:
        with user_nats(user_url):
            yield user_url
        return
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(
    tmp_path_factory: pytest.TempPathFactory, _no_user_settings_leak_in: None
) -> Iterator[str]:
    """Database 15 of one redis-server per session (flushed per test by ``redis_client``):
    one the tests start, or the server of REDIS_URL if that database is empty or the
    tests' own (tests/user_servers.py). Never the database the URL names."""
    if os.environ.get("REDIS_URL"):
        url = os.environ["REDIS_URL"]  # already the tests' database, see above
        blocking(claim_redis_db(url))
        yield url
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    try:
        url = redis_test_url(server.url)
        blocking(claim_redis_db(url))
        yield url
    finally:
        server.stop()


@pytest.fixture(autouse=True)
async def _no_rate_state_from_earlier_tests(request: pytest.FixtureRequest) -> None:
    """Every test that uses Redis starts from an empty database: the session shares one,
    and a fleet-wide hold, a daily count or an in-flight place an earlier test left on
    its target (often ``demo``) would refuse this test's grants for minutes."""
    if "redis_url" not in request.fixturenames:
        return
    client = aioredis.from_url(request.getfixturevalue("redis_url"))
    try:
        await flush_test_db(client)
    finally:
        await client.aclose()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client of the tests' database, emptied first."""
    client = aioredis.from_url(redis_url)
    await flush_test_db(client)
    yield client
    await client.aclose()


@pytest.fixture
async def simulator() -> AsyncIterator[TargetSimulator]:
    async with TargetSimulator(SimulatorConfig()) as sim:
        yield sim


def make_settings(
    nats_url: str, redis_url: str, targets: dict[str, TargetSettings], **fleet: object
) -> Settings:
    """Settings for a test: fast retries, short timeouts, the given targets."""
    fleet_defaults: dict[str, object] = {
        "ack_wait_s": 10.0,
        "lease_ttl_s": 3.0,
        "retry_base_s": 0.05,
        "retry_max_backoff_s": 0.2,
        "dedupe_ttl_s": 3600.0,
        "user_agent": "jetfleet-tests (+loopback only)",
    }
    fleet_defaults.update(fleet)
    return Settings(
        nats=NatsSettings(url=nats_url),
        redis=RedisSettings(url=redis_url),
        fleet=FleetSettings(**fleet_defaults),  # type: ignore[arg-type]
        worker=WorkerSettings(concurrency=16),
        targets=targets,
    )


ROBOTS_OFF_REASON = (
    "tests count job requests at the simulator; tests/test_robots.py covers robots.txt"
)
"""Why the tests' usual targets do not obey robots.txt: its fetch would be one more
request in the counts they assert exactly. tests/test_robots.py builds obeying targets."""


def sim_target(simulator: TargetSimulator, obey_robots: bool = False) -> TargetSettings:
    """A target served by ``simulator``, generous enough that tests are never rate-bound."""
    return TargetSettings(
        base_url=simulator.base_url + "/",
        rate=1000,
        burst=100,
        max_in_flight=64,
        timeout_s=5.0,
        obey_robots=obey_robots,
        robots_off_reason="" if obey_robots else ROBOTS_OFF_REASON,
    )


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    target = sim_target(simulator)
    return make_settings(nats_url, redis_url, {"demo": target})


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[NatsClient]:
    client = await connect_nats(settings.nats, "tests")
    await declare(client.jetstream(), settings)
    yield client
    await client.close()


@pytest.fixture
async def stack(settings: Settings, nc: NatsClient) -> AsyncIterator[InProcessStack]:
    """Scheduler, sink and one worker, in this process, over the real servers."""
    running = InProcessStack(settings)
    await running.start(workers=1)
    yield running
    await running.stop()


@pytest.fixture
async def services(settings: Settings, nc: NatsClient) -> AsyncIterator[InProcessStack]:
    """The real scheduler, leaser and sink, each on its own connection; no workers."""
    running = InProcessStack(settings)
    await running.start(workers=0)
    yield running
    await running.stop()


@pytest.fixture
async def store(nc: NatsClient) -> LeaseStore:
    """The lease buckets, read directly (what the server holds, by its clock)."""
    return await LeaseStore.open(nc.jetstream())


async def wait_for(
    condition: Callable[[], Awaitable[bool]], timeout_s: float = 60.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail the test with ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.05)
