"""Stopping an asyncio task for certain, even when something inside it drops a cancel.

On Python 3.11 ``asyncio.wait_for`` returns its result and drops a cancel that lands as
the result does (CPython gh-86296). nats-py's ``request`` awaits every reply that way,
so a task cancelled while a request is answered goes on as if never cancelled: the
worker's lease keeper, cancelled after a job's commit, renewed on for ever (its lease
live, its delivery kept from redelivery, the job never acked).
"""

from __future__ import annotations

import asyncio

RESEND_S = 0.05
"""How long a cancel is given before it is sent again."""


async def stop_task(task: asyncio.Task[None], resend_s: float = RESEND_S) -> None:
    """Cancel ``task`` until it has stopped; an error it ended with is raised here.

    The caller's own cancellation is not swallowed: it is raised here, ``task`` cancelled
    once more on the way out."""
    while not task.done():
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=resend_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
    if not task.cancelled():
        task.result()
