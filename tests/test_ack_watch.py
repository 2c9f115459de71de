"""The ``$JS.ACK`` wire watcher of the I1 test sees what a given delivery sent (guards the
guard: a watcher that saw nothing would prove nothing)."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NatsClient
from nats.js import api as js_api

from jetfleet.connection import connect_nats
from jetfleet.settings import NatsSettings
from tests.conftest import wait_for
from tests.faults.ack_watch import AckWatcher, parse_ack

pytestmark = pytest.mark.timeout(30)

STREAM = "JF_ACKWATCH"


def test_both_ack_subject_forms_are_parsed() -> None:
    v1 = parse_ack("$JS.ACK.JF_WORK.work-demo-normal.2.17.40.1700000000.0", b"+ACK", 1.0)
    v2 = parse_ack("$JS.ACK.hub.ACC.JF_WORK.work-demo-normal.3.17.41.1700000000.0.x", b"", 2.0)
    assert (v1.stream, v1.consumer, v1.delivered, v1.stream_seq, v1.verb) == (
        "JF_WORK",
        "work-demo-normal",
        2,
        17,
        "+ACK",
    )
    assert (v2.stream, v2.delivered, v2.stream_seq, v2.verb) == ("JF_WORK", 3, 17, "+ACK")
    assert parse_ack("$JS.ACK.S.C.1.5.6.7.0", b'-NAK {"delay": 1000000000}', 0).verb == "-NAK"
    with pytest.raises(ValueError):
        parse_ack("$JS.ACK.S.C", b"+ACK", 0)


async def test_the_watcher_sees_what_each_delivery_sent(
    nats_url: str,
) -> None:
    nc: NatsClient = await connect_nats(NatsSettings(url=nats_url), "ack-watch-test")
    observer = await connect_nats(NatsSettings(url=nats_url), "ack-watch-observer")
    watcher = AckWatcher()
    try:
        js = nc.jetstream()
        await js.add_stream(js_api.StreamConfig(name=STREAM, subjects=["ackwatch.>"]))
        await js.publish("ackwatch.a", b"a")
        await js.publish("ackwatch.b", b"b")
        sub = await js.pull_subscribe(
            "ackwatch.>", "c", config=js_api.ConsumerConfig(ack_wait=1.0, max_deliver=-1)
        )
        await watcher.start(observer)
        first_a, first_b = await sub.fetch(2, timeout=5)
        await first_b.ack()  # the live delivery settles: fine
        [second_a] = await sub.fetch(1, timeout=10)  # redelivered after ack_wait
        assert second_a.metadata.num_delivered == 2
        await second_a.in_progress()  # the new holder is at work
        await first_a.ack()  # the old holder acks anyway: superseded
        await second_a.ack()
        await observer.flush()
        await nc.flush()

        async def all_seen() -> bool:
            return len(watcher.events) == 4

        await wait_for(all_seen, 5, "four acks on the wire")
        seq_a = first_a.metadata.sequence.stream
        [bad] = watcher.settled(STREAM, {(seq_a, 1)})  # the superseded delivery of a
        assert (bad.stream_seq, bad.delivered, bad.verb) == (seq_a, 1, "+ACK")
        assert watcher.settled(STREAM, {(seq_a, 3), (first_b.metadata.sequence.stream, 2)}) == []
        assert watcher.redelivered(STREAM) == {seq_a}
        assert (watcher.count("+ACK"), watcher.count("+WPI")) == (3, 1)
    finally:
        await watcher.stop()
        await observer.close()
        await nc.close()
