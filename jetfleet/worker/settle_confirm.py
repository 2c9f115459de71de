"""Acks and terms the server confirmed, checked off the job's path.

A plain ``+ACK`` is fire-and-forget: while a work consumer has no leader (its node was
killed, an election runs; up to ~12 s on a cluster), the server drops it silently. The
job was committed, but its message stays pending: it holds a place under
``max_ack_pending`` until ``ack_wait`` runs out, then goes to another worker, which hears
``already-done`` from the leaser. On the 3-node chaos soak a stream leader kill lost
26-60 acks that way.

So each ack (and term) goes out as a request on the delivery's reply subject, which the
server answers once the consumer has taken it: the same one publish as before, plus the
server's one empty reply. The job does not wait for that reply; a task does, and sends the
ack again when it does not come (no responders: no consumer leader; or no answer within
``CONFIRM_WAIT_S``), while the delivery is surely still this worker's (its ack timer),
at most ``MAX_SENDS`` times and for ``GIVE_UP_S``. Sending again is safe: the job's
commit is fenced and deduplicated, and a second ack of one delivery is a no-op. Past
the ack wait it stops: the redelivery's holder is told ``already-done`` and acks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from nats.aio.client import Client
from nats.aio.msg import Msg

from jetfleet.backoff import Backoff
from jetfleet.worker.ack_timer import AckTimer

log = logging.getLogger(__name__)

CONFIRM_WAIT_S = 2.0
"""How long to wait for the server's reply to one send (it answers in milliseconds; an
ack to a consumer with no leader gets no reply, or a no-responders status at once)."""
MAX_SENDS = 12
"""Sends of one ack at most."""
GIVE_UP_S = 30.0
"""And for at most this long: a consumer election took up to ~12 s on the 3-node soak
(no responders fails a send at once, so the pauses set the pace: 18-35 s for 12 sends)."""
FIRST_PAUSE_S = 0.5
LAST_PAUSE_S = 4.0
DRAIN_WAIT_S = 5.0
"""How long a worker's drain waits for acks not yet confirmed before it closes."""


class SettleConfirmations:
    """Sends each settle (``+ACK``, ``+TERM reason``) as a request and confirms it in the
    background; ``stats`` counts ``ack-confirmed``, ``ack-resent`` and
    ``ack-unconfirmed`` (given up: the ack wait ran out or ``MAX_SENDS`` were spent)."""

    def __init__(self, nc: Client, stats: Counter[str]) -> None:
        self.nc = nc
        self.stats = stats
        self._pending: set[asyncio.Task[None]] = set()

    def send(self, msg: Msg, payload: bytes, timer: AckTimer | None) -> None:
        """Settle ``msg`` with ``payload`` (b"" is an ack); returns at once."""
        if not msg.reply:
            return
        task = asyncio.create_task(self._confirm(msg.reply, payload, timer))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _confirm(self, reply: str, payload: bytes, timer: AckTimer | None) -> None:
        pause = Backoff(FIRST_PAUSE_S, LAST_PAUSE_S)
        give_up_at = time.monotonic() + GIVE_UP_S
        for sent in range(1, MAX_SENDS + 1):
            try:
                await self.nc.request(reply, payload, timeout=CONFIRM_WAIT_S)
            except Exception as exc:  # timeout, no responders, reconnecting: send again
                failure = type(exc).__name__
            else:
                self.stats["ack-confirmed"] += 1
                return
            late = time.monotonic() > give_up_at
            if sent == MAX_SENDS or late or (timer is not None and not timer.still_ours()):
                break
            self.stats["ack-resent"] += 1
            await asyncio.sleep(pause.next_s())
        # Not lost for good: the job is committed, and its redelivery's holder acks it.
        self.stats["ack-unconfirmed"] += 1
        log.warning(
            "settle of %s not confirmed after %d sends (%s); its redelivery will be "
            "told already-done",
            reply,
            sent,
            failure,
        )

    async def drain(self, timeout_s: float = DRAIN_WAIT_S) -> None:
        """Wait up to ``timeout_s`` for the settles still unconfirmed, then drop them."""
        if not self._pending:
            return
        _, waiting = await asyncio.wait(set(self._pending), timeout=timeout_s)
        for task in waiting:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*waiting, return_exceptions=True)
