"""Pull a rate-bound target one job at a time.

When a target's permits say wait (``rate-limited``, ``target-held``), only one of its
jobs per permit can run. Fetching a batch of ten then would take ten deliveries, ask the
leaser ten times and hand nine back, every interval: the target is dequeued and buffered
rather than left in its queue. So for a while after such a refusal the worker fetches
the target's jobs one at a time, and fetches the next only once the leaser has answered
for the last (and the hold that answer set has passed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterable

RATE_BOUND_S = 5.0
"""How long after a rate refusal a target is pulled one job at a time."""
ANSWER_WAIT_S = 5.0
"""The longest the pull loop waits for a lease answer before fetching again anyway."""


class RatePacing:
    """Which targets are rate-bound, and the lease questions in flight for each."""

    def __init__(self) -> None:
        self._bound_until: dict[str, float] = {}
        self._asking: Counter[str] = Counter()
        self._answered = asyncio.Condition()

    def rate_bound(self, target: str) -> None:
        """``target``'s permit said wait: pull it one job at a time for a while."""
        self._bound_until[target] = time.monotonic() + RATE_BOUND_S

    def is_bound(self, targets: Iterable[str]) -> bool:
        """Whether every one of ``targets`` (a lane's) is rate-bound now."""
        now = time.monotonic()
        return all(self._bound_until.get(t, 0.0) > now for t in targets)

    def asking(self, target: str) -> None:
        """A lease question for a job of ``target`` is about to be asked."""
        self._asking[target] += 1

    async def answered(self, target: str) -> None:
        """The question ``asking`` announced has its answer (or was given up)."""
        self._asking[target] -= 1
        if self._asking[target] <= 0:
            del self._asking[target]
        async with self._answered:
            self._answered.notify_all()

    async def wait_answers(self, targets: Iterable[str]) -> None:
        """Until no lease question of ``targets`` is in flight (ANSWER_WAIT_S at most)."""
        names = tuple(targets)
        async with self._answered:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._answered.wait_for(lambda: not any(self._asking[t] for t in names)),
                    ANSWER_WAIT_S,
                )
