"""Stopping an asyncio task for certain, even when something inside it drops a cancel.

On Python 3.11 ``asyncio.wait_for`` returns its result and drops a cancel that lands as
the result does (CPython gh-86296). nats-py's ``request`` awaits every reply that way,
so a task cancelled while a request is answered goes on as if never cancelled: the
worker's lease keeper, cancelled after a job's commit, renewed on for ever (its lease
live, its delivery kept from redelivery, the job never acked).
"""

from __future__ import annotations

import asyncio
import random

RESEND_S = 0.05
"""How long, on average, a cancel is given before it is sent again."""

_rng = random.Random()


async def stop_task(task: asyncio.Task[None], resend_s: float = RESEND_S) -> None:
    """Cancel ``task`` until it has stopped; an error it ended with is raised here.

    Resends come at jittered times (0.5 to 1.5 times ``resend_s``): a fixed beat can
    stay in step with a task whose replies come on a beat of their own, and then every
    cancel lands as a reply does and is dropped (CI saw 490 renewals through 5 s of
    cancels every 50 ms against replies every 10 ms).

    The caller's own cancellation is not swallowed: it is raised here, ``task`` cancelled
    once more on the way out."""
    while not task.done():
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=resend_s * _rng.uniform(0.5, 1.5))
        except asyncio.CancelledError:
            task.cancel()
            raise
    if not task.cancelled():
        task.result()


def raise_if_cancel_dropped() -> None:
    """Raise ``CancelledError`` if the running task was cancelled and something inside
    it dropped the cancel (``Task.cancelling()`` still counts it).

    A loop that calls this each round stops at its next round, not at whichever resend
    of ``stop_task`` happens to land between replies."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
