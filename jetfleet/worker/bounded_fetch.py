"""A pull subscription's fetch that never hands out more deliveries than it was asked for.

nats-py 2.16's ``fetch(n)`` first empties the subscription's pending queue, all of it,
whatever ``n`` is, and then asks the server for more. Deliveries land in that queue
outside any fetch when a pull request is answered after its fetch gave up: a message
published as the request expires, or a loop too busy to read the socket before the
fetch's timer fired. The next ``fetch(n)`` then returns them all. The worker takes one
slot per delivery it asks for, so such a surplus ran more jobs than the lane has slots
(seen under load: 13 requests hanging at a target whose lane has 8), and as each of those
jobs ended it gave back a slot that had never been taken, so the lane kept the extra
capacity for good.

``BoundedFetch`` returns at most ``n`` and keeps the rest for the next call, which is
served from it without asking the server: nothing is handed back, so no delivery is
spent. What is left when the pull loop stops goes back through ``surplus()``.
"""

from __future__ import annotations

from collections import deque

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import FetchTimeoutError


class BoundedFetch:
    """``fetch`` over one pull subscription, at most ``n`` deliveries a call."""

    def __init__(self, sub: JetStreamContext.PullSubscription) -> None:
        self.sub = sub
        self._kept: deque[Msg] = deque()

    async def fetch(self, n: int, wait_s: float) -> list[Msg]:
        """Up to ``n`` deliveries: those kept from an earlier call first (without asking
        the server), else what the server has within ``wait_s``; [] when nothing came."""
        if self._kept:
            return [self._kept.popleft() for _ in range(min(n, len(self._kept)))]
        try:
            msgs = await self.sub.fetch(n, timeout=wait_s)
        except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
            return []
        self._kept.extend(msgs[n:])
        return msgs[:n]

    def surplus(self) -> list[Msg]:
        """Take the deliveries kept for a later call (to hand back when there is none)."""
        kept = list(self._kept)
        self._kept.clear()
        return kept
