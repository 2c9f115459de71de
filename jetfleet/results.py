"""Reading committed results back out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetfleet import subjects
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
    result record is the key)."""
    try:
        msg = await js.get_msg(
            subjects.STREAM_RESULTS, subject=subjects.result_key(target, key), direct=True
        )
    except NotFoundError:
        return None
    return _decoder.decode(msg.data).job_id if msg.data else ""
