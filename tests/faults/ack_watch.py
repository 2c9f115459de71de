"""A wire watcher on ``$JS.ACK.>``: every ack, nak, term and progress beat any worker
sends for a JetStream delivery, as the server receives it.

The design (docs/commit.md, "The worker's side") lets a worker ack, nak or term a
delivery it was granted a lease for only while it holds that lease; a holder whose lease
was superseded (its report answered ``rejected:*``, or its keeper found the lease lost)
must stay silent, or it would settle a message another worker now runs. ``settled`` finds
what such deliveries sent anyway. (A delivery that never got a lease may ack or nak: an
``already-done`` answer, a hand-back; and a later delivery acting before an earlier one
settles is normal after a stall, so wire order alone proves nothing.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

SETTLING = ("+ACK", "-NAK", "+TERM")


@dataclass(frozen=True)
class AckEvent:
    """One message on ``$JS.ACK``: which delivery of which stream message, and what."""

    stream: str
    consumer: str
    stream_seq: int
    delivered: int
    """Which delivery of the message this is (1 for the first)."""
    verb: str
    at: float


def parse_ack(subject: str, payload: bytes, at: float) -> AckEvent:
    """Decode an ack subject, v1 (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...``,
    9 tokens) or v2 (with domain and account hash after ``ACK``, 12 or more)."""
    tokens = subject.split(".")
    if len(tokens) == 9:
        stream, consumer, delivered, sseq = tokens[2:6]
    elif len(tokens) >= 12:
        stream, consumer, delivered, sseq = tokens[4:8]
    else:
        raise ValueError(f"not a JetStream ack subject: {subject!r}")
    verb = payload.split(b" ", 1)[0].decode() or "+ACK"  # an empty ack is an ack
    return AckEvent(stream, consumer, int(sseq), int(delivered), verb, at)


@dataclass
class AckWatcher:
    """Records ``$JS.ACK.>`` on an observer connection of its own."""

    events: list[AckEvent] = field(default_factory=list)
    _sub: Subscription | None = None

    async def start(self, nc: NatsClient) -> None:
        """Subscribe; the server has the subscription when this returns."""

        async def seen(msg: Msg) -> None:
            self.events.append(parse_ack(msg.subject, msg.data, time.monotonic()))

        self._sub = await nc.subscribe("$JS.ACK.>", cb=seen)
        await nc.flush()

    async def stop(self) -> None:
        """Unsubscribe (idempotent)."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    def settled(self, stream: str, deliveries: set[tuple[int, int]]) -> list[AckEvent]:
        """Acks, naks and terms sent for any of ``deliveries`` ((stream seq, delivery
        number) of messages of ``stream``)."""
        return [
            e
            for e in self.events
            if e.stream == stream
            and e.verb in SETTLING
            and (e.stream_seq, e.delivered) in deliveries
        ]

    def redelivered(self, stream: str) -> set[int]:
        """Sequences of ``stream`` seen on the wire from a second or later delivery."""
        return {e.stream_seq for e in self.events if e.stream == stream and e.delivered > 1}

    def count(self, verb: str) -> int:
        """How many messages of one kind (``+ACK``, ``-NAK``, ``+TERM``, ``+WPI``)."""
        return sum(1 for e in self.events if e.verb == verb)
