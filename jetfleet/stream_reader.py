"""Read every message of a stream (or a filter of it) once, from the start, without a
durable consumer: for exports, listings and tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from datetime import datetime

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import NotFoundError, ServiceUnavailableError

from jetfleet.bounded_fetch import fetch_at_most

BATCH = 500


async def read_stream(
    js: JetStreamContext,
    stream: str,
    filter_subject: str,
    since: datetime | None = None,
    from_seq: int = 0,
) -> AsyncGenerator[Msg, None]:
    """Yield the messages of ``stream`` matching ``filter_subject`` that exist now, in order
    (only those the server stored at or after ``since``, when given; only those at stream
    sequence ``from_seq`` or later, when positive).

    The count to read comes from the consumer's pending count, not from the stream's
    per-subject map, which the server caps at 100,000 subjects.
    """
    config = _reader(filter_subject, inactive_s=30.0)
    if since is not None:
        config.deliver_policy = js_api.DeliverPolicy.BY_START_TIME
        config.opt_start_time = since
    elif from_seq > 0:
        config.deliver_policy = js_api.DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = from_seq
    try:
        info = await js.add_consumer(stream, config)
    except NotFoundError:
        return
    remaining = info.num_pending or 0
    try:
        if remaining == 0:
            return
        sub = await js.pull_subscribe_bind(info.name, stream=stream)
        try:
            while remaining > 0:
                msgs = await _fetch(sub, min(BATCH, remaining))
                if not msgs:
                    return  # the rest expired or was deleted while we read
                for msg in msgs:
                    yield msg
                    remaining = min(remaining - 1, msg.metadata.num_pending)
        finally:
            await sub.unsubscribe()
    finally:
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(stream, info.name)


UNANSWERED_PULL_S = 15.0
"""How long a pull answered "no responders" (503) is asked again. On a cluster the
reader's consumer, just created, can take a moment before its node answers pulls (seen
right after a stream leader was killed and started again); a reader that gave up there
failed the listing or export it served."""


async def _fetch(sub: JetStreamContext.PullSubscription, batch: int) -> list[Msg]:
    """Up to ``batch`` messages ([] when none came within 2 s). What a pull answered after
    its fetch gave up left queued is taken first: the consumer acks nothing, so a message
    lost with a refused pull would never come again (jetfleet/bounded_fetch.py)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + UNANSWERED_PULL_S
    pause_s = 0.05
    while True:
        try:
            return await fetch_at_most(sub, batch, 2.0)
        except ServiceUnavailableError:
            if loop.time() + pause_s > deadline:
                raise
            await asyncio.sleep(pause_s)
            pause_s = min(1.0, pause_s * 2)


async def count_messages(js: JetStreamContext, stream: str, filter_: str) -> int:
    """How many messages of ``stream`` match ``filter_``, without listing subjects.

    Results are one subject per key, so the per-subject map of ``stream_info`` would grow
    with every job; an ephemeral consumer's pending count costs the same for any size.
    """
    try:
        info = await js.add_consumer(stream, _reader(filter_, inactive_s=5.0))
    except NotFoundError:
        return 0
    try:
        return info.num_pending or 0
    finally:
        await js.delete_consumer(stream, info.name)


def _reader(filter_subject: str, inactive_s: float) -> js_api.ConsumerConfig:
    """An ephemeral, unacked, in-memory consumer of every message matching the filter;
    the server removes it after ``inactive_s`` if we die before deleting it."""
    return js_api.ConsumerConfig(
        ack_policy=js_api.AckPolicy.NONE,
        deliver_policy=js_api.DeliverPolicy.ALL,
        filter_subject=filter_subject,
        inactive_threshold=inactive_s,
        mem_storage=True,
    )
