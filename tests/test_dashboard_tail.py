"""The gateway's outcome tail over a real nats-server: it stops on drain while a flood of
outcome events arrives, deletes its consumer as it goes, and counts each event once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec
from jetfleet.schemas import Outcome
from jetfleet.schemas.report import Versions
from jetfleet.services.gateway.outcome_tail import OutcomeTail
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from jetfleet.outcome_events import JOB_HEADER
from jetfleet.server_clock import ServerClock
from jetfleet.settings import Settings
from tests.conftest import wait_for
from tests.stack import running_stack

STOP_DEADLINE_S = 15.0
"""Far beyond a fetch's wait: reaching it means stop() hung."""


def _event(n: int) -> bytes:
    return msgspec.json.encode(
        Outcome(
            job_id=f"f{n}",
            worker="w-flood",
            attempt=1,
            kind="ok",
            duration_s=0.01,
            target="demo",
            versions=Versions(jetfleet="0", id="v-flood"),
        )
    )


def _events_past(tail: OutcomeTail, count: int) -> Callable[[], Awaitable[bool]]:
    async def past() -> bool:
        return tail.series.events >= count

    return past


async def _consumers(nc: NatsClient) -> int:
    return (await nc.jetstream().stream_info(subjects.STREAM_OUTCOMES)).state.consumer_count


async def test_the_tail_stops_under_a_flood_and_leaves_no_consumer(
    settings: Settings, nc: NatsClient
) -> None:
    async with running_stack(settings):
        before = await _consumers(nc)
        sent = 0
        flooding = True

        async def flood() -> None:
            nonlocal sent
            while flooding:
                for _ in range(200):
                    sent += 1
                    await nc.publish(subjects.outcome("demo", f"f{sent}"), _event(sent))
                await nc.flush()

        for round_ in range(3):  # a swallowed cancel is a race: give it several chances
            tail = OutcomeTail(nc.jetstream(), ServerClock(nc))
            flooder = asyncio.create_task(flood())
            tail.start()
            try:
                await wait_for(_events_past(tail, 2000), 60, "the tail to read")
                # asyncio.wait, not wait_for: a cancel of a hung stop could be swallowed.
                stopping = asyncio.create_task(tail.stop())
                done, _ = await asyncio.wait({stopping}, timeout=STOP_DEADLINE_S)
                assert stopping in done, f"round {round_}: stop() hung under the flood"
                stopping.result()
            finally:
                flooding = False
                await flooder
                flooding = True

            async def consumer_gone() -> bool:
                return await _consumers(nc) == before

            # Deleted by the tail itself, not left for the server's inactivity timer.
            await wait_for(consumer_gone, 5, f"round {round_}: the tail's consumer to go")
        with contextlib.suppress(Exception):
            await nc.flush()


async def test_a_restarted_tail_counts_each_event_once(settings: Settings, nc: NatsClient) -> None:
    """Events of both subject forms count: the per-job form of events stored before
    outcomes moved to per-target subjects, then the per-target one with its header."""
    async with running_stack(settings):
        js = nc.jetstream()
        for n in range(50):
            await js.publish(subjects.outcome("demo", f"f{n}"), _event(n))
        tail = OutcomeTail(js, ServerClock(nc))
        tail.start()
        try:
            await wait_for(_events_past(tail, 50), 30, "the first 50 events")
            await tail.stop()
            await js.publish(subjects.outcomes("demo"), _event(50))  # no Jf-Job: skipped
            for n in range(50, 60):
                await js.publish(
                    subjects.outcomes("demo"), _event(n), headers={JOB_HEADER: f"f{n}"}
                )
            tail.start()  # as a gateway started again after drain
            await wait_for(_events_past(tail, 60), 30, "the 10 later events")
            [row] = tail.series.rows("worker", tail.series.newest_s)
            assert (tail.series.events, row.ok, tail.skipped) == (60, 60, 1)
        finally:
            await tail.stop()
