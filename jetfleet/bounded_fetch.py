"""Pull-subscription fetches that hand out no more deliveries than asked for, and lose none.

nats-py 2.16's ``fetch(n)`` with ``n > 1`` first empties the subscription's pending queue,
all of it, whatever ``n`` is, and then still asks the server for ``n`` minus what it took
(a batch of 0 or less, which the server serves as 1). Deliveries land in that queue
outside any fetch when a pull request is answered after its fetch gave up: a message
published as the request expires, or a loop too busy to read the socket before the
fetch's timer fired. So a worker that took ``n`` slots started more jobs than it had
slots (seen under load: 13 requests hanging at a target whose lane has 8) and, as each
of those jobs ended, gave back a slot never taken: the lane kept the extra capacity for
good. And when that server request failed (a 503 while a consumer's leader moves), the
deliveries already taken from the queue were lost with the exception: to their ack wait
for a work consumer, for good for a reader whose consumer acks nothing.

``fetch_at_most`` takes what is queued first, at most ``n``, without asking the server;
only with an empty queue does it fetch, and then nats-py returns at most ``n``.
``take_queued`` empties the queue for a caller that must hand deliveries back rather than
let them wait (a worker whose slots are all busy, or that stops pulling).
"""

from __future__ import annotations

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import FetchTimeoutError


def take_queued(sub: JetStreamContext.PullSubscription, most: int | None = None) -> list[Msg]:
    """Up to ``most`` (all, when None) deliveries waiting in the subscription's queue,
    taken off it; status messages there (answers to pull requests already over) are
    dropped, as nats-py's own fetch drops them."""
    # nats-py keeps them in its subscription's private queue (pinned 2.16: the tests in
    # tests/test_bounded_fetch.py fail if that changes).
    inner = sub._sub
    queue = inner._pending_queue
    taken: list[Msg] = []
    while (most is None or len(taken) < most) and not queue.empty():
        msg = queue.get_nowait()
        inner._pending_size -= len(msg.data)
        if not JetStreamContext.is_status_msg(msg):
            taken.append(msg)
    return taken


async def fetch_at_most(sub: JetStreamContext.PullSubscription, n: int, wait_s: float) -> list[Msg]:
    """Up to ``n`` deliveries: those already queued, else what the server has within
    ``wait_s`` (``[]`` when nothing came).

    Raises:
        nats.js.errors.APIError: the pull was refused (a 503 while the consumer has no
            leader, ...); nothing taken is lost with it: a fetch is asked for only when
            nothing was queued.
    """
    queued = take_queued(sub, n)
    if queued:
        return queued
    try:
        msgs = await sub.fetch(n, timeout=wait_s)
    except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
        return []
    # With the queue empty nats-py returns at most n; should that change, what is beyond
    # goes back on the queue for the next call rather than be run without a slot.
    for msg in msgs[n:]:
        sub._sub._pending_queue.put_nowait(msg)
        sub._sub._pending_size += len(msg.data)
    return msgs[:n]
