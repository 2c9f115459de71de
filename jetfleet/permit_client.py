"""Asking the ``ratelimit`` service (queue ``ratelimit``): a permit before a request, a
fleet-wide hold after a target said to slow down. Unreachable means no permit: the
caller refuses or waits, never sends unlimited (the limiter fails closed)."""

from __future__ import annotations

import logging

import msgspec
from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry.trace import SpanKind

from jetfleet import subjects, tracing
from jetfleet.schemas.permit import (
    HoldPlaced,
    HoldReply,
    HoldRequest,
    PermitAllowed,
    PermitRefused,
    PermitReply,
    PermitRequest,
    PermitWait,
    RatelimitReply,
)

log = logging.getLogger(__name__)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RatelimitReply)
TIMEOUT_S = 2.0
UNREACHABLE = "ratelimit-unavailable"
UNREACHABLE_RETRY_S = 1.0


class PermitClient:
    """Permit and hold calls over one NATS connection."""

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc

    async def permit(self, request: PermitRequest) -> PermitReply:
        """The permit's answer; ``refused: ratelimit-unavailable`` when no replica answers."""
        reply = await self._call(request)
        if isinstance(reply, PermitAllowed | PermitWait | PermitRefused):
            return reply
        return _unexpected(reply)

    async def hold(self, request: HoldRequest) -> HoldReply:
        """Ask the fleet to hold a target; a refusal when no replica answers."""
        reply = await self._call(request)
        if isinstance(reply, HoldPlaced | PermitRefused):
            return reply
        return _unexpected(reply)

    async def _call(self, call: PermitRequest | HoldRequest) -> RatelimitReply:
        with tracing.span(
            tracing.call_name(call), SpanKind.CLIENT, attributes=tracing.call_attributes(call)
        ):
            reply = await self._ask(call)
            tracing.note_reply(reply)
            return reply

    async def _ask(self, call: PermitRequest | HoldRequest) -> RatelimitReply:
        try:
            answer = await self.nc.request(
                subjects.RATELIMIT,
                _encoder.encode(call),
                timeout=TIMEOUT_S,
                headers=tracing.inject(),
            )
        except (NoRespondersError, NatsTimeoutError) as exc:
            return PermitRefused(
                reason=UNREACHABLE,
                retry_after_s=UNREACHABLE_RETRY_S,
                detail=f"no ratelimit service answered ({type(exc).__name__}): "
                "start `jetfleet serve ratelimit`",
            )
        except Exception as exc:  # a closed or reconnecting connection: no permit either
            return PermitRefused(
                reason=UNREACHABLE,
                retry_after_s=UNREACHABLE_RETRY_S,
                detail=f"the ratelimit service could not be asked: {type(exc).__name__}: {exc}",
            )
        try:
            return _decoder.decode(answer.data)
        except msgspec.MsgspecError as exc:
            return PermitRefused(reason="ratelimit-error", detail=f"undecodable answer: {exc}")


def _unexpected(reply: RatelimitReply) -> PermitRefused:
    log.error("ratelimit answered %r to the wrong kind of call", reply)
    return PermitRefused(reason="ratelimit-error", detail=f"unexpected answer {reply!r}")
