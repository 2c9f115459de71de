"""A user handler's own failure reason reaches the dead letter in a form the wire takes.

The sink refuses a failure whose reason has a line break or more than 1024 characters
(it becomes the letter's ``Jf-Reason`` header). Passed on as raised, such a reason made
every report of the job an ``error``: the job ran again until its attempts were spent.
The worker now fits the reason, and the job ends dead after its one permanent failure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
from jetfleet.schemas import DeadLetter, HandlerOutput, Outcome
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.errors import PermanentFailure
from jetfleet.settings import Settings
from jetfleet.simulator import TargetSimulator
from jetfleet.stream_reader import read_stream
from jetfleet.worker import HandlerContext, handler
from jetfleet.worker.verdict import MAX_REASON_CHARS, fit_reason
from tests.conftest import make_settings, wait_for
from tests.queueing.helpers import dead, submit_paths, target
from tests.stack import InProcessStack

WORDY = "tests.wordy-failure"
WORDY_REASON = "upstream said:\r\nInjected-Header: yes\n" + "x" * 2000


@handler(WORDY)
async def fails_wordily(ctx: HandlerContext) -> HandlerOutput:
    """Fails for good with a reason no header can carry."""
    raise PermanentFailure(WORDY_REASON, detail="the handler's own detail")


def test_fit_reason_keeps_a_short_reason_and_cleans_a_long_one() -> None:
    assert fit_reason("http-404") == ("http-404", "")
    fitted, note = fit_reason(WORDY_REASON)
    assert len(fitted) <= MAX_REASON_CHARS
    assert "\n" not in fitted and "\r" not in fitted
    assert fitted.startswith("upstream said: Injected-Header: yes x")
    assert "cut to fit" in note
    assert fit_reason("\n\n")[0] == "handler-failed"


@pytest.fixture
async def running(
    nats_url: str, redis_url: str, simulator: TargetSimulator
) -> AsyncIterator[tuple[InProcessStack, JetStreamContext]]:
    targets = {"demo": target(simulator.base_url, max_attempts=3)}
    settings: Settings = make_settings(nats_url, redis_url, targets)
    settings = msgspec.structs.replace(
        settings, fleet=msgspec.structs.replace(settings.fleet, handlers=(WORDY,))
    )
    stack = InProcessStack(settings)
    await stack.start(workers=1)
    try:
        yield stack, stack.connections[0].jetstream()
    finally:
        await stack.stop()


async def test_a_handler_reason_with_line_breaks_ends_dead_after_one_attempt(
    running: tuple[InProcessStack, JetStreamContext],
) -> None:
    stack, js = running
    await submit_paths(js, stack.settings, "demo", ["/page/1"], "wordy", handler=WORDY)

    async def dead_lettered() -> bool:
        return await dead(js, "demo") == 1

    await wait_for(dead_lettered, 30, "the wordy job to be dead-lettered")
    decoder = msgspec.json.Decoder(DeadLetter)
    (letter,) = [
        decoder.decode(m.data) async for m in read_stream(js, subjects.STREAM_DLQ, "jf.dlq.>")
    ]
    assert letter.reason == fit_reason(WORDY_REASON)[0]
    assert "the handler's own detail" in letter.detail and "cut to fit" in letter.detail
    outcomes = msgspec.json.Decoder(Outcome)
    attempts = [
        outcomes.decode(m.data).attempt
        async for m in read_stream(js, subjects.STREAM_OUTCOMES, subjects.outcomes("demo"))
    ]
    # One permanent failure ends the job: it is not run again for a reason the sink refused.
    assert attempts == [1]
