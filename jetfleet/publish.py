"""Publishing to JetStream with retries that cannot duplicate."""

from __future__ import annotations

import asyncio

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from jetfleet.errors import SubmitError
from jetfleet.js_errors import is_msg_id_in_process
from jetfleet.js_publish import publish_js

RETRY_FOR_S = 30.0
"""How long a publish is retried. It must outlast a stream leader election after a node
is lost (raft election timeouts are 4-9 s, and one loss may take more than one round):
a budget of tries (six, about 5 s of waits) gave up while the cluster was still electing
(tests/test_cluster_failover.py)."""
_MAX_PAUSE_S = 1.0


async def publish_durably(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    msg_id: str | None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 5.0,
    retry_for_s: float = RETRY_FOR_S,
) -> PubAck:
    """Publish and wait for the stream's ack, retrying through leader elections (see
    ``publish_durably_tracked``, which also says whether a try went unanswered)."""
    ack, _ = await publish_durably_tracked(
        js, subject, payload, msg_id, headers, timeout_s, retry_for_s
    )
    return ack


async def publish_durably_tracked(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    msg_id: str | None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 5.0,
    retry_for_s: float = RETRY_FOR_S,
) -> tuple[PubAck, bool]:
    """Publish and wait for the stream's ack, retrying through leader elections.

    nats-py does not retry a publish that meets an election (no responders: the stream
    has no leader; a 503; or no answer); the ``Nats-Msg-Id`` makes our retries safe (the
    stream drops a repeat inside its duplicate window, and answers a repeat that arrives
    while the first is still being replicated with 10158, which is tried again too).
    Without one (``msg_id=None``) a retry after a lost PubAck may store the message twice.

    Args:
        js: the JetStream context.
        subject: where to publish.
        payload: the message body.
        msg_id: the ``Nats-Msg-Id`` that makes a retry a duplicate, or None.
        headers: further headers (copied, not changed).
        timeout_s: how long one try waits for the stream's ack.
        retry_for_s: how long to keep trying before giving up.

    Returns:
        The stream's ack, and whether an earlier try of this call may have been stored
        although its answer was lost (no answer in time, or 10158: being stored now).
        A ``duplicate`` ack after such a try may be that try's own: a message id
        shared by other publishers cannot tell the two apart, so callers decide.

    Raises:
        SubmitError: when no try succeeded within ``retry_for_s``.
    """
    all_headers = dict(headers or {})
    if msg_id is not None:
        all_headers["Nats-Msg-Id"] = msg_id
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for_s
    last: Exception | None = None
    tries = 0
    unanswered = False
    while True:
        tries += 1
        try:
            return await publish_js(js, subject, payload, all_headers, timeout_s), unanswered
        except (NoStreamResponseError, ServiceUnavailableError) as exc:
            last = exc  # no stream took it
        except NatsTimeoutError as exc:
            last = exc
            unanswered = True  # it may have been stored, its answer lost
        except APIError as exc:
            # Our own earlier try, still being replicated: the next try is its duplicate.
            if not is_msg_id_in_process(exc):
                raise
            last = exc
            unanswered = True
        pause = min(_MAX_PAUSE_S, 0.05 * 2**tries)
        if loop.time() + pause >= deadline:
            break
        await asyncio.sleep(pause)
    raise SubmitError(
        f"could not publish to {subject} within {retry_for_s:g} s ({tries} tries): {last}"
    )
