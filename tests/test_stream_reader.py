"""The stream reader asks a pull again when the server answers it "no responders"
(jetfleet/stream_reader.py): on a cluster a consumer just created can take a moment
before its node answers pulls, and a listing or export that gave up there failed."""

from __future__ import annotations

import asyncio

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from jetfleet.stream_reader import _fetch, read_stream


async def test_a_pull_nobody_answers_yet_is_asked_again_until_its_consumer_answers(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await js.add_stream(StreamConfig(name="READER", subjects=["reader.>"]))
        await js.publish("reader.a", b"1")
        config = ConsumerConfig(durable_name="late", ack_policy=AckPolicy.NONE)
        await js.add_consumer("READER", config)
        sub = await js.pull_subscribe_bind("late", stream="READER")
        # Nobody answers the consumer's pulls (as before its node took it on) ...
        await js.delete_consumer("READER", "late")
        fetching = asyncio.ensure_future(_fetch(sub, 1))
        await asyncio.sleep(0.5)  # pulls unanswered for a while, not a wait for a state
        assert not fetching.done(), fetching
        # ... until it does: the reader gets the message.
        await js.add_consumer("READER", config)
        msgs = await asyncio.wait_for(fetching, 10.0)
        assert [m.data for m in msgs] == [b"1"]
        assert [m.data async for m in read_stream(js, "READER", "reader.>")] == [b"1"]
    finally:
        await js.delete_stream("READER")
        await nc.close()
