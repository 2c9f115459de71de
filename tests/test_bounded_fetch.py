"""A worker runs no more jobs of a lane than the lane has slots, even when a pull request
was answered after its fetch gave up (jetfleet/worker/bounded_fetch.py).

nats-py 2.16's ``fetch(n)`` returns everything in the subscription's pending queue,
whatever ``n``. Deliveries land there when a pull request is answered after its fetch
stopped waiting (an expiry racing a publish, a loop too loaded to read in time): seen in
a full test run as 13 requests hanging at a target whose lane had 8 slots. Here the late
answer is made on purpose: a pull request sent on the worker's own subscription while
every slot is busy, so its deliveries wait in the queue for the next fetch.

Real servers: nats-server, Redis, a simulator target whose ``/hang/N`` never answers until
released; scheduler, leaser, sink and one worker in this process.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.dev.embedded import EmbeddedNats
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.worker import bounded_fetch, runtime
from tests.conftest import wait_for
from tests.queueing.helpers import dead, queue_settings, submit_paths, target
from tests.stack import InProcessStack

HANG = "hang"
SLOTS = 2
LATE = 6  # deliveries a late pull answer leaves in the queue: three times the slots


async def test_a_fetch_tells_the_n_asked_for_from_the_surplus(
    tmp_path: Path,
) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="S", subjects=["s.>"])
        sub = await js.pull_subscribe("s.>", durable="c")
        for n in range(LATE):
            await js.publish("s.x", str(n).encode())
        # A pull request answered with nobody fetching: its deliveries wait in the queue.
        request = {"batch": LATE, "expires": 5_000_000_000}
        await nc.publish(sub._nms, json.dumps(request).encode(), sub._deliver)

        async def queued() -> bool:
            return sub._sub._pending_queue.qsize() == LATE

        await wait_for(queued, 10, f"{LATE} deliveries in the subscription's queue")
        # The flaw this works around, so the test fails if nats-py ever changes under it
        # (then fetch_at_most is no longer needed, not wrong).
        assert len(await sub.fetch(2, timeout=0.5)) > 2

        await js.purge_stream("S")
        await js.delete_consumer("S", "c")
        sub = await js.pull_subscribe("s.>", durable="d")
        for n in range(LATE):
            await js.publish("s.x", str(n).encode())
        await nc.publish(sub._nms, json.dumps(request).encode(), sub._deliver)

        async def queued_again() -> bool:
            return sub._sub._pending_queue.qsize() == LATE

        await wait_for(queued_again, 10, f"{LATE} deliveries queued again")
        wanted, surplus = await bounded_fetch.fetch_at_most(sub, 2, 0.5)
        assert [m.data for m in wanted] == [b"0", b"1"]
        assert [m.data for m in surplus] == [b"2", b"3", b"4", b"5"]
        assert await bounded_fetch.fetch_at_most(sub, 2, 0.2) == ([], [])  # none: no error
    finally:
        await nc.close()
        server.stop()


@pytest.fixture
async def simulator() -> AsyncIterator[TargetSimulator]:
    async with TargetSimulator(SimulatorConfig()) as sim:
        yield sim


async def test_a_late_pull_answer_runs_no_more_jobs_than_the_lanes_slots(
    nats_url: str,
    redis_url: str,
    simulator: TargetSimulator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    subs: dict[str, nats.js.JetStreamContext.PullSubscription] = {}

    async def recorded(
        sub: nats.js.JetStreamContext.PullSubscription, n: int, wait_s: float
    ) -> tuple[list[Msg], list[Msg]]:
        subs[sub._consumer] = sub  # the worker's subscription of each consumer
        return await bounded_fetch.fetch_at_most(sub, n, wait_s)

    monkeypatch.setattr(runtime, "fetch_at_most", recorded)
    settings = queue_settings(
        nats_url,
        redis_url,
        # One attempt each: a released hang (504) ends its job, dead-lettered.
        {HANG: target(simulator.base_url, timeout_s=60.0, max_attempts=1)},
        concurrency=SLOTS,
        lease_ttl_s=10.0,
        ack_wait_s=20.0,
    )
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    try:
        js = stack.connections[0].jetstream()
        await submit_paths(js, settings, HANG, [f"/hang/{n}" for n in range(SLOTS)], "busy")

        async def slots_busy() -> bool:
            return simulator.in_flight("hang") == SLOTS

        await wait_for(slots_busy, 30, f"the lane's {SLOTS} slots hanging")
        consumer = subjects.work_consumer(HANG)
        backlog = [f"/hang/{n}" for n in range(SLOTS, SLOTS + LATE)]
        await submit_paths(js, settings, HANG, backlog, "late")

        async def routed() -> bool:
            info = await js.consumer_info(subjects.STREAM_WORK, consumer)
            return bool(info.num_pending == LATE)

        await wait_for(routed, 30, f"{LATE} jobs waiting on {consumer}")
        # Every slot is busy, so the worker's loop waits for one and fetches nothing: the
        # answer to this request waits in its subscription's queue, as a late one does.
        sub = subs[consumer]
        request = {"batch": LATE, "expires": 5_000_000_000}
        await stack.connections[0].publish(sub._nms, json.dumps(request).encode(), sub._deliver)

        async def queued() -> bool:
            return sub._sub._pending_queue.qsize() == LATE

        await wait_for(queued, 30, f"the {LATE} jobs delivered into the worker's queue")
        total = SLOTS + LATE

        async def all_ended() -> bool:
            simulator.release_hung()  # each request hanging now answers 504: its job ends
            return await dead(js, HANG) == total and simulator.in_flight() == 0

        await wait_for(all_ended, 60, f"all {total} hanging jobs to end")
        counts = simulator.counts()
        assert counts["max_in_flight"]["hang"] == SLOTS, counts["max_in_flight"]
        assert counts["total"] == total  # each once: nothing ran twice, nothing was lost
        # And no slot was counted back that had not been taken: the lane has its SLOTS
        # again (its loop holds some only for a moment, while it fetches).
        slots = stack.workers[0]._slots[stack.workers[0].lanes[0].name]

        async def slots_back() -> bool:
            return slots.free() == SLOTS

        try:
            await wait_for(slots_back, 10, f"the lane's {SLOTS} slots free again")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {slots.total}, {dict(slots.in_use)}") from None
    finally:
        await stack.stop()
