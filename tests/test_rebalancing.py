"""Rebalancing (issue 10): a worker's slots left idle because their target is held for
this worker (here: the worker is quarantined on it) go to a target with a backlog, and
come back when the hold ends.

Real servers: a fresh nats-server and redis, one simulator per target (``a`` and ``b``,
every page answered after LATENCY_S, so concurrency shows as requests in flight at the
target), scheduler + leaser + ratelimit + sink + one worker serving both, each target on
consumers of its own, ``worker.concurrency`` = SHARE. B has a backlog all along; the
worker is quarantined on A while A has a backlog too. Concurrency is counted by the
simulators (the most requests in flight at once), never by the worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest
from jetfleet.schemas.lease import (
    QuarantineCommand,
    QuarantineRecord,
    QuarantineRelease,
    QuarantineReply,
    QuarantineSet,
)
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.connection import connect_nats
from jetfleet.settings import Settings
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import count_messages
from jetfleet.worker import Worker
from tests.conftest import wait_for
from tests.queueing.helpers import (
    TIMED_HANDLER,
    TIMINGS,
    committed,
    queue_settings,
    submit_paths,
    target,
)
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(180)

SHARE = 2  # worker.concurrency: each lane's own slots
LATENCY_S = 0.3
HOLD_S = 6.0  # the quarantine's for_s: the worker leaves A alone this long per refusal
A_JOBS = 16
B_FIRST, B_SECOND = 80, 30  # B's backlog, and more of it once A is back


def most_in_flight(sim: TargetSimulator) -> int:
    """The most requests the simulator had in flight at once since its last reset."""
    return int(sim.counts()["max_in_flight"].get("*", 0))


@dataclass
class Env:
    settings: Settings
    stack: InProcessStack
    nc: NatsClient
    js: JetStreamContext
    a: TargetSimulator
    b: TargetSimulator

    @property
    def worker(self) -> Worker:
        return self.stack.workers[0]

    async def quarantine(self, command: QuarantineCommand) -> None:
        answer = await self.nc.request(
            subjects.QUARANTINE, msgspec.json.encode(command), timeout=5.0
        )
        assert msgspec.json.decode(answer.data, type=QuarantineReply).ok

    async def submit(self, name: str, first: int, count: int) -> None:
        paths = [f"/page/{first + n}" for n in range(count)]
        await submit_paths(
            self.js, self.settings, name, paths, f"{name}{first}", handler=TIMED_HANDLER
        )


@pytest.fixture
async def env(nats_url: str, redis_url: str) -> AsyncIterator[Env]:
    TIMINGS.clear()
    config = SimulatorConfig(latency_s=LATENCY_S, pages=1000)
    async with TargetSimulator(config) as a, TargetSimulator(config) as b:
        targets = {"a": target(a.base_url), "b": target(b.base_url)}  # max_in_flight 64
        settings = queue_settings(nats_url, redis_url, targets, concurrency=SHARE)
        stack = InProcessStack(settings)
        await stack.start(workers=1)  # w-0, serving a and b
        nc = await connect_nats(settings.nats, "rebalancing-test")
        try:
            yield Env(settings, stack, nc, nc.jetstream(), a, b)
        finally:
            await stack.stop()
            await nc.close()


async def test_idle_slots_move_to_a_backlogged_target_and_come_back(env: Env) -> None:
    worker = env.worker
    record = QuarantineRecord(
        scope="worker", name=worker.worker_id, target="a", reason="test", for_s=HOLD_S
    )
    await env.quarantine(QuarantineSet(record=record))
    await env.submit("b", 0, B_FIRST)
    await env.submit("a", 0, A_JOBS)

    # A is held (its jobs refused ``quarantined``): its slots run B's jobs.
    async def b_above_its_share() -> bool:
        return most_in_flight(env.b) > SHARE

    await wait_for(b_above_its_share, 30, f"more than {SHARE} of b's requests at once")
    assert worker.stats["refused:quarantined"] >= 1
    assert worker.lending.lent.get(worker=worker.worker_id, lane="a") is not None
    assert env.a.counts()["total"] == 0  # nothing went to A meanwhile
    await env.quarantine(QuarantineRelease(scope="worker", name=worker.worker_id, target="a"))
    assert most_in_flight(env.b) <= 2 * SHARE  # its share and A's, never more

    # The hold ends: A gets its slots back as B's borrowed jobs end, and runs its backlog.
    async def a_running() -> bool:
        return env.a.in_flight() > 0

    await wait_for(a_running, 30, "a's jobs to run once its hold ended")
    await env.submit("b", B_FIRST, B_SECOND)  # B still has a backlog

    async def loans_back() -> bool:
        return worker.lending.borrowed.get(worker=worker.worker_id, lane="b") is None

    await wait_for(loans_back, 10, "b's borrowed slots to come back")
    b_before = env.b.counts()["total"]
    env.b.reset()  # the most in flight counts from now (no borrowed job is left)
    env.a.reset()
    a_before = await committed(env.js, "a")

    async def a_at_share_beside_b() -> bool:
        return most_in_flight(env.a) == SHARE and env.b.counts()["total"] >= 4 * SHARE

    await wait_for(a_at_share_beside_b, 30, f"a running {SHARE} at once beside b's backlog")
    assert most_in_flight(env.b) <= SHARE, "b kept slots that are a's again"
    assert await committed(env.js, "a") > a_before or env.a.in_flight() > 0

    # Nothing lost, nothing run twice.
    async def all_committed() -> bool:
        return (
            await committed(env.js, "a") == A_JOBS
            and await committed(env.js, "b") == B_FIRST + B_SECOND
        )

    await wait_for(all_committed, 60, "every job committed")
    b_total = b_before + env.b.counts()["total"]
    assert b_total == B_FIRST + B_SECOND  # one request per job of B
    runs = Counter(attempt.job_id for attempt in TIMINGS.attempts)
    assert len(runs) == A_JOBS + B_FIRST + B_SECOND and set(runs.values()) == {1}
    assert await count_messages(env.js, subjects.STREAM_DUPLICATES, "jf.duplicates.>") == 0
    assert worker.lending.lent.get(worker=worker.worker_id, lane="a") is None
