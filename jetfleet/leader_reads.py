"""Reads that a safety decision rests on, answered by the stream's leader.

Streams and buckets allow direct gets (``$JS.API.DIRECT.GET``) so that any replica may
answer them: cheap, and right for status, listings and attempt histories. A replica may
lag the leader, though, and answer with a lease already revoked, a fence already passed
or no dead letter yet. The fence, live-lease, committed-key and dead-letter checks
therefore read with a message get (``$JS.API.STREAM.MSG.GET``), which only the leader
answers (docs/commit.md#which-reads-may-be-stale).

These reads are on every grant and settle, so they send nats-py's requests but decode
the answers here, with msgspec: nats-py's ``get_msg`` decodes them with the json module,
then base64, then the email package's header parser, which was half a leader read's
client CPU under load (docs/benchmarks.md). Errors are nats-py's own, as its reads
raise them.
"""

from __future__ import annotations

import binascii
from typing import Any

import msgspec
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.errors import (
    APIError,
    InvalidKeyError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue, _is_key_valid

from jetfleet.js_publish import publish_js


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
    kind = KeyValue if direct else _LeaderKeyValue
    return kind(
        name=bucket,
        stream=KV_STREAM_TEMPLATE.format(bucket=bucket),
        pre=KV_PRE_TEMPLATE.format(bucket=bucket),
        js=js,
        direct=direct,
    )


async def last_message(js: JetStreamContext, stream: str, subject: str) -> RawStreamMsg | None:
    """The last message on ``subject`` in ``stream``, as its leader has it; None if none."""
    stored = await _leader_get(js, stream, subject)
    if stored is None:
        return None
    return RawStreamMsg(
        subject=stored.subject,
        seq=stored.seq,
        data=binascii.a2b_base64(stored.data) if stored.data else None,
        headers=_headers(stored.hdrs),
        stream=stream,
        time=RawStreamMsg._parse_utc_iso(stored.time) if stored.time else None,
    )


class _StoredMsg(msgspec.Struct):
    subject: str
    seq: int
    data: str = ""
    hdrs: str = ""
    time: str = ""


class _MsgGetAnswer(msgspec.Struct):
    message: _StoredMsg | None = None
    error: dict[str, Any] | None = None


_answer_decoder = msgspec.json.Decoder(_MsgGetAnswer)
_request_encoder = msgspec.json.Encoder()


async def _leader_get(js: JetStreamContext, stream: str, subject: str) -> _StoredMsg | None:
    """``$JS.API.STREAM.MSG.GET`` of the last message on ``subject``; None if none.

    Raises what nats-py's ``get_msg`` raises: ServiceUnavailableError when nothing
    answers, APIError (by code) for the server's errors, nats' TimeoutError."""
    request = _request_encoder.encode({"last_by_subj": subject})
    try:
        reply = await js._nc.request(
            f"{js._prefix}.STREAM.MSG.GET.{stream}", request, timeout=js._timeout
        )
    except NoRespondersError:
        raise ServiceUnavailableError from None
    answer = _answer_decoder.decode(reply.data)
    if answer.error is not None:
        if answer.error.get("code") == 404:
            return None
        APIError.from_error(answer.error)  # raises
    if answer.message is None or answer.message.subject != subject:
        # Never "nothing there": a decision would go ahead on it.
        raise APIError(description=f"unexpected answer to a message get of {subject}")
    return answer.message


def _headers(encoded: str) -> dict[str, str] | None:
    """A stored message's headers (``NATS/1.0`` then ``Name: value`` lines), base64 as
    the message get answers them; the last value of a name repeated; None if none."""
    if not encoded:
        return None
    # Any bytes, as nats-py's parser takes them: a header is not ours to refuse.
    lines = binascii.a2b_base64(encoded).decode("utf-8", "surrogateescape").split("\r\n")[1:]
    headers = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip()] = value.strip()
    return headers or None


_KV_OPERATION = "KV-Operation"
_GONE = ("DEL", "PURGE")


class _LeaderKeyValue(KeyValue):
    """nats-py's KeyValue whose reads are ``_leader_get`` and whose writes are
    ``publish_js``: the same requests and errors, decoded with msgspec."""

    async def _get(self, key: str, revision: int | None = None) -> KeyValue.Entry:
        if revision:
            return await super()._get(key, revision)
        stored = await _leader_get(self._js, self._stream, f"{self._pre}{key}")
        if stored is None:
            raise KeyNotFoundError
        entry = KeyValue.Entry(
            bucket=self._name,
            key=key,
            value=binascii.a2b_base64(stored.data) if stored.data else None,
            revision=stored.seq,
            delta=None,
            created=None,
            operation=None,
        )
        headers = _headers(stored.hdrs)
        if headers is not None and headers.get(_KV_OPERATION) in _GONE:
            raise KeyDeletedError(entry, headers[_KV_OPERATION])
        return entry

    async def _update(
        self,
        key: str,
        value: bytes,
        last: int | None = None,
        validate_keys: bool = True,
        msg_ttl: float | None = None,
    ) -> int:
        if validate_keys and not _is_key_valid(key):
            raise InvalidKeyError(key)
        headers = {"Nats-Expected-Last-Subject-Sequence": str(last or 0)}
        if msg_ttl is not None:
            headers["Nats-TTL"] = str(int(msg_ttl))
        try:
            ack = await publish_js(self._js, f"{self._pre}{key}", value, headers)
        except APIError as exc:
            # As nats-py's: 10071 and 10164 are the wrong last sequence.
            if exc.err_code in (10071, 10164):
                raise KeyWrongLastSequenceError(description=exc.description) from None
            raise
        return ack.seq
