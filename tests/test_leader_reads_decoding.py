"""jetfleet decodes its leader reads and its publishes' acks itself (msgspec, for speed:
docs/benchmarks.md); what it reads and the errors it raises must be nats-py's own. Each
case asks the real server the same thing both ways and compares."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NatsClient
from nats.js.errors import (
    APIError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from jetfleet import subjects
from jetfleet.js_publish import publish_js
from jetfleet.leader_reads import _headers, last_message, leader_bucket
from jetfleet.publish import publish_durably

pytestmark = pytest.mark.timeout(60)


def test_headers_read_as_nats_py_reads_them() -> None:
    import base64

    raw = b"NATS/1.0\r\nNats-Msg-Id: dlq-7\r\nKV-Operation: DEL\r\nX: a: b\r\n\r\n"
    assert _headers(base64.b64encode(raw).decode()) == {
        "Nats-Msg-Id": "dlq-7",
        "KV-Operation": "DEL",
        "X": "a: b",
    }
    assert _headers("") is None
    # Bytes that are not UTF-8 are read, not refused (nats-py's parser takes any bytes).
    odd = base64.b64encode(b"NATS/1.0\r\nX-Odd: caf\xe9\r\n\r\n").decode()
    assert (_headers(odd) or {}).get("X-Odd", "").startswith("caf")


async def test_last_message_reads_what_nats_pys_message_get_reads(nc: NatsClient) -> None:
    js = nc.jetstream()
    subject = subjects.result_key("demo", "k-lean")
    await js.publish(subject, b'{"job_id":"j-1"}', headers={"Jf-Trace": "t-1", "Other": "x"})
    ours = await last_message(js, subjects.STREAM_RESULTS, subject)
    theirs = await js.get_msg(subjects.STREAM_RESULTS, subject=subject, direct=False)
    assert ours is not None
    assert (ours.subject, ours.seq, ours.data, ours.time) == (
        theirs.subject,
        theirs.seq,
        theirs.data,
        theirs.time,
    )
    assert ours.headers is not None and theirs.headers is not None
    assert {k: ours.headers[k] for k in ("Jf-Trace", "Other")} == {"Jf-Trace": "t-1", "Other": "x"}
    assert ours.headers == theirs.headers
    missing = subjects.result_key("demo", "k-never")
    assert await last_message(js, subjects.STREAM_RESULTS, missing) is None
    with pytest.raises(NotFoundError):
        await js.get_msg(subjects.STREAM_RESULTS, subject=missing, direct=False)


async def test_a_leader_bucket_gets_creates_updates_and_deletes_as_nats_pys_does(
    nc: NatsClient,
) -> None:
    js = nc.jetstream()
    ours = await leader_bucket(js, subjects.BUCKET_LEASES)
    theirs = await js.key_value(subjects.BUCKET_LEASES)
    assert type(ours) is not KeyValue  # the lean reads are in use
    with pytest.raises(KeyNotFoundError):
        await ours.get("job-lean")
    first = await ours.create("job-lean", b"one", msg_ttl=30)
    with pytest.raises(KeyWrongLastSequenceError):
        await ours.create("job-lean", b"again", msg_ttl=30)
    got = await ours.get("job-lean")
    assert (got.value, got.revision) == (b"one", first)
    assert (got.value, got.revision) == ((await theirs.get("job-lean")).value, first)
    second = await ours.update("job-lean", b"two", last=first)
    with pytest.raises(KeyWrongLastSequenceError):
        await ours.update("job-lean", b"three", last=first)
    await ours.delete("job-lean", last=second)
    with pytest.raises(KeyDeletedError) as deleted:
        await ours._get("job-lean")
    assert deleted.value.op == "DEL" and deleted.value.entry.revision > second
    with pytest.raises(KeyNotFoundError):  # KeyDeletedError is one
        await ours.get("job-lean")
    # Created again over its delete marker, as nats-py's create does.
    again = await ours.create("job-lean", b"four", msg_ttl=30)
    assert (await theirs.get("job-lean")).value == b"four" and again > second


async def test_a_publish_acks_and_refuses_as_nats_pys_does(nc: NatsClient) -> None:
    js = nc.jetstream()
    subject = subjects.result_key("demo", "k-ack")
    ack = await publish_js(js, subject, b"x", {"Nats-Msg-Id": "ack-1"})
    again = await publish_durably(js, subject, b"x", msg_id="ack-1")
    assert (again.stream, again.seq, again.duplicate) == (ack.stream, ack.seq, True)
    assert not ack.duplicate and ack.stream == subjects.STREAM_RESULTS
    with pytest.raises(APIError) as refused:
        await publish_js(js, subject, b"y", {"Nats-Expected-Last-Subject-Sequence": "0"})
    with pytest.raises(APIError) as refused_theirs:
        await js.publish(subject, b"y", headers={"Nats-Expected-Last-Subject-Sequence": "0"})
    assert type(refused.value) is type(refused_theirs.value)
    assert refused.value.err_code == refused_theirs.value.err_code == 10071
    with pytest.raises(NoStreamResponseError):
        await publish_js(js, "no.stream.takes.this", b"z")
