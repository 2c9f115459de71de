"""The time budget of one attempt: a handler past it is stopped and the attempt retried.

Without it a handler that never returns keeps its lease renewed for ever, and its job
neither ends nor frees its slot. The budget is the job's ``timeout_s`` (the work order
carries the target's when the job set none). A handler that keeps to it reports its own
reason (``http.get`` says ``timeout``); ``GRACE_S`` past it the handler is cancelled and
the attempt fails retryably as ``handler-timeout``. A handler that swallows its cancellation
cannot be stopped in asyncio: it is given ``UNWIND_S`` to end, then left behind (logged,
and kept referenced so it is not collected mid-run) and the job goes on without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from jetfleet.errors import ControlSignal, RetryLater
from jetfleet.schemas import HandlerOutput

log = logging.getLogger(__name__)

HANDLER_TIMEOUT = "handler-timeout"
# Past the budget, the handler's own timeout gets this long to report first.
GRACE_S = 0.5
# How long a handler cancelled at its deadline may take to unwind before it is left behind.
UNWIND_S = 1.0


class AttemptDeadline:
    """Runs handler calls under a time budget; keeps hold of those that refuse to stop."""

    def __init__(self) -> None:
        self.left_behind: set[asyncio.Task[HandlerOutput]] = set()

    async def run(
        self, call: Awaitable[HandlerOutput], budget_s: float, what: str
    ) -> HandlerOutput:
        """The handler's output, if it comes within ``budget_s`` (+ ``GRACE_S``) seconds.

        Raises:
            RetryLater: ``handler-timeout`` once that is spent.
            Exception: whatever the handler raised.
        """
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=budget_s + GRACE_S)
        except asyncio.CancelledError:
            task.cancel()  # the lease was lost or the worker drains: the handler stops too
            # It may end with an error of its own before the cancel lands (a process
            # resumed after a SIGSTOP finds its timeout and its lost lease at once):
            # nobody awaits it now, so take it, or asyncio reports it as never retrieved.
            task.add_done_callback(_retrieved)
            raise
        if done:
            return task.result()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=UNWIND_S)
        if done:
            with contextlib.suppress(BaseException):
                task.result()  # retrieved, so asyncio does not report it as never seen
        else:
            log.error(
                "%s ignored its cancellation %g s after its %g s budget; left running",
                what,
                UNWIND_S,
                budget_s,
            )
            self.left_behind.add(task)
            task.add_done_callback(self.left_behind.discard)
            task.add_done_callback(_retrieved)
        raise RetryLater(HANDLER_TIMEOUT, detail=f"no verdict within {budget_s:g} s")


def _retrieved(task: asyncio.Task[HandlerOutput]) -> None:
    """Take the outcome of a handler nobody awaits any more: its verdict no longer
    counts (the attempt ended without it), but a crash is still logged as one."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ControlSignal):
        log.error("a handler ended with a crash after its attempt was over", exc_info=exc)
