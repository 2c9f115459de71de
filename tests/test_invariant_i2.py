"""I2 fencing (DESIGN.md section 3), against real servers.

A commit whose fence is not the job's current lease fence, or lower than the highest
granted, is rejected; a commit after the lease expired by the server's clock is rejected;
a worker's clock, skewed by any amount or jumping back and forth while its jobs run,
decides nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import libfaketime
import msgspec
import pytest
import redis.asyncio as aioredis
from jetfleet.schemas import (
    CommittedResult,
    DataOutput,
    Outcome,
    WorkOrder,
)
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.dev.settings_file import settings_toml
from jetfleet.lease_client import LeaseClient
from jetfleet.lease_store import LeaseStore
from jetfleet.outcome_events import read_outcomes
from jetfleet.rate_cells import KEY_FLEET_BORN, US, born_key, target_tag
from jetfleet.results import iter_results
from jetfleet.settings import Settings, load_settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import count_messages, read_stream
from tests.conftest import make_settings, sim_target, wait_for
from tests.leasing import grant_fence, order_for, report, report_failure
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(60)

TTL_S = 2.0
ACK_WAIT_S = 4.0
REPO = Path(__file__).resolve().parents[1]
_encoder = msgspec.json.Encoder()


@pytest.fixture
def settings(nats_url: str, redis_url: str, simulator: TargetSimulator) -> Settings:
    """A short lease TTL (2 s) under a short ack_wait (4 s), and the test handler."""
    target = sim_target(simulator)
    return make_settings(
        nats_url,
        redis_url,
        {"demo": target},
        lease_ttl_s=TTL_S,
        ack_wait_s=ACK_WAIT_S,
        handlers=("test.slow",),
    )


async def commit(nc: NatsClient, order: WorkOrder, fence: int, worker: str) -> str:
    return (await report(nc, order, fence, worker)).status


async def results_for(nc: NatsClient, key: str) -> list[CommittedResult]:
    return [r async for r in iter_results(nc.jetstream(), "demo") if r.key == key]


async def lease_gone(store: LeaseStore, job_id: str) -> None:
    async def gone() -> bool:
        return await store.live(job_id) is None

    await wait_for(gone, 3 * TTL_S, f"the lease of {job_id} to expire by the server's clock")


async def test_I2_a_stale_fence_commit_is_rejected_whatever_the_order_of_arrival(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)

    # Case 1: A's lease is released, B is granted; B commits first, then A.
    order = order_for(settings, "/page/1")
    f1 = await grant_fence(client, order, "A")
    assert await client.release(order.job.id, f1) is True
    f2 = await grant_fence(client, order, "B")
    assert f2 > f1
    assert await commit(nc, order, f2, "B") == "committed"
    assert await commit(nc, order, f1, "A") == "rejected:fenced-out"
    [result] = await results_for(nc, order.key)
    assert (result.worker, result.fence) == ("B", f2)

    # Case 2: A's lease expires by the server's clock, B is granted; A commits first:
    # rejected although nothing is committed yet. Then B commits.
    order = order_for(settings, "/page/2")
    f1 = await grant_fence(client, order, "A")
    await lease_gone(store, order.job.id)
    f2 = await grant_fence(client, order, "B")
    assert f2 > f1
    assert await commit(nc, order, f1, "A") == "rejected:fenced-out"
    assert await results_for(nc, order.key) == []
    assert await commit(nc, order, f2, "B") == "committed"
    assert await commit(nc, order, f1, "A") == "rejected:fenced-out"
    [result] = await results_for(nc, order.key)
    assert (result.worker, result.fence) == ("B", f2)
    assert services.sink is not None
    assert services.sink.counts == {"committed": 2, "rejected:fenced-out": 3}


async def test_I2_fences_only_grow_across_jobs_and_grants(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    orders = [order_for(settings, f"/page/{n}") for n in range(10)]
    issued: list[int] = []
    last: dict[str, int] = {}
    for round_no in range(3):
        for n, order in enumerate(orders):
            fence = await grant_fence(client, order, f"w-{(n + round_no) % 3}")
            issued.append(fence)
            last[order.job.id] = fence
            if n % 2:  # renewals in between must not disturb the order
                assert await client.renew(order.job.id, fence) is True
        for order in orders:
            assert await client.release(order.job.id, last[order.job.id]) is True
    assert all(a < b for a, b in itertools.pairwise(issued)), issued

    # Grants made at the same time are all distinct and above everything before them.
    concurrent = await asyncio.gather(*(grant_fence(client, order, "w-c") for order in orders))
    assert len(set(concurrent)) == len(orders)
    assert min(concurrent) > max(issued)

    for order, fence in zip(orders, concurrent, strict=True):
        history = await store.highest_fence(order.job.id)
        assert (history.fence, history.grants) == (fence, 4)


async def test_I2_a_commit_after_server_side_expiry_is_rejected(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    client = LeaseClient(nc)
    order = order_for(settings, "/page/3")
    loop = asyncio.get_running_loop()
    fence = await grant_fence(client, order, "A")
    granted_at = loop.time()
    await lease_gone(store, order.job.id)  # never renewed
    assert loop.time() - granted_at >= TTL_S / 2

    assert await commit(nc, order, fence, "A") == "rejected:lease-expired"
    assert await client.renew(order.job.id, fence) is False
    assert await store.live(order.job.id) is None  # the refused renewal revived nothing
    assert await results_for(nc, order.key) == []

    # The job can be granted again, and the expired holder stays fenced out.
    f2 = await grant_fence(client, order, "B")
    assert f2 > fence
    assert await commit(nc, order, fence, "A") == "rejected:fenced-out"
    assert await commit(nc, order, f2, "B") == "committed"
    assert len(await results_for(nc, order.key)) == 1


async def dead_letters(nc: NatsClient) -> int:
    return await count_messages(nc.jetstream(), subjects.STREAM_DLQ, "jf.dlq.>")


async def test_I2_a_stale_or_expired_fence_cannot_dead_letter_a_job(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    """A failure report terminates the job, so it is fenced like a commit: only the live
    lease's holder may send one."""
    client = LeaseClient(nc)

    # A's lease expires by the server's clock, B is granted: A's failure is fenced out.
    order = order_for(settings, "/page/4")
    f1 = await grant_fence(client, order, "A")
    await lease_gone(store, order.job.id)
    f2 = await grant_fence(client, order, "B")
    assert f2 > f1
    assert (await report_failure(nc, order, f1, "A")).status == "rejected:fenced-out"
    assert await dead_letters(nc) == 0
    # The live holder's failure is the one that lands.
    assert await client.renew(order.job.id, f2) is True
    assert (await report_failure(nc, order, f2, "B")).status == "dead-lettered"
    assert await dead_letters(nc) == 1
    assert (await report_failure(nc, order, f1, "A")).status == "rejected:fenced-out"
    assert await dead_letters(nc) == 1

    # A's lease expires and nobody holds the job: A's failure finds no live lease.
    lapsed = order_for(settings, "/page/5")
    f3 = await grant_fence(client, lapsed, "A")
    await lease_gone(store, lapsed.job.id)
    assert (await report_failure(nc, lapsed, f3, "A")).status == "rejected:lease-expired"
    assert await dead_letters(nc) == 1
    assert services.sink is not None
    assert services.sink.counts == {
        "rejected:fenced-out": 2,
        "rejected:lease-expired": 1,
        "dead-lettered": 1,
    }


# --- a worker's clock decides nothing -------------------------------------------------

SKEWS = {"skew-plus": "+1h", "skew-minus": "-1h"}
SLOW_S = ACK_WAIT_S + 0.5  # longer than the lease TTL and than ack_wait
FAST_S = 0.3


class SkewedWorker:
    """``python -m tests.i2_worker worker`` under libfaketime, in its own process group."""

    def __init__(
        self,
        worker_id: str,
        skew: str,
        config: Path,
        log_dir: Path,
        settings: Settings,
        clock_file: Path | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.skew = skew
        self.clock_file = clock_file
        """If set, the skew is read from this file at every clock read (it may move)."""
        self.config = config
        self.log_path = log_dir / f"{worker_id}.log"
        self.settings = settings
        self.proc: asyncio.subprocess.Process | None = None
        self.clock = 0.0

    async def start(self) -> None:
        env = skewed_env(self.skew) if self.clock_file is None else moving_env(self.clock_file)
        env.update(
            JETFLEET_CONFIG=str(self.config),
            NATS_URL=self.settings.nats.url,
            REDIS_URL=self.settings.redis.url,
            JETFLEET_STACK=str(self.config.parent / "no-stack"),
        )
        with self.log_path.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.i2_worker",
                "worker",
                "--id",
                self.worker_id,
                "--targets",
                "demo",
                cwd=REPO,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 15.0)
        fields = dict(part.split("=", 1) for part in line.decode().split()[1:])
        self.clock = float(fields["clock"]) - time.time()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        assert self.proc.stdout is not None
        try:
            await asyncio.wait_for(self.proc.stdout.read(), 15.0)
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()


async def _limiter_born_long_ago(client: aioredis.Redis, target: str) -> None:
    seconds, micros = await client.time()
    born = (int(seconds) - 86400) * US + int(micros)
    for key in (born_key(target_tag(target)), KEY_FLEET_BORN):
        await client.set(key, born)


def skewed_env(skew: str) -> dict[str, str]:
    """The environment that runs a child with libfaketime preloaded (the ``libfaketime``
    wheel builds it), its wall clock off by ``skew``; monotonic time is left alone."""
    _, preload = libfaketime.get_reload_information()
    return dict(os.environ, **preload, FAKETIME=skew)


def moving_env(clock_file: Path) -> dict[str, str]:
    """Like ``skewed_env``, but the offset is whatever ``clock_file`` holds when the child
    reads its clock (``FAKETIME_NO_CACHE``): the test moves it while jobs run."""
    _, preload = libfaketime.get_reload_information()
    env = dict(os.environ, **preload, FAKETIME_TIMESTAMP_FILE=str(clock_file))
    env.pop("FAKETIME", None)
    assert env.get("FAKETIME_NO_CACHE") == "1", "the clock file would be read only once"
    return env


async def faked_date(skew: str, env: dict[str, str] | None = None) -> float:
    proc = await asyncio.create_subprocess_exec(
        "date", "+%s", stdout=asyncio.subprocess.PIPE, env=env or skewed_env(skew)
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 10.0)
    assert proc.returncode == 0
    return float(out.decode().strip())


async def test_I2_a_worker_with_its_clock_skewed_by_an_hour_behaves_correctly(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    store: LeaseStore,
    simulator: TargetSimulator,
    tmp_path: Path,
    redis_client: aioredis.Redis,
) -> None:
    js = nc.jetstream()
    # The limiter's state was flushed for this test, so for its first 10 s it would let
    # no burst through (docs/rate-limits.md): two workers' permits landing within a
    # millisecond would be told to wait, and a leased job asked to wait is handed back,
    # a redelivery this test counts as a fault. Its state is born long ago instead.
    await _limiter_born_long_ago(redis_client, "demo")

    # The skew is in effect for a program run with libfaketime preloaded.
    for skew, offset in (("+1h", 3600.0), ("-1h", -3600.0)):
        assert abs(await faked_date(skew) - time.time() - offset) < 60, skew

    config = tmp_path / "jetfleet.toml"
    config.write_text(settings_toml(settings))
    assert load_settings(config, {}) == settings
    workers = [
        SkewedWorker(worker_id, skew, config, tmp_path, settings)
        for worker_id, skew in SKEWS.items()
    ]
    try:
        for worker in workers:
            await worker.start()
        # ... and in each worker process itself.
        assert abs(workers[0].clock - 3600) < 60, workers[0].clock
        assert abs(workers[1].clock + 3600) < 60, workers[1].clock

        async def both_pulling() -> bool:
            for worker in workers:
                assert worker.proc is not None
                if worker.proc.returncode is not None:
                    raise AssertionError(f"{worker.worker_id} exited:\n{worker.log_tail()}")
            info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer("demo"))
            return (info.num_waiting or 0) >= 2

        await wait_for(both_pulling, 15.0, "both worker processes to pull")

        slow = jobs_for(
            "demo",
            settings,
            [f"/page/{n}" for n in range(10)],
            handler="test.slow",
            args={"sleep_s": str(SLOW_S)},
        )
        fast = jobs_for(
            "demo",
            settings,
            [f"/page/{n}" for n in range(10, 50)],
            handler="test.slow",
            args={"sleep_s": str(FAST_S)},
        )
        jobs = slow + fast
        submitted = await submit_jobs(js, settings, "demo", jobs)
        assert all(s.published and s.rejection is None for s in submitted), submitted

        async def all_committed_and_acked() -> bool:
            status = await services.status()
            return (status.totals.committed, status.totals.queued, status.totals.leased) == (
                50,
                0,
                0,
            )

        try:
            await wait_for(all_committed_and_acked, 25.0, "50 commits and acks")
        except AssertionError as exc:
            logs = "\n".join(f"--- {w.worker_id}\n{w.log_tail()}" for w in workers)
            raise AssertionError(f"{exc}; {await services.status()}\n{logs}") from None
    finally:
        for worker in workers:
            await worker.stop()

    results = [r async for r in iter_results(js, "demo")]
    # Exactly once: one result per job, one request per page at the target.
    assert sorted(r.job_id for r in results) == sorted(j.id for j in jobs)
    assert len({r.key for r in results}) == 50
    assert simulator.counts()["by_path_kind"]["page"] == 50
    assert services.sink is not None
    assert services.sink.counts == {"committed": 50}, services.sink.counts

    by_worker = Counter(r.worker for r in results)
    assert set(by_worker) == set(SKEWS), by_worker  # both skewed workers committed
    slow_ids = {j.id for j in slow}
    for record in results:
        assert isinstance(record.output, DataOutput)
        assert record.output.data["status"] == 200
        # The result was produced on the worker's skewed wall clock.
        produced_at = record.output.data["clock"]
        assert isinstance(produced_at, float)
        offset = 3600.0 if record.worker == "skew-plus" else -3600.0
        assert abs(produced_at - time.time() - offset) < 120, (record.worker, produced_at)
        # One grant per job: no lease lapsed, even for jobs running past TTL and ack_wait.
        assert record.attempt == 1
        history = await store.highest_fence(record.job_id)
        assert (history.grants, history.fence) == (1, record.fence), record.job_id
        if record.job_id in slow_ids:
            assert record.duration_s >= SLOW_S > ACK_WAIT_S > TTL_S

    # Every attempt ended ok: no lost lease, no retry, and JetStream redelivered nothing.
    outcomes: list[Outcome | str] = []

    async def every_outcome_stored() -> bool:
        # A worker sends its ok events in batches after a short wait: they may be
        # stored after the commits.
        outcomes[:] = [
            event
            async for m in read_stream(js, subjects.STREAM_OUTCOMES, "jf.outcome.>")
            for event in read_outcomes(m.subject, m.data, m.headers)
        ]
        return len(outcomes) >= 50

    await wait_for(every_outcome_stored, 10.0, "50 outcome events")
    assert Counter(getattr(o, "kind", o) for o in outcomes) == {"ok": 50}
    info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer("demo"))
    assert info.delivered.consumer_seq == 50
    assert (info.num_redelivered or 0) == 0


# Where the moving clock goes while the jobs run: forward, far back, far forward.
CLOCK_MOVES = ("+1h", "-2d", "+30d", "-10m", "+1h")


async def move_clock(clock_file: Path, offset: str, seconds: float) -> None:
    """Set the moving clock to ``offset`` and wait until a process reading the same
    file sees it (within a minute of ``seconds`` from real time)."""
    await asyncio.to_thread(clock_file.write_text, offset + "\n")

    async def in_effect() -> bool:
        seen = await faked_date(offset, moving_env(clock_file))
        return abs(seen - time.time() - seconds) < 60

    await wait_for(in_effect, 10, f"the moving clock at {offset}")


async def test_I2_a_worker_whose_clock_jumps_back_and_forth_during_its_jobs_behaves_correctly(
    settings: Settings,
    nc: NatsClient,
    services: InProcessStack,
    store: LeaseStore,
    simulator: TargetSimulator,
    tmp_path: Path,
    redis_client: aioredis.Redis,
) -> None:
    """The clock moves while each job runs past its lease TTL and ack_wait, so renewals,
    the report and the commit all happen on a clock that jumped between them."""
    js = nc.jetstream()
    # As in the test above: no no-burst span of a flushed limiter (it hands leased jobs
    # back, redeliveries this test counts as faults).
    await _limiter_born_long_ago(redis_client, "demo")
    clock_file = tmp_path / "clock"
    await move_clock(clock_file, "-1h", -3600)
    config = tmp_path / "jetfleet.toml"
    config.write_text(settings_toml(settings))
    worker = SkewedWorker("moving", "", config, tmp_path, settings, clock_file=clock_file)
    jobs = jobs_for(
        "demo",
        settings,
        [f"/page/{n}" for n in range(8)],
        handler="test.slow",
        args={"sleep_s": str(SLOW_S)},
    )
    try:
        await worker.start()
        assert abs(worker.clock + 3600) < 60, worker.clock  # its clock at start: -1h

        async def pulling() -> bool:
            assert worker.proc is not None and worker.proc.returncode is None, worker.log_tail()
            info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer("demo"))
            return (info.num_waiting or 0) >= 1

        await wait_for(pulling, 15.0, "the worker process to pull")
        submitted = await submit_jobs(js, settings, "demo", jobs)
        assert all(s.published and s.rejection is None for s in submitted), submitted

        async def all_running() -> bool:
            return int(simulator.counts()["by_path_kind"].get("page", 0)) == len(jobs)

        await wait_for(all_running, 15.0, "every job's request at the target")
        began = time.monotonic()
        seconds = {"+1h": 3600, "-2d": -172800, "+30d": 2592000, "-10m": -600}
        for offset in CLOCK_MOVES:
            await move_clock(clock_file, offset, seconds[offset])
        moved_within_s = time.monotonic() - began

        async def all_committed_and_acked() -> bool:
            status = await services.status()
            totals = status.totals
            return (totals.committed, totals.queued, totals.leased) == (len(jobs), 0, 0)

        try:
            await wait_for(all_committed_and_acked, 25.0, f"{len(jobs)} commits and acks")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {await services.status()}\n{worker.log_tail()}") from None
    finally:
        await worker.stop()

    # The moves happened while every job was still running (each sleeps SLOW_S).
    assert moved_within_s < SLOW_S, moved_within_s
    results = [r async for r in iter_results(js, "demo")]
    assert sorted(r.job_id for r in results) == sorted(j.id for j in jobs)
    assert simulator.counts()["by_path_kind"]["page"] == len(jobs)
    assert services.sink is not None
    assert services.sink.counts == {"committed": len(jobs)}, services.sink.counts
    for record in results:
        # Produced after the moves, on the worker's clock: the last move, +1h.
        assert isinstance(record.output, DataOutput)
        produced_at = record.output.data["clock"]
        assert isinstance(produced_at, float)
        assert abs(produced_at - time.time() - 3600) < 120, produced_at
        # A duration, not a difference of two readings of a clock that moved (+2 h net).
        assert record.attempt == 1 and SLOW_S <= record.duration_s < SLOW_S + 30
        history = await store.highest_fence(record.job_id)
        assert (history.grants, history.fence) == (1, record.fence), record.job_id
    info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer("demo"))
    assert info.delivered.consumer_seq == len(jobs)
    assert (info.num_redelivered or 0) == 0
