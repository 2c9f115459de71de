"""Publishing to JetStream with retries that cannot duplicate."""

from __future__ import annotations

import asyncio

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError

from jetfleet.errors import SubmitError

_TRIES = 6


async def publish_durably(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    msg_id: str | None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 5.0,
) -> PubAck:
    """Publish and wait for the stream's ack, retrying through leader elections.

    nats-py does not retry a publish that meets an election; the ``Nats-Msg-Id`` makes our
    retries safe (the stream drops a repeat inside its duplicate window). Without one
    (``msg_id=None``) a retry after a lost PubAck may store the message twice.

    Raises:
        SubmitError: when every try failed.
    """
    all_headers = dict(headers or {})
    if msg_id is not None:
        all_headers["Nats-Msg-Id"] = msg_id
    last: Exception | None = None
    for try_no in range(_TRIES):
        try:
            return await js.publish(subject, payload, headers=dict(all_headers), timeout=timeout_s)
        except (NoStreamResponseError, NatsTimeoutError) as exc:
            last = exc
            await asyncio.sleep(min(2.0, 0.1 * 2**try_no))
    raise SubmitError(f"could not publish to {subject} after {_TRIES} tries: {last}")
