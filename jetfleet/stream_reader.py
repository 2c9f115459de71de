"""Read every message of a stream (or a filter of it) once, from the start, without a
durable consumer: for exports, listings and tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import FetchTimeoutError, NotFoundError

BATCH = 500


async def read_stream(js: JetStreamContext, stream: str, filter_subject: str) -> AsyncIterator[Msg]:
    """Yield the messages of ``stream`` matching ``filter_subject`` that exist now, in order."""
    try:
        info = await js.stream_info(stream, subjects_filter=filter_subject)
    except NotFoundError:
        return
    remaining = sum((info.state.subjects or {}).values())
    if remaining == 0:
        return
    config = js_api.ConsumerConfig(
        ack_policy=js_api.AckPolicy.NONE,
        deliver_policy=js_api.DeliverPolicy.ALL,
        inactive_threshold=30.0,
        mem_storage=True,
    )
    sub = await js.pull_subscribe(filter_subject, durable=None, stream=stream, config=config)
    try:
        while remaining > 0:
            try:
                msgs = await sub.fetch(min(BATCH, remaining), timeout=2.0)
            except (FetchTimeoutError, NatsTimeoutError, TimeoutError):
                return  # the rest expired or was deleted while we read
            for msg in msgs:
                yield msg
                remaining = min(remaining - 1, msg.metadata.num_pending)
    finally:
        await sub.unsubscribe()
