"""Recording that another job's commit settled this one (``jf.duplicates.<target>``).

A job whose idempotency key another job committed ends with no side effect of its own;
the record is what lets status count it as committed. The worker writes it before it
acks, and the sink's backstop before it deletes an exhausted job's message.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.publish import publish_durably
from jetfleet.schemas import Duplicate, WorkOrder

_encoder = msgspec.json.Encoder()


async def record_duplicate(
    js: JetStreamContext,
    order: WorkOrder,
    committed_by: str,
    via: Literal["already-done", "suppressed"],
) -> bool:
    """Record that ``committed_by``'s commit settled ``order``'s job; False when there is
    nothing to record (the commit is the job's own, an ack that was lost).

    The message id ``dup-<job id>`` makes a record written again (a crash before the ack
    or the delete) land once inside the duplicate window.
    """
    if committed_by == order.job.id:
        return False
    record = Duplicate(
        job_id=order.job.id,
        target=order.target,
        key=order.key,
        committed_by=committed_by,
        via=via,
    )
    await publish_durably(
        js,
        subjects.duplicates(order.target),
        _encoder.encode(record),
        msg_id=f"dup-{order.job.id}",
    )
    return True
