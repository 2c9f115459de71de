"""An attempt cancelled (its lease lost, the worker draining) while its handler ends in
an error of its own takes that error: asyncio must not report a "Task exception was
never retrieved" for it (jetfleet/worker/attempt_deadline.py)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from jetfleet.schemas import HandlerOutput

from jetfleet.errors import RetryLater
from jetfleet.worker.attempt_deadline import AttemptDeadline


async def test_a_handler_failing_as_its_attempt_is_cancelled_is_not_left_unretrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        started = asyncio.Event()
        raised: list[str] = []

        async def handler() -> HandlerOutput:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                # Its own verdict, raised as the cancel lands (http.get's timeout).
                raised.append("timeout")
                raise RetryLater("timeout") from None
            raise AssertionError("not cancelled")

        attempt = asyncio.ensure_future(AttemptDeadline().run(handler(), 60.0, "handler"))
        await started.wait()
        (inner,) = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "handler"]  # type: ignore[union-attr]
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        await asyncio.wait({inner})  # ended; its outcome not taken here
        assert raised == ["timeout"] and not inner.cancelled()
        del inner, attempt
        gc.collect()
        await asyncio.sleep(0)
        assert [c["message"] for c in reported] == []
    finally:
        loop.set_exception_handler(previous)


async def test_a_handler_crashing_after_its_attempt_was_cancelled_is_logged_as_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = asyncio.Event()

    async def handler() -> HandlerOutput:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise TypeError("a bug in its clean-up") from None
        raise AssertionError("not cancelled")

    attempt = asyncio.ensure_future(AttemptDeadline().run(handler(), 60.0, "handler"))
    await started.wait()
    (inner,) = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "handler"]  # type: ignore[union-attr]
    attempt.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt
    await asyncio.wait({inner})
    await asyncio.sleep(0)  # its done-callbacks run
    crashes = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [str(r.exc_info[1]) for r in crashes if r.exc_info] == ["a bug in its clean-up"]
