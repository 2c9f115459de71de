"""The one commit function. Every result reaches the world through here.

Order (see docs/commit.md): the result is published to ``jf.results.<target>`` with the
idempotency key as its ``Nats-Msg-Id`` FIRST, then the key is created in ``jf-committed``
(put-if-absent, per-key TTL = ``fleet.dedupe_ttl_s``). A crash between the two never loses
a result; a retry of the same unit of work inside the results stream's duplicate window is
dropped by the stream, and after it by the key. The leasing issue adds the fence and lease
checks in front of the write, here and nowhere else.
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.publish import publish_durably
from jetfleet.schemas import CommittedResult, SinkReply, Success

_encoder = msgspec.json.Encoder()


async def commit(
    js: JetStreamContext, committed: KeyValue, success: Success, dedupe_ttl_s: float
) -> SinkReply:
    """Commit ``success`` once per idempotency key.

    Returns:
        ``committed``, or ``suppressed:duplicate-key`` when this unit of work is done.
    """
    order = success.order
    if await _is_committed(committed, order.key):
        return SinkReply(status="suppressed:duplicate-key", detail=order.key)
    record = CommittedResult(
        job_id=order.job.id,
        target=order.target,
        url=order.job.url,
        key=order.key,
        handler=order.job.handler,
        worker=success.worker,
        attempt=success.attempt,
        duration_s=success.duration_s,
        output=success.output,
        versions=success.versions,
        identity=success.identity,
        fence=success.fence,
    )
    ack = await publish_durably(
        js, subjects.results(order.target), _encoder.encode(record), msg_id=f"res-{order.key}"
    )
    if ack.duplicate:
        return SinkReply(status="suppressed:duplicate-key", detail=order.key)
    try:
        await committed.create(
            order.key, f"{order.job.id} {ack.seq}".encode(), msg_ttl=dedupe_ttl_s
        )
    except KeyWrongLastSequenceError:
        # Another commit of the same work won the key after our result was stored: the
        # stream's duplicate window normally stops this; the key is the longer memory.
        return SinkReply(status="suppressed:duplicate-key", detail=order.key)
    return SinkReply(status="committed", detail=str(ack.seq))


async def _is_committed(committed: KeyValue, key: str) -> bool:
    try:
        entry = await committed.get(key)
    except Exception:  # KeyNotFoundError / KeyDeletedError: not committed
        return False
    return entry.value is not None
