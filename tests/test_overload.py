"""Item 7 (issue 8): overload must not become dead letters.

A few hundred ``http.get`` jobs with one attempt each flow from the simulator through real
processes: the leaser and the sink run as ``jetfleet serve`` (tests/faults/services.py),
the workers as ``tests.faults.worker_main``. Under that load the leaser is SIGSTOPped for
7 s, then the sink for 20 s: frozen with their connections open, so requests to them time
out and pile up, and on SIGCONT they meet a burst of asks, many of which the workers gave
up on long ago (``fleet.service_concurrency`` is small, so the burst is answered busy).

Nothing may be spent on that: no job dead-lettered (a late grant counted as an attempt
leaves a one-attempt job ``attempts-exhausted`` without running), every job committed
exactly once, the target asked for each page exactly once (a report the worker gave up
on, then a rerun, would ask twice), and status conserved.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from jetfleet.schemas import CommittedResult, Job
from jetfleet.services.scheduler import Scheduler
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.client import jobs_for, resolve_url, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.lease_store import LeaseStore
from jetfleet.ops.status import fleet_status
from jetfleet.settings import Settings, load_settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import count_messages, read_stream
from jetfleet.topology import declare
from jetfleet.worker import Worker
from tests.conftest import wait_for
from tests.faults.fleet import WorkerFleet
from tests.faults.plan import FaultPlan
from tests.faults.services import ServiceProcess
from tests.stack import InProcessStack

pytestmark = pytest.mark.timeout(180)

TARGET = "demo"
JOBS = 360
WORKERS = 2
CONCURRENCY = 16
SERVICE_CONCURRENCY = 8
SUBMIT_EVERY_S = 0.5  # the load: JOBS spread over the whole run, 6 per half second
PER_SUBMIT = 6
# Each stall outlasts the point where a worker used to give up on the frozen service
# (the defect this test was written for, commit f54bf21): a lease ask twice for
# lease_client.TIMEOUT_S (3 s) before the job was given back, and a report 3 tries of
# SINK_TIMEOUT_S (5 s) with 0.5 + 1 + 2 s between them, 18.5 s, before it was. Shorter
# stalls would no longer catch that give-up; longer ones add only wall time.
LEASER_STALL_S = 7.0
SINK_STALL_S = 20.0
FLOWING = 30  # jobs committed since the last step before the next fault starts


def _write_config(path: Path, nats_url: str, base_url: str, redis_url: str) -> Path:
    # The lease outlives the leaser's stall (renewals stop while it is frozen), so a
    # running job keeps it; ack_wait outlives the lease, as the settings require.
    path.write_text(f"""\
[nats]
url = "{nats_url}"

[redis]
url = "{redis_url}"

[fleet]
ack_wait_s = 40.0
lease_ttl_s = 20.0
retry_base_s = 0.05
retry_max_backoff_s = 0.2
dedupe_ttl_s = 3600.0
service_concurrency = {SERVICE_CONCURRENCY}
user_agent = "jetfleet-tests (+loopback only)"

[worker]
concurrency = {CONCURRENCY}

[targets.{TARGET}]
base_url = "{base_url}/"
rate = 1000.0
burst = 100
max_in_flight = 64
max_attempts = 1
timeout_s = 5.0
# The simulator's requests are counted exactly here: no robots.txt fetch among them.
obey_robots = false
robots_off_reason = "tests count every request to the simulator"
""")
    return path


async def _committed(js: JetStreamContext) -> int:
    return await count_messages(js, subjects.STREAM_RESULTS, "jf.results.>")


async def _committed_job_ids(js: JetStreamContext) -> Counter[str]:
    decode = msgspec.json.Decoder(CommittedResult).decode
    found: Counter[str] = Counter()
    async for msg in read_stream(js, subjects.STREAM_RESULTS, "jf.results.>"):
        found[decode(msg.data).job_id] += 1
    return found


async def test_item7_a_stalled_leaser_then_sink_under_load_cost_no_attempt_and_no_second_request(
    tmp_path: Path, nats_url: str, redis_url: str, simulator: TargetSimulator
) -> None:
    began = time.monotonic()
    config = _write_config(tmp_path / "jetfleet.toml", nats_url, simulator.base_url, redis_url)
    settings = load_settings(config, {})
    jobs = [
        Job(id=f"ov-{i:04d}", url=resolve_url(settings, TARGET, f"/page/{i}")) for i in range(JOBS)
    ]
    control = await connect_nats(settings.nats, "overload-control")
    js = control.jetstream()
    await declare(js, settings)
    scheduler = Scheduler(settings, await connect_nats(settings.nats, "overload-scheduler"))
    ratelimit = ServiceProcess("ratelimit", tmp_path / "services", config)
    leaser = ServiceProcess("leaser", tmp_path / "services", config)
    sink = ServiceProcess("sink", tmp_path / "services", config)
    fleet = WorkerFleet(tmp_path / "fleet", config, FaultPlan())
    submitter: asyncio.Task[None] | None = None
    try:
        await scheduler.start()
        # Each waits for its own process to say it answers; they need not wait in turn.
        await asyncio.gather(ratelimit.start(), leaser.start(), sink.start())
        for _ in range(WORKERS):
            fleet.spawn()

        async def ready() -> bool:
            return len(fleet.ready()) == WORKERS

        await wait_for(ready, 60, "the workers to pull")

        async def submit_steadily() -> None:
            for start in range(0, JOBS, PER_SUBMIT):
                results = await submit_jobs(js, settings, TARGET, jobs[start : start + PER_SUBMIT])
                assert all(r.published and r.rejection is None for r in results), results
                await asyncio.sleep(SUBMIT_EVERY_S)  # the load's pace, not a condition

        submitter = asyncio.create_task(submit_steadily())

        async def flowing(since: int) -> None:
            async def more() -> bool:
                assert not submitter.done() or submitter.exception() is None
                return await _committed(js) >= since + FLOWING

            await wait_for(more, 30, f"{FLOWING} more commits")

        await flowing(0)
        leaser.pause()
        await asyncio.sleep(LEASER_STALL_S)  # the fault's length
        leaser.resume()
        await flowing(await _committed(js))
        sink.pause()
        # The fault's length; the count is taken a second in, once a commit the sink sent
        # just before it froze has surely landed.
        await asyncio.sleep(1.0)
        frozen_at = await _committed(js)
        await asyncio.sleep(SINK_STALL_S - 1.0)
        assert await _committed(js) == frozen_at, "the sink committed while stopped"
        sink.resume()
        stalls_end_s = time.monotonic() - began

        async def settled() -> bool:
            if submitter.done():
                submitter.result()
            else:
                return False
            return (
                await _committed(js) + await count_messages(js, subjects.STREAM_DLQ, "jf.dlq.>")
                >= JOBS
                and (await js.stream_info(subjects.STREAM_WORK)).state.messages == 0
            )

        try:
            await wait_for(settled, 60, "every job settled after the stalls")
        except AssertionError as exc:
            exc.add_note(f"by then: {(await fleet_status(js, settings)).totals}")
            raise
        settled_s = time.monotonic() - began

        dead = await count_messages(js, subjects.STREAM_DLQ, "jf.dlq.>")
        committed = await _committed_job_ids(js)
        pages = simulator.counts()["by_path_kind"].get("page", 0)
        grants = [e for e in fleet.events() if e["event"] == "granted"]
        attempts = Counter(e["attempt"] for e in grants)
        status = await fleet_status(js, settings)
        print(
            f"\nitem 7: {JOBS} jobs, stalls over at {stalls_end_s:.1f} s, settled at "
            f"{settled_s:.1f} s; dead {dead}, committed {sum(committed.values())}, page "
            f"requests {pages}, grants by attempt number {dict(attempts)}; {status.totals}"
        )
        assert dead == 0, f"{dead} jobs dead-lettered by the stalls"
        assert set(committed) == {j.id for j in jobs}
        assert set(committed.values()) == {1}, "a job committed twice"
        assert await count_messages(js, subjects.STREAM_DUPLICATES, "jf.duplicates.>") == 0
        # Every commit needed its page fetched, so as many requests as jobs means one each.
        assert pages == JOBS, f"{pages} page requests for {JOBS} committed results"
        assert set(attempts) == {1}, f"attempts spent on jobs that never ran: {attempts}"
        assert status.conserved and status.unaccounted == 0, status
        assert (status.totals.committed, status.totals.dead) == (JOBS, 0), status.totals
        assert (status.totals.queued, status.totals.leased) == (0, 0), status.totals
        # The burst after SIGCONT was more than a replica takes at once: shed as busy.
        assert "answering busy" in sink.log_tail(10**7), sink.log_tail()
    finally:
        if submitter is not None:
            submitter.cancel()
            await asyncio.gather(submitter, return_exceptions=True)
        await fleet.stop(timeout_s=30.0)
        # The workers have drained (and reported); the services may drain side by side.
        await asyncio.gather(leaser.stop(), sink.stop(), ratelimit.stop())
        await scheduler.drain(5.0)
        await scheduler.nc.close()
        await control.close()


async def test_item7_a_worker_keeps_asking_an_absent_leaser_and_a_drain_gives_the_job_back(
    settings: Settings, nc: NatsClient, services: InProcessStack, store: LeaseStore
) -> None:
    assert services.leaser is not None
    await services.leaser.drain(5.0)  # no leaser at all now: every ask has no responders
    services.leaser = None
    worker = Worker(settings, await services._connect("w-ask"), "w-ask")
    await worker.start()
    services.workers.append(worker)
    [job] = jobs_for(TARGET, settings, ["/page/1"], max_attempts=1)
    await submit_jobs(nc.jetstream(), settings, TARGET, [job])

    async def asked_again() -> bool:
        return worker.stats["leaser-unreachable"] >= 3

    await wait_for(asked_again, 30, "the worker to ask the absent leaser again")
    # Kept in hand (+WPI) while asking, not given back to be asked for again elsewhere.
    totals = (await services.status()).totals
    assert (totals.queued, totals.leased, totals.dead) == (0, 1, 0), totals
    await asyncio.wait_for(worker.drain(timeout_s=1.0), 10)
    services.workers.remove(worker)
    # Given back at the drain's timeout: with a leaser and a worker back, the job runs
    # at once, not after the ack wait, on its first and only attempt.
    await services.start_leaser()
    await services.add_worker("w-after")

    async def committed() -> bool:
        return (await services.status()).totals.committed == 1

    await wait_for(committed, settings.fleet.ack_wait_s / 2, "the given-back job to commit")
    assert (await store.highest_fence(job.id)).grants == 1
    assert (await services.status()).totals.dead == 0
