"""An attempt cancelled (its lease lost, the worker draining) while its handler ends in
an error of its own takes that error: asyncio must not report a "Task exception was
never retrieved" for it, and a crash there is still logged as one
(jetfleet/worker/attempt_deadline.py)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from jetfleet.schemas import HandlerOutput

from jetfleet.errors import RetryLater
from jetfleet.worker.attempt_deadline import AttemptDeadline


async def cancel_while_it_ends_with(error: Exception) -> asyncio.Task[HandlerOutput]:
    """Run a handler under an attempt, cancel the attempt, and let the handler end with
    ``error`` raised as the cancel lands; the handler's task, ended, its outcome not
    taken here (its done-callbacks, registered before the wait's, have run)."""
    started = asyncio.Event()

    async def handler() -> HandlerOutput:
        started.set()
        try:
            await asyncio.sleep(30)  # a handler still running: only the cancel ends it
        except asyncio.CancelledError:
            raise error from None
        raise AssertionError("not cancelled")

    attempt = asyncio.ensure_future(AttemptDeadline().run(handler(), 60.0, "handler"))
    await started.wait()
    (inner,) = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "handler"]  # type: ignore[union-attr]
    attempt.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt
    await asyncio.wait({inner})
    assert not inner.cancelled()  # it ended with its own error, not the cancel
    return inner


async def test_a_handler_failing_as_its_attempt_is_cancelled_is_not_left_unretrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        # Its own verdict, raised as the cancel lands (http.get's timeout).
        inner = await cancel_while_it_ends_with(RetryLater("timeout"))
        del inner
        gc.collect()  # an unretrieved exception is reported as its task is collected
        assert [c["message"] for c in reported] == []
    finally:
        loop.set_exception_handler(previous)


async def test_a_handler_crashing_after_its_attempt_was_cancelled_is_logged_as_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    await cancel_while_it_ends_with(TypeError("a bug in its clean-up"))
    crashes = [
        str(r.exc_info[1])
        for r in caplog.records
        if r.levelname == "ERROR" and r.exc_info and "after its attempt" in r.getMessage()
    ]
    assert crashes == ["a bug in its clean-up"]
