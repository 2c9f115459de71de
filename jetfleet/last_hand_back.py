"""Why a job's last delivery was handed back, for the dead letter the backstop writes.

A worker handing back a job's last delivery (its ``num_delivered`` has reached
``fleet.max_deliver``, so the server will not deliver it again) notes the reason under
``handback.<job id>`` in ``jf-workers``, with a per-key TTL. The sink reads it when the
max-deliveries advisory comes, so the letter can say what kept the job from running
(its target at its cap, held, quarantined) rather than only that nobody ran it. The
worker writes it through a ``PresenceWriter`` (the leaser, on ``jf.presence``).
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from jetfleet import subjects
from jetfleet.presence_writer import PresenceWriter

log = logging.getLogger(__name__)

# Long enough for a sink that was down for a while to still find the note; no longer
# than the bucket keeps anything (topology.bucket_ttls).
NOTE_TTL_S = 3600


def _key(job_id: str) -> str:
    return f"handback.{job_id}"


async def note_last_hand_back(writer: PresenceWriter, job_id: str, reason: str) -> None:
    """Record ``reason`` as the job's last hand-back. Best effort: without the note the
    letter is still written, with a less precise reason."""
    try:
        await writer.put(
            subjects.BUCKET_WORKERS, _key(job_id), reason.encode()[:1024], ttl_s=NOTE_TTL_S
        )
    except Exception as exc:
        log.warning("could not note why job %s was last handed back: %s", job_id, exc)


async def last_hand_back(js: JetStreamContext, job_id: str) -> str | None:
    """The reason noted for the job's last hand-back, or None if there is none."""
    kv = await js.key_value(subjects.BUCKET_WORKERS)
    try:
        entry = await kv.get(_key(job_id))
    except KeyNotFoundError:
        return None
    return entry.value.decode(errors="replace") if entry.value else None
