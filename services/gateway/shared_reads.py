"""The dashboard's reads, shared by every open tab: each answer is computed once and
served to every request for the same read (route and query) that comes within
``FRESH_S`` of it, and requests that arrive while it is being computed wait for it.

Each read costs a handful to a few dozen JetStream API calls (ephemeral consumers
created and deleted included); without sharing, ten tabs polling every 2 s cost ten
times one. ``FRESH_S`` is below the page's poll interval, so a tab never sees an answer
older than the one before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

FRESH_S = 1.0
"""How long one computed answer is served again."""


class SharedReads:
    """Answers by key (the read's route and query), each kept ``FRESH_S``."""

    def __init__(self, fresh_s: float = FRESH_S) -> None:
        self.fresh_s = fresh_s
        self._done: dict[str, tuple[float, dict[str, Any]]] = {}
        self._running: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self.computed = 0
        """Answers computed (not served from another request's)."""

    async def get(
        self, key: str, compute: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """The answer of read ``key``: a fresh one already computed, the one being
        computed, or ``compute()``'s. A failure is not kept: the next request tries again.
        """
        now = asyncio.get_running_loop().time()
        done = self._done.get(key)
        if done is not None and now - done[0] < self.fresh_s:
            return done[1]
        task = self._running.get(key)
        if task is None:
            task = asyncio.ensure_future(self._compute(key, compute))
            self._running[key] = task
        # shield: one waiter's timeout or disconnect must not cancel the others' answer.
        return await asyncio.shield(task)

    async def _compute(
        self, key: str, compute: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        try:
            answer = await compute()
        finally:
            self._running.pop(key, None)
        self.computed += 1
        now = asyncio.get_running_loop().time()
        self._done[key] = (now, answer)
        # Bounded: drop the answers gone stale (one per route and distinct query seen).
        for stale in [k for k, (at, _) in self._done.items() if now - at >= self.fresh_s]:
            del self._done[stale]
        return answer
