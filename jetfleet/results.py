"""Reading committed results back out."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncGenerator
from email.message import Message

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import ObjectNotFoundError

from jetfleet import subjects
from jetfleet.errors import JetfleetError
from jetfleet.leader_reads import last_message
from jetfleet.schemas import CommittedResult, HttpFetch, StoredObject
from jetfleet.stream_reader import read_stream

_decoder = msgspec.json.Decoder(CommittedResult)


async def iter_results(
    js: JetStreamContext, target: str | None = None
) -> AsyncGenerator[CommittedResult, None]:
    """Every committed result (of ``target``, or of all targets), oldest first (a
    generator: a caller that stops early closes it, ``contextlib.aclosing``)."""
    filter_ = subjects.results(target) if target else "jf.results.>"
    # aclosing: when our caller stops early, the reader's consumer is deleted now, while
    # the connection is open, not by the loop's finaliser after it has closed.
    async with contextlib.aclosing(read_stream(js, subjects.STREAM_RESULTS, filter_)) as msgs:
        async for msg in msgs:
            yield _decoder.decode(msg.data)


async def committed_job(js: JetStreamContext, target: str, key: str) -> str | None:
    """The job id whose result holds ``key``, or None if the key is not committed (the
    result record is the key). A leader read: grants and dead letters decide on it."""
    msg = await last_message(js, subjects.STREAM_RESULTS, subjects.result_key(target, key))
    if msg is None:
        return None
    return _decoder.decode(msg.data).job_id if msg.data else ""


async def stored_bytes(js: JetStreamContext, ref: StoredObject) -> bytes:
    """The bytes a result keeps in an object store bucket, checked against their SHA-256.

    Raises:
        JetfleetError: the object is gone (aged out with its result) or its bytes differ.
    """
    store = await js.object_store(ref.bucket)
    try:
        found = await store.get(ref.name)
    except ObjectNotFoundError:
        raise JetfleetError(
            f"object {ref.name!r} is no longer in bucket {ref.bucket!r}: it ages out with "
            "its result (fleet.retention_s / fleet.dedupe_ttl_s)"
        ) from None
    data = found.data or b""
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise JetfleetError(f"object {ref.name!r} in {ref.bucket!r} does not match its SHA-256")
    return data


async def with_stored_body(js: JetStreamContext, record: CommittedResult) -> CommittedResult:
    """``record`` with a body kept in the object store put back inline, as text decoded
    by the charset of its Content-Type (UTF-8 when it names none)."""
    output = record.output
    if not isinstance(output, HttpFetch) or output.body_object is None:
        return record
    data = await stored_bytes(js, output.body_object)
    text = data.decode(_charset(output.headers), errors="replace")
    return msgspec.structs.replace(record, output=msgspec.structs.replace(output, body=text))


def _charset(headers: dict[str, str]) -> str:
    content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
    message = Message()
    message["content-type"] = content_type
    charset = message.get_content_charset() or "utf-8"
    try:
        "".encode(charset)
    except LookupError:
        return "utf-8"
    return charset
