"""How long a delivery is surely still this worker's: until its ack wait runs out.

JetStream redelivers a message once its ack wait has passed since the delivery or the
last ``+WPI``, and then honours an ack, nak or term sent on the old delivery's reply
subject as if it were the new one's (notes/jetstream-facts.md). So a worker that cannot
tell whether it still holds a job's lease may nak only while this timer says the
delivery has not been handed to anyone else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SEND_MARGIN_S = 1.0
"""Room for a nak decided now to reach the server (a busy machine, a slow link)."""
FETCH_SLACK_S = 1.0
"""How long before its processing began a delivery may have been fetched (a batch is
started at once; a single job waits at most SLOT_WAIT_S for a slot)."""


@dataclass
class AckTimer:
    """When the delivery's ack wait last restarted (monotonic, on the safe side)."""

    ack_wait_s: float
    restarted_at: float = field(default_factory=lambda: time.monotonic() - FETCH_SLACK_S)

    def restarted(self, sent_at: float) -> None:
        """A ``+WPI`` sent at ``sent_at`` was accepted: the ack wait runs from then on."""
        self.restarted_at = max(self.restarted_at, sent_at)

    def still_ours(self) -> bool:
        """Whether the ack wait surely has not run out (so no redelivery was made)."""
        return time.monotonic() < self.restarted_at + self.ack_wait_s - SEND_MARGIN_S
