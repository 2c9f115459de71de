"""Pull a rate-bound target one job at a time.

When a target's permits say wait (``rate-limited``, ``target-held``), only one of its
jobs per permit can run. Fetching a batch of ten then would take ten deliveries, lease
ten jobs, ask for ten permits and hand nine back, every interval: the target is dequeued
and buffered rather than left in its queue. So for a while after such an answer the
worker fetches the target's jobs one at a time, and fetches the next only once the last
has its answer (and the hold that answer set has passed). A delivery's answer is its
first request's permit (``Worker._first_permit``; asked inside the handler, at its
``ready``, for a handler registered with ``permit_when_ready``), or its lease's when the
lease is not granted, or its end when it asks for neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable

RATE_BOUND_S = 5.0
"""How long after a rate refusal a target is pulled one job at a time."""
ANSWER_WAIT_S = 5.0
"""The longest the pull loop waits for an answer before fetching again anyway."""


class RatePacing:
    """Which targets are rate-bound, and the deliveries of each still waiting for their
    answer (counted from when they are fetched, so a fetch loop that has not yet
    let its job run cannot overtake it)."""

    def __init__(self) -> None:
        self._bound_until: dict[str, float] = {}
        self._waiting: dict[str, str] = {}
        """Delivery (reply subject) -> target, from fetch to answer."""
        self._answered = asyncio.Condition()

    def rate_bound(self, target: str) -> None:
        """``target``'s permit said wait: pull it one job at a time for a while."""
        self._bound_until[target] = time.monotonic() + RATE_BOUND_S

    def is_bound(self, targets: Iterable[str]) -> bool:
        """Whether every one of ``targets`` (a lane's) is rate-bound now."""
        now = time.monotonic()
        return all(self._bound_until.get(t, 0.0) > now for t in targets)

    def fetched(self, delivery: str, target: str) -> None:
        """A delivery of ``target`` was fetched; its answer is awaited."""
        if delivery:
            self._waiting[delivery] = target

    async def answered(self, delivery: str) -> None:
        """The delivery has its permit's answer (or its lease's, when refused), or it
        will ask for neither (the job ended before, or was handed back). Idempotent."""
        if self._waiting.pop(delivery, None) is None:
            return
        async with self._answered:
            self._answered.notify_all()

    async def wait_answers(self, targets: Iterable[str]) -> None:
        """Until no delivery of ``targets`` awaits its answer (ANSWER_WAIT_S at
        most)."""
        names = frozenset(targets)

        def settled() -> bool:
            return not any(t in names for t in self._waiting.values())

        async with self._answered:
            # asyncio.timeout, not wait_for, which on 3.11 can drop a cancel (gh-86296).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ANSWER_WAIT_S):
                    await self._answered.wait_for(settled)
