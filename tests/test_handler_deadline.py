"""Issue 8 item 5: every attempt runs under its time budget (the job's ``timeout_s``, else
the target's). A handler that never returns used to keep its lease renewed for ever; past
the budget the attempt now fails retryably as ``handler-timeout``, and a job whose every
attempt times out ends dead-lettered in bounded time.

Real servers: a fresh nats-server, scheduler + leaser + sink + one worker in this
process. The two handlers below are the user's: one waits for ever, one also refuses to
stop when cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from jetfleet.schemas import DeadLetter, HandlerOutput, NoopOutput, Outcome
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from jetfleet.worker import HandlerContext, handler
from tests.conftest import make_settings, wait_for
from tests.queueing.helpers import dead, submit_paths, target
from tests.stack import InProcessStack

NEVER = "tests.never-returns"
STUBBORN = "tests.refuses-to-stop"
BUDGET_S = 1.0
ATTEMPTS = 2


class Release:
    """Set when the test ends, so a handler the worker had to leave behind can finish (an
    Event per test: an asyncio.Event belongs to the loop that first waits on it)."""

    event = asyncio.Event()


@handler(NEVER)
async def never_returns(ctx: HandlerContext) -> HandlerOutput:
    """Waits for an answer that never comes (a hung library call, a lost future)."""
    await asyncio.Event().wait()
    return NoopOutput()


@handler(STUBBORN)
async def refuses_to_stop(ctx: HandlerContext) -> HandlerOutput:
    """Swallows its cancellation and keeps waiting: the worst a handler can do in asyncio."""
    release = Release.event
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            continue
    return NoopOutput()


@pytest.fixture
async def running(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> AsyncIterator[tuple[InProcessStack, JetStreamContext]]:
    targets = {"demo": target(simulator.base_url, timeout_s=BUDGET_S, max_attempts=ATTEMPTS)}
    settings: Settings = make_settings(nats_url, redis_url, targets)
    settings = msgspec.structs.replace(
        settings, fleet=msgspec.structs.replace(settings.fleet, handlers=(NEVER, STUBBORN))
    )
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    Release.event = asyncio.Event()
    try:
        yield stack, stack.connections[0].jetstream()
    finally:
        Release.event.set()
        await stack.stop()


async def letters(js: JetStreamContext) -> list[DeadLetter]:
    decoder = msgspec.json.Decoder(DeadLetter)
    return [decoder.decode(m.data) async for m in read_stream(js, subjects.STREAM_DLQ, "jf.dlq.>")]


@pytest.mark.parametrize("handler_name", [NEVER, STUBBORN])
async def test_item5_a_handler_that_never_returns_times_out_and_its_job_ends_dead(
    running: tuple[InProcessStack, JetStreamContext], handler_name: str
) -> None:
    stack, js = running
    await submit_paths(js, stack.settings, "demo", ["/page/1"], "hang", handler=handler_name)

    async def dead_lettered() -> bool:
        return await dead(js, "demo") == 1

    loop = asyncio.get_running_loop()
    began = loop.time()
    # Two attempts of 1 s each, their backoffs and a hand-off offered to other workers:
    # well inside 30 s. Without a deadline the lease is renewed for ever and this never ends.
    await wait_for(dead_lettered, 30, "the timed-out job to be dead-lettered")
    took = loop.time() - began
    (letter,) = await letters(js)
    assert letter.reason == "attempts-exhausted", letter
    assert [r.reason for r in letter.history] == ["handler-timeout"] * ATTEMPTS, letter.history
    assert all(BUDGET_S <= r.duration_s < BUDGET_S + 3.0 for r in letter.history), letter.history
    decoder = msgspec.json.Decoder(Outcome)
    outcomes = [
        decoder.decode(m.data)
        async for m in read_stream(js, subjects.STREAM_OUTCOMES, subjects.outcomes("demo"))
    ]
    assert [o.attempt for o in outcomes] == list(range(1, ATTEMPTS + 1)), outcomes
    print(f"\n{handler_name}: dead-lettered {took:.1f} s after submit, history {letter.history}")
