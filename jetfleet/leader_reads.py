"""Reads that a safety decision rests on, answered by the stream's leader.

Streams and buckets allow direct gets (``$JS.API.DIRECT.GET``) so that any replica may
answer them: cheap, and right for status, listings and attempt histories. A replica may
lag the leader, though, and answer with a lease already revoked, a fence already passed
or no dead letter yet. The fence, live-lease, committed-key and dead-letter checks
therefore read with a message get (``$JS.API.STREAM.MSG.GET``), which only the leader
answers (docs/commit.md#which-reads-may-be-stale).
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue


async def leader_bucket(js: JetStreamContext, bucket: str) -> KeyValue:
    """The KV ``bucket`` with every ``get`` answered by its stream's leader.

    Raises:
        nats.js.errors.BucketNotFoundError: when the bucket does not exist.
    """
    await js.key_value(bucket)  # raises unless it exists and is a bucket
    return _bound(js, bucket, direct=False)


def replica_bucket(js: JetStreamContext, bucket: str) -> KeyValue:
    """The KV ``bucket`` (declared with direct gets, jetfleet/topology.py) bound without
    asking the server about it: no ``$JS.API.STREAM.INFO`` call, so a reader needs only
    ``$JS.API.DIRECT.GET.KV_<bucket>.>``, and a hot path pays no extra round trip. Any
    replica answers its gets. A bucket that does not exist fails each get instead."""
    return _bound(js, bucket, direct=True)


def _bound(js: JetStreamContext, bucket: str, direct: bool) -> KeyValue:
    return KeyValue(
        name=bucket,
        stream=KV_STREAM_TEMPLATE.format(bucket=bucket),
        pre=KV_PRE_TEMPLATE.format(bucket=bucket),
        js=js,
        direct=direct,
    )


async def last_message(js: JetStreamContext, stream: str, subject: str) -> RawStreamMsg | None:
    """The last message on ``subject`` in ``stream``, as its leader has it; None if none."""
    try:
        return await js.get_msg(stream, subject=subject, direct=False)
    except NotFoundError:
        return None
