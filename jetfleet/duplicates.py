"""Recording that another job's commit settled this one (``jf.duplicates.<target>``).

A job whose idempotency key another job committed ends with no side effect of its own;
the record is what lets status count it as committed. The service that finds the other
commit writes it before it answers: the leaser before ``already-done``, the sink before
``suppressed:duplicate-key`` and its backstop before it deletes an exhausted job's
message. A worker writes no stream: it acks only once that answer came, so the record is
stored before the job leaves the queue (docs/commit.md#duplicates).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.publish import RETRY_FOR_S, publish_durably
from jetfleet.schemas import Duplicate

_encoder = msgspec.json.Encoder()


async def record_duplicate(
    js: JetStreamContext,
    job_id: str,
    target: str,
    key: str,
    committed_by: str,
    via: Literal["already-done", "suppressed"],
    retry_for_s: float = RETRY_FOR_S,
) -> bool:
    """Record that ``committed_by``'s commit settled job ``job_id``; False when there is
    nothing to record (the commit is the job's own, an ack that was lost).

    The message id ``dup-<job id>`` makes a record written again (a crash before the
    answer, the ack or the delete; a worker of an older version that still writes it
    itself) land once inside the duplicate window. ``retry_for_s`` bounds the retries
    through a leader election (a caller answering a request gives up sooner, and answers
    ``busy``).

    Raises:
        SubmitError: when the stream did not store it (the caller must not answer the
            job as settled).
    """
    if committed_by == job_id:
        return False
    record = Duplicate(job_id=job_id, target=target, key=key, committed_by=committed_by, via=via)
    await publish_durably(
        js,
        subjects.duplicates(target),
        _encoder.encode(record),
        msg_id=f"dup-{job_id}",
        retry_for_s=retry_for_s,
    )
    return True
