"""Which keys under a KV prefix exist, followed with a KV watch, so a check asked on
every grant costs no read for the keys that do not exist."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from nats.js.kv import KeyValue

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 10.0


class KeyWatch:
    """The keys matching ``pattern`` that exist, as far as the watch has seen.

    A watch does not see a key expire by its per-key TTL, so a key seen is only a hint
    (confirm it with a read); a key not seen does not exist, while the watch lives.
    """

    def __init__(self, bucket: KeyValue, pattern: str, what: str) -> None:
        self.bucket = bucket
        self.pattern = pattern
        self.what = what
        """What the keys are, for the log line should the watch die."""
        self.keys: set[str] = set()
        self.on_new: Callable[[str], None] | None = None
        """Called with a key the watch sees appear after it loaded (not one it knew, nor
        one added to ``keys`` by hand first)."""
        self._watching: asyncio.Task[None] | None = None
        self._warned = False

    async def start(self) -> None:
        """Load the keys that exist and follow changes."""
        watcher = await self.bucket.watch(self.pattern)
        loaded = asyncio.get_running_loop().create_future()
        self._watching = asyncio.create_task(self._follow(watcher, loaded))
        await asyncio.wait_for(loaded, LOAD_TIMEOUT_S)

    async def stop(self) -> None:
        """Stop following changes."""
        watching, self._watching = self._watching, None
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    def following(self) -> bool:
        """Whether the watch is alive. If it died, every ask must be read from KV:
        slower, but a key written since must not be missed (fail closed, not open)."""
        if self._watching is None or not self._watching.done():
            return self._watching is not None
        if not self._warned:
            self._warned = True
            log.error("%s watch stopped; reading every %s check from KV", self.what, self.what)
        return False

    async def _follow(self, watcher: Any, loaded: asyncio.Future[None]) -> None:
        async for entry in watcher:
            if entry is None:  # the end of the keys that existed when we started
                if not loaded.done():
                    loaded.set_result(None)
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self.keys.discard(entry.key)
            elif entry.key not in self.keys:
                self.keys.add(entry.key)
                if loaded.done() and self.on_new is not None:
                    self.on_new(entry.key)
