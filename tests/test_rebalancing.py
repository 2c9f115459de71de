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

import contextlib
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


@contextlib.asynccontextmanager
async def running(
    nats_url: str, redis_url: str, served: tuple[str, ...] = (), standby: tuple[str, ...] = ()
) -> AsyncIterator[Env]:
    """The stack and one worker (w-0) serving ``served`` (every target when empty), with
    ``standby`` as its standby targets."""
    TIMINGS.clear()
    config = SimulatorConfig(latency_s=LATENCY_S, pages=1000)
    async with TargetSimulator(config) as a, TargetSimulator(config) as b:
        targets = {"a": target(a.base_url), "b": target(b.base_url)}  # max_in_flight 64
        settings = queue_settings(nats_url, redis_url, targets, concurrency=SHARE)
        worker_settings = msgspec.structs.replace(settings.worker, standby_targets=standby)
        settings = msgspec.structs.replace(settings, worker=worker_settings)
        stack = InProcessStack(settings)
        await stack.start(workers=0)
        await stack.add_worker("w-0", targets=served)
        nc = await connect_nats(settings.nats, "rebalancing-test")
        try:
            yield Env(settings, stack, nc, nc.jetstream(), a, b)
        finally:
            await stack.stop()
            await nc.close()


@pytest.fixture
async def env(nats_url: str, redis_url: str) -> AsyncIterator[Env]:
    async with running(nats_url, redis_url) as started:  # w-0 serves a and b
        yield started


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


async def test_a_standby_target_runs_only_on_slots_a_held_lane_lends(
    nats_url: str, redis_url: str
) -> None:
    backlog = 60
    async with running(nats_url, redis_url, served=("a",), standby=("b",)) as env:
        worker = env.worker
        await env.submit("b", 0, backlog)
        await env.submit("a", 0, 8)

        async def a_committed(n: int) -> bool:
            return await committed(env.js, "a") == n

        await wait_for(lambda: a_committed(8), 30, "a's first jobs committed")
        assert env.b.counts()["total"] == 0, "b ran while a was not held"

        record = QuarantineRecord(
            scope="worker", name=worker.worker_id, target="a", reason="test", for_s=HOLD_S
        )
        await env.quarantine(QuarantineSet(record=record))
        await env.submit("a", 8, 8)

        async def b_on_lent_slots() -> bool:
            return most_in_flight(env.b) == SHARE

        await wait_for(b_on_lent_slots, 30, f"{SHARE} of b's requests at once on a's slots")
        assert worker.lending.borrowed.get(worker=worker.worker_id, lane="b") is not None
        await env.quarantine(QuarantineRelease(scope="worker", name=worker.worker_id, target="a"))

        await wait_for(lambda: a_committed(16), 30, "a's jobs committed once its hold ended")

        async def b_idle_again() -> bool:
            borrowed = worker.lending.borrowed.get(worker=worker.worker_id, lane="b")
            return borrowed is None and env.b.in_flight() == 0

        await wait_for(b_idle_again, 10, "a's slots back from b")
        b_before = env.b.counts()["total"]
        await env.submit("a", 16, 8)
        await wait_for(lambda: a_committed(24), 30, "a's last jobs committed")
        assert env.b.counts()["total"] == b_before, "b ran on slots that are a's again"
        assert most_in_flight(env.b) <= SHARE  # never more than a lends

        # b's jobs not run yet wait in JF_WORK: none lost, none run twice.
        info = await env.js.stream_info(subjects.STREAM_WORK, subjects_filter="jf.work.b.>")
        left = sum((info.state.subjects or {}).values())
        assert left > 0 and await committed(env.js, "b") + left == backlog
        runs = Counter(attempt.job_id for attempt in TIMINGS.attempts)
        assert set(runs.values()) == {1}
