"""An event loop on a thread of its own, for simulated sites run beside a busy caller.

A simulator stamps each request as its handler runs. Sharing the caller's event loop,
a request that arrives while the caller reads status or streams is stamped only when
that read yields, so stamps bunch and a sliding 1 s count can exceed what any sender
sent. On their own loop the sites stamp requests as they arrive (the caller's work holds
them up only by the GIL's switch interval, milliseconds). Arrivals still trail their
rate permits by each sender's own delay: docs/cli.md#jetfleet-demo.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SiteLoop:
    """A daemon thread running an event loop until ``close``; ``run`` awaits a
    coroutine on it from another loop."""

    def __init__(self, name: str = "jetfleet-sites") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the site loop and wait for it without blocking this loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def close(self) -> None:
        """Stop the loop and its thread (what runs on it should be stopped first)."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
