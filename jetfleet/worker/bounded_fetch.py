"""A pull subscription's fetch that tells the deliveries asked for from the surplus.

nats-py 2.16's ``fetch(n)`` first empties the subscription's pending queue, all of it,
whatever ``n`` is, and then asks the server for more. Deliveries land in that queue
outside any fetch when a pull request is answered after its fetch gave up: a message
published as the request expires, or a loop too busy to read the socket before the
fetch's timer fired. The next ``fetch(n)`` then returns them all. The worker takes one
slot per delivery it asks for, so such a surplus ran more jobs than the lane has slots
(seen under load: 13 requests hanging at a target whose lane has 8), and as each of those
jobs ended it gave back a slot that had never been taken, so the lane kept the extra
capacity for good.

``fetch_at_most`` splits what came into the ``n`` asked for and the surplus, which the
caller must place at once (a free slot, else handed back): kept for later, a delivery
could wait behind busy slots past its ack wait.
"""

from __future__ import annotations

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import FetchTimeoutError


async def fetch_at_most(
    sub: JetStreamContext.PullSubscription, n: int, wait_s: float
) -> tuple[list[Msg], list[Msg]]:
    """Up to ``n`` deliveries within ``wait_s`` (none: ``[]``), and any beyond ``n`` the
    fetch returned."""
    try:
        msgs = await sub.fetch(n, timeout=wait_s)
    except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
        return [], []
    return msgs[:n], msgs[n:]
