"""Read the few messages of one subject in one round trip: JetStream's batched direct
get (server >= 2.11; nats-py 2.16 has no call for it, so the request is made here).

For small per-subject histories (a job's outcome events), where a temporary consumer
would cost several round trips (create, fetch, delete).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet.errors import JetfleetError

BATCH = 256
TIMEOUT_S = 2.0


class DirectGetError(JetfleetError):
    """The server answered a batched direct get with an error status."""


@dataclass(frozen=True)
class StoredMessage:
    """One stored message: its stream sequence and payload."""

    seq: int
    data: bytes


async def read_subject(
    nc: NatsClient, stream: str, subject: str, limit: int | None = None
) -> list[StoredMessage]:
    """Every message of ``stream`` on ``subject`` (no wildcards needed), oldest first;
    with ``limit``, only the oldest ``limit`` of them.

    The stream needs ``allow_direct``. Raises DirectGetError on an error status and
    TimeoutError when the server does not finish answering in time.
    """
    found: list[StoredMessage] = []
    start = 0
    while limit is None or len(found) < limit:
        batch, more = await _one_batch(nc, stream, subject, start)
        found += batch
        if not more or not batch:
            break
        start = batch[-1].seq + 1
    return found if limit is None else found[:limit]


async def _one_batch(
    nc: NatsClient, stream: str, subject: str, start: int
) -> tuple[list[StoredMessage], bool]:
    replies: asyncio.Queue[Msg] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        await replies.put(msg)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=collect)
    request: dict[str, object] = {"next_by_subj": subject, "batch": BATCH}
    if start:
        request["seq"] = start
    try:
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
        batch: list[StoredMessage] = []
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                msg = await replies.get()
                headers = msg.headers or {}
                status = headers.get("Status")
                if status == "404":
                    return batch, False  # nothing (more) on this subject
                if status == "204":  # end of batch
                    return batch, int(headers.get("Nats-Num-Pending", "0")) > 0
                if status:
                    raise DirectGetError(
                        f"direct get on {stream} for {subject}: status {status} "
                        f"{headers.get('Description', '')}"
                    )
                batch.append(StoredMessage(int(headers["Nats-Sequence"]), msg.data))
    finally:
        await sub.unsubscribe()
