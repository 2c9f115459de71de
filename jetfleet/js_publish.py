"""One JetStream publish and its ack, decoded with msgspec.

The same request nats-py's ``JetStreamContext.publish`` sends, and the same errors
(NoStreamResponseError when no stream answers, APIError by code for a refusal), but
the ack is read with msgspec instead of the json module and a dataclass built field by
field: a quarter of a publish's client CPU under load, on every admission, grant,
settle and outcome (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import msgspec
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError


class _Ack(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    domain: str | None = None
    duplicate: bool | None = None
    error: dict[str, Any] | None = None


_ack_decoder = msgspec.json.Decoder(_Ack)


async def publish_js(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    headers: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> PubAck:
    """Publish ``payload`` to ``subject`` and wait for the stream's ack (at most
    ``timeout_s``, the context's timeout when None).

    Raises:
        NoStreamResponseError: no stream takes ``subject`` (or none answers now).
        APIError: the stream refused the message (a subclass by code).
        nats.errors.TimeoutError: no ack in time.
    """
    try:
        reply = await js._nc.request(
            subject,
            payload,
            timeout=js._timeout if timeout_s is None else timeout_s,
            headers=headers,
        )
    except NoRespondersError:
        raise NoStreamResponseError from None
    ack = _ack_decoder.decode(reply.data)
    if ack.error is not None:
        APIError.from_error(ack.error)  # raises
    if ack.seq <= 0 or not ack.stream:
        # Never a revision 0: a compare-and-set would read it as lost, a create as a fence.
        raise APIError(description=f"unexpected answer to a publish to {subject}")
    return PubAck(stream=ack.stream, seq=ack.seq, domain=ack.domain, duplicate=ack.duplicate)
