"""Whether any worker of a region is running: for jobs pinned to a region nobody serves.

Workers are not declared centrally, so "no worker of region R exists" cannot be known
from the settings; it can be seen. Every running worker with a region (``worker.region``,
or its identity's) keeps the key ``region.<digest of region>`` in ``jf-workers`` alive:
a plain put (any number of workers share the key) with a per-key TTL of
``worker.claim_ttl_s``, every third of it, judged by the server's clock. A worker
holding a job pinned to a region it is not in, past its patience, asks ``present``: no
key means no worker of the region ran for a whole TTL, and the job goes to the backstop
(``no-eligible-worker``) rather than loop for ever. Answers are cached ``CACHE_S``.

The key is written through a ``PresenceWriter`` (a worker's asks the leaser on
``jf.presence``: it has no KV rights) and read from the bucket directly.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.leader_reads import replica_bucket
from jetfleet.lease_store import ttl_whole_seconds
from jetfleet.presence_writer import DirectPresenceWriter, PresenceWriter
from jetfleet.stream_reader import read_stream

log = logging.getLogger(__name__)

CACHE_S = 5.0
CACHE_MAX = 256


def region_key(region: str) -> str:
    """The bucket key saying a worker of ``region`` runs (regions may hold any
    character; keys may not)."""
    return "region." + hashlib.sha256(region.encode()).hexdigest()[:32]


class RegionPresence:
    """Announce this worker's region; ask whether any worker of another one runs."""

    def __init__(self, js: JetStreamContext, writer: PresenceWriter | None = None) -> None:
        self.js = js
        self.writer: PresenceWriter = writer or DirectPresenceWriter(js)
        self._kv: KeyValue = replica_bucket(js, subjects.BUCKET_WORKERS)
        self._answers: dict[str, tuple[bool, float]] = {}

    async def announce(self, region: str, ttl_s: float) -> None:
        """Say ``region`` has a running worker every third of ``ttl_s`` until cancelled.
        A failed write is logged once per streak and tried at the next beat."""
        ttl = ttl_whole_seconds(ttl_s)
        key = region_key(region)
        failing = False
        while True:
            try:
                await self.writer.put(
                    subjects.BUCKET_WORKERS, key, region.encode(), ttl_s=ttl, timeout_s=ttl / 3
                )
                failing = False
            except Exception as exc:  # CancelledError is not one: a drain still stops it
                if not failing:
                    log.warning("announcing region %s failed (%r); retrying", region, exc)
                failing = True
            await asyncio.sleep(ttl / 3)

    async def present(self, region: str) -> bool:
        """Whether some running worker is of ``region``. When it cannot be read, yes: a
        pinned job then waits rather than ends."""
        cached = self._answers.get(region)
        if cached is not None and time.monotonic() - cached[1] < CACHE_S:
            return cached[0]
        try:
            entry = await self._kv.get(region_key(region))
            answer = bool(entry.value)
        except KeyNotFoundError:  # never announced, or every announcer stopped a TTL ago
            answer = False
        except Exception as exc:  # an outage must not end anybody's jobs
            log.warning("cannot tell whether a worker of region %s runs (%s)", region, exc)
            return True
        if len(self._answers) >= CACHE_MAX:
            self._answers.clear()
        self._answers[region] = (answer, time.monotonic())
        return answer


async def regions_present(js: JetStreamContext) -> list[str]:
    """The regions some running worker announces now, by name (for the dashboard): read
    from the bucket's stream, where a key whose TTL ran out is gone."""
    latest: dict[str, str] = {}
    stream = f"KV_{subjects.BUCKET_WORKERS}"
    async for msg in read_stream(js, stream, f"$KV.{subjects.BUCKET_WORKERS}.region.>"):
        if not msg.data or (msg.headers or {}).get("KV-Operation"):
            latest.pop(msg.subject, None)  # deleted or purged
        else:
            latest[msg.subject] = msg.data.decode(errors="replace")
    return sorted(set(latest.values()))
