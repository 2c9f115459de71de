"""Which identities some running worker owns, so a job pinned to one nobody owns can be
ended (``no-eligible-worker``) while a job pinned to a busy owner waits for it.

Each worker with an identity keeps the key ``owned.<digest of identity>`` in the
``jf-workers`` bucket alive: it writes it every ``ANNOUNCE_EVERY_S`` with a per-key
TTL of ``OWNED_TTL_S``, judged by the server's clock. The key is gone within that TTL
after the last owner stops. Readers cache each answer for ``CACHE_S``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoStreamResponseError
from nats.js.kv import KeyValue

from jetfleet import subjects

log = logging.getLogger(__name__)

OWNED_TTL_S = 30
ANNOUNCE_EVERY_S = OWNED_TTL_S / 3
CACHE_S = 5.0


def owned_key(identity: str) -> str:
    """The bucket key saying ``identity`` is owned (identities may hold any character;
    keys may not)."""
    return "owned." + hashlib.sha256(identity.encode()).hexdigest()[:32]


class IdentityPresence:
    """Announce this worker's identity; ask whether anyone owns another."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._answers: dict[str, tuple[bool, float]] = {}
        self._kv: KeyValue | None = None

    async def announce(self, identity: str, worker_id: str) -> None:
        """Keep ``identity`` marked owned until cancelled. Never dies of an error: a
        missed beat is retried at the next, well inside the TTL."""
        subject = f"$KV.{subjects.BUCKET_WORKERS}.{owned_key(identity)}"
        payload = f"{identity}\n{worker_id}".encode()
        while True:
            try:
                await self.js.publish(subject, payload, msg_ttl=OWNED_TTL_S)
            except (NatsTimeoutError, NoRespondersError, NoStreamResponseError) as exc:
                log.warning("announcing identity %s failed (%s); trying again", identity, exc)
            await asyncio.sleep(ANNOUNCE_EVERY_S)

    async def owned(self, identity: str) -> bool:
        """Whether some running worker announced ``identity`` within the TTL. When it
        cannot be read, the answer is yes: a pinned job then waits rather than ends."""
        cached = self._answers.get(identity)
        if cached is not None and time.monotonic() - cached[1] < CACHE_S:
            return cached[0]
        try:
            if self._kv is None:
                self._kv = await self.js.key_value(subjects.BUCKET_WORKERS)
            entry = await self._kv.get(owned_key(identity))
            answer = bool(entry.value)
        except KeyNotFoundError:  # KeyDeletedError is a subclass: the TTL ran out
            answer = False
        except Exception as exc:  # an outage must not end anybody's jobs
            log.warning("cannot tell whether identity %s is owned (%s)", identity, exc)
            return True
        self._answers[identity] = (answer, time.monotonic())
        return answer
