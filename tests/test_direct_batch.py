"""The batched direct get that reads a job's outcome events in one round trip, against a
real nats-server (>= 2.11)."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NatsClient
from nats.js import api as js_api

from jetfleet.direct_batch import BATCH, DirectGetError, read_subject


async def _stream(nc: NatsClient, direct: bool = True) -> None:
    await nc.jetstream().add_stream(
        js_api.StreamConfig(name="EVENTS", subjects=["ev.>"], allow_direct=direct)
    )


async def test_reads_every_message_of_one_subject_in_order(nc: NatsClient) -> None:
    await _stream(nc)
    js = nc.jetstream()
    for n in range(BATCH + 40):  # more than one batch
        await js.publish("ev.job1", str(n).encode())
        if n % 7 == 0:
            await js.publish("ev.job2", b"other")
    found = await read_subject(nc, "EVENTS", "ev.job1")
    assert [m.data for m in found] == [str(n).encode() for n in range(BATCH + 40)]
    assert [m.seq for m in found] == sorted(m.seq for m in found)
    assert [m.data for m in await read_subject(nc, "EVENTS", "ev.job2")] == [b"other"] * 43


async def test_a_subject_with_no_messages_reads_as_empty(nc: NatsClient) -> None:
    await _stream(nc)
    await nc.jetstream().publish("ev.job1", b"x")
    assert await read_subject(nc, "EVENTS", "ev.nothing") == []


async def test_a_stream_without_direct_get_is_an_error_not_an_empty_history(
    nc: NatsClient,
) -> None:
    await _stream(nc, direct=False)
    await nc.jetstream().publish("ev.job1", b"x")
    with pytest.raises(DirectGetError, match="status 503"):
        await read_subject(nc, "EVENTS", "ev.job1")
