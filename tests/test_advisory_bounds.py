"""An advisory naming a stream sequence no stream can have (-1, 0, 10**30) is dropped with a
reason and acked, not read again for ever. Found by tests/test_fuzz_wire.py: the sink's
backstop asked the server for message -1 of JF_WORK, got a 400 (err 10025) on every
try, and nakked the advisory each time, logging a traceback every two seconds."""

from __future__ import annotations

import logging

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from jetfleet import subjects
from tests.conftest import wait_for
from tests.stack import InProcessStack


@pytest.mark.parametrize("seq", [-1, 0, 10**30], ids=["negative", "zero", "over-uint64"])
async def test_an_advisory_with_an_impossible_sequence_is_dropped_and_acked(
    nc: NatsClient, services: InProcessStack, caplog: pytest.LogCaptureFixture, seq: int
) -> None:
    js = nc.jetstream()
    subject = subjects.max_deliveries_advisories(subjects.STREAM_WORK).replace(">", "w")
    advisory = {"stream": subjects.STREAM_WORK, "consumer": "w", "stream_seq": seq}
    ack = await js.publish(subject, msgspec.json.encode({**advisory, "deliveries": 3}))

    async def acked() -> bool:
        info = await js.consumer_info(subjects.STREAM_ADVISORIES, subjects.CONSUMER_MAX_DELIVERIES)
        return (info.ack_floor.stream_seq or 0) >= ack.seq

    with caplog.at_level(logging.WARNING, logger="jetfleet"):
        await wait_for(acked, 10, "the advisory to be acked")
    dropped = [r.getMessage() for r in caplog.records if "undecodable advisory" in r.getMessage()]
    assert dropped and "stream_seq" in dropped[0], caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
