"""Reading committed results back out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.leader_reads import last_message
from jetfleet.schemas import CommittedResult
from jetfleet.stream_reader import read_stream

_decoder = msgspec.json.Decoder(CommittedResult)


async def iter_results(
    js: JetStreamContext, target: str | None = None
) -> AsyncIterator[CommittedResult]:
    """Every committed result (of ``target``, or of all targets), oldest first."""
    filter_ = subjects.results(target) if target else "jf.results.>"
    async for msg in read_stream(js, subjects.STREAM_RESULTS, filter_):
        yield _decoder.decode(msg.data)


async def committed_job(js: JetStreamContext, target: str, key: str) -> str | None:
    """The job id whose result holds ``key``, or None if the key is not committed (the
    result record is the key). A leader read: grants and dead letters decide on it."""
    msg = await last_message(js, subjects.STREAM_RESULTS, subjects.result_key(target, key))
    if msg is None:
        return None
    return _decoder.decode(msg.data).job_id if msg.data else ""
