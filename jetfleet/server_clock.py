"""The NATS server's time, for judging a job's age (DESIGN I9: never this host's clock).

A job's age is the server's now minus the time the server stored its work order. The
server's now is read from a stream info answer (its ``ts`` field) now and then and
carried forward on this process's monotonic clock, so a skewed or jumping host clock
changes nothing and a check costs no round trip.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import time

from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetfleet import subjects

log = logging.getLogger(__name__)

# How long a reading is carried forward before it is taken again: monotonic clocks drift
# by far less than a second over this, and an age limit is minutes or more.
RESYNC_S = 300.0
# After a failed reading, how long until the next try (meanwhile ages are unknown).
RETRY_S = 5.0
READ_TIMEOUT_S = 2.0


def parse_server_time(text: str) -> datetime.datetime:
    """A timestamp as nats-server writes it (RFC 3339, nanoseconds, ``Z``), in UTC.

    Raises:
        ValueError: if ``text`` is not such a timestamp.
    """
    stamp = text.strip().replace("Z", "+00:00")
    if "." in stamp:
        # Python reads at most microseconds.
        whole, rest = stamp.split(".", 1)
        digits = len(rest) - len(rest.lstrip("0123456789"))
        stamp = f"{whole}.{rest[:digits][:6].ljust(6, '0')}{rest[digits:]}"
    parsed = datetime.datetime.fromisoformat(stamp)
    if parsed.tzinfo is None:
        raise ValueError(f"server time {text!r} has no time zone")
    return parsed.astimezone(datetime.UTC)


class ServerClock:
    """The server's now, read from ``stream`` (default ``JF_WORK``) every ``RESYNC_S``."""

    def __init__(self, nc: NatsClient, stream: str = subjects.STREAM_WORK) -> None:
        self._nc = nc
        self._subject = f"$JS.API.STREAM.INFO.{stream}"
        self._reading: tuple[datetime.datetime, float] | None = None
        self._next_read = 0.0
        self._lock = asyncio.Lock()

    async def now(self) -> datetime.datetime | None:
        """The server's time now, or None while it cannot be read."""
        if time.monotonic() >= self._next_read:
            async with self._lock:
                if time.monotonic() >= self._next_read:
                    await self._read()
        if self._reading is None:
            return None
        server_at, read_at = self._reading
        return server_at + datetime.timedelta(seconds=time.monotonic() - read_at)

    async def age_s(self, stored: datetime.datetime) -> float | None:
        """Seconds since the server stored a message at ``stored``; None if unknown."""
        now = await self.now()
        return None if now is None else (now - stored).total_seconds()

    async def _read(self) -> None:
        sent = time.monotonic()
        try:
            answer = await self._nc.request(self._subject, b"", timeout=READ_TIMEOUT_S)
            stamp = parse_server_time(json.loads(answer.data)["ts"])
        except (NatsTimeoutError, NoRespondersError, KeyError, ValueError) as exc:
            # Unknown ages are not judged (the job runs or waits as before); say so once
            # per try, not per job.
            log.warning("cannot read the NATS server's time (%s); job ages unknown", exc)
            self._next_read = sent + RETRY_S
            return
        received = time.monotonic()
        # The server stamped its answer somewhere in the round trip: take the middle.
        self._reading = (stamp, (sent + received) / 2)
        self._next_read = received + RESYNC_S
