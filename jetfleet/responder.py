"""The services' one request/reply loop: decode, refuse, bound, answer, reply, log.

A ``Responder`` serves the ``Route``\\ s of one service replica in its queue group. A
request larger than its route's ``max_bytes`` is refused unread (``too_large``). Each
other request is decoded with its route's typed decoder; one that does not decode is
answered with the route's ``malformed`` reply (what was wrong), never dropped, and one the
route's ``check`` objects to (a bound the type cannot express) gets that objection. At
most ``limit`` requests are in hand at once across the replica's routes: one more is
answered ``busy`` with a retry-after at once, so a slow or just-resumed replica sheds
load instead of queueing without bound (a request a caller gave up on would still be
worked on) and callers back off. Every failure is logged once. ``drain`` stops taking
requests (the queue group's other replicas get them) and waits for those in hand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import Span, SpanKind

from jetfleet import tracing
from jetfleet.js_errors import is_unavailable
from jetfleet.metrics import CounterFamily

log = logging.getLogger(__name__)

Request = TypeVar("Request")
Reply = TypeVar("Reply", bound=msgspec.Struct)

BUSY_RETRY_AFTER_S = 0.5
"""What a ``busy`` answer asks the caller to wait; callers grow it with each busy."""
UNAVAILABLE_RETRY_AFTER_S = 1.0
"""What a ``busy`` answer asks when JetStream did not answer the handler in time."""
BUSY_LOG_EVERY_S = 10.0
"""Overload is logged at most this often (with the count), not once per busy answer."""

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class Refusals(Generic[Reply]):
    """How one route words the answers the responder gives without its handler."""

    malformed: Callable[[str], Reply]
    """The request did not decode; gets the decoder's message (what to fix)."""
    busy: Callable[[float, str], Reply]
    """Not looked at, or not finished because JetStream did not answer in time: nothing
    is known to be wrong with the request. Gets how long to wait before asking again
    with the same request, and why."""
    failed: Callable[[Exception], Reply]
    """The handler raised otherwise; the caller decides what that costs."""
    too_large: Callable[[str], Reply] | None = None
    """The request is over the route's ``max_bytes``; gets what to fix. None words it
    with ``malformed``."""


@dataclass(frozen=True)
class Route(Generic[Request, Reply]):
    """One subject a service answers, with its request type and its handler."""

    subject: str
    decoder: msgspec.json.Decoder[Request]
    answer: Callable[[Request], Awaitable[Reply]]
    refusals: Refusals[Reply]
    after: Callable[[Msg, Request | None, Reply], Awaitable[None]] | None = None
    """Run after every reply is sent, refusals included (request None): counting, or
    freeing what the answer settled without making the caller wait."""
    max_bytes: int = 0
    """The largest request body read; a larger one is refused before it is decoded.
    0: no bound but the server's ``max_payload``."""
    check: Callable[[Msg, Request], Reply | None] | None = None
    """What the service refuses in a request its type admits (a target it does not
    declare, a body that disagrees with its subject): the refusal, or None to answer."""


class Responder:
    """Serves routes in one queue group, at most ``limit`` requests in hand at once."""

    def __init__(self, nc: NatsClient, service: str, queue: str, limit: int) -> None:
        self.nc = nc
        self.service = service
        self.queue = queue
        self.limit = limit
        self.refused = CounterFamily(
            f"jetfleet_{service}_refusals_total",
            "Requests answered without their handler's answer, by subject and reason "
            "(busy, unavailable, too-large, malformed, invalid, failed)",
        )
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_hand = 0
        self._busy_since_log = 0
        self._busy_logged_at = -BUSY_LOG_EVERY_S

    @property
    def subjects(self) -> tuple[str, ...]:
        """The subjects served (wildcards as subscribed), for tests that must cover each."""
        return tuple(sub.subject for sub in self._subs)

    @property
    def in_hand(self) -> int:
        """Requests being answered now."""
        return self._in_hand

    async def serve(self, route: Route[Any, Any]) -> None:
        """Start answering ``route`` (call ``nc.flush()`` after the last, to be sure the
        server has the subscriptions)."""

        async def take(msg: Msg) -> None:
            await self._take(route, msg)

        self._subs.append(await self.nc.subscribe(route.subject, queue=self.queue, cb=take))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task that ``drain`` waits for (work a handler leaves behind)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, then wait up to ``timeout_s`` for those in hand."""
        for sub in self._subs:
            # drain, not unsubscribe: requests already delivered here are still answered.
            await sub.drain()  # type: ignore[no-untyped-call]
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)

    async def _take(self, route: Route[Any, Any], msg: Msg) -> None:
        if self._in_hand >= self.limit:
            self.refused.inc(subject=route.subject, reason="busy")
            self._log_busy()
            busy = route.refusals.busy(BUSY_RETRY_AFTER_S, f"the {self.service} is full")
            await self._reply(route, msg, None, busy)
            return
        self._in_hand += 1
        # Each request in its own task: one slow round trip must not hold the rest.
        self.spawn(self._answer(route, msg))

    def _log_busy(self) -> None:
        self._busy_since_log += 1
        now = time.monotonic()
        if now - self._busy_logged_at >= BUSY_LOG_EVERY_S:
            log.warning(
                "%s full (%d requests in hand, fleet.service_concurrency): answering busy "
                "(%d busy answers since the last such line)",
                self.service,
                self._in_hand,
                self._busy_since_log,
            )
            self._busy_logged_at = now
            self._busy_since_log = 0

    async def _answer(self, route: Route[Any, Any], msg: Msg) -> None:
        parent = tracing.extract(msg.headers)
        with tracing.span(f"{self.service} {msg.subject}", SpanKind.SERVER, parent) as span:
            await self._answer_in(route, msg, span)

    async def _answer_in(self, route: Route[Any, Any], msg: Msg, span: Span) -> None:
        try:
            request, reply = self._admit(route, msg)
            if span.is_recording() and request is not None:
                span.update_name(tracing.call_name(request, self.service))
                span.set_attributes(tracing.call_attributes(request))
            if reply is None:
                try:
                    reply = await route.answer(request)
                except Exception as exc:  # refuse rather than crash
                    reply = self._failed(route, msg, exc)
            else:
                request = None
            tracing.note_reply(reply)
            await self._reply(route, msg, request, reply)
        finally:
            self._in_hand -= 1

    def _admit(self, route: Route[Any, Reply], msg: Msg) -> tuple[Any, Reply | None]:
        """The decoded request, and the refusal if it is not to be answered."""
        size = len(msg.data)
        if route.max_bytes and size > route.max_bytes:
            self.refused.inc(subject=route.subject, reason="too-large")
            log.warning("request on %s refused unread: %d bytes", msg.subject, size)
            word = route.refusals.too_large or route.refusals.malformed
            return None, word(
                f"the request is {size} bytes, over the {route.max_bytes} bytes the "
                f"{self.service} reads on {route.subject}: send a smaller one"
            )
        try:
            request = route.decoder.decode(msg.data)
        except (msgspec.MsgspecError, RecursionError) as exc:
            # RecursionError: msgspec's nesting limit (a document nested thousands deep)
            # is not a MsgspecError; unanswered, the caller would only see a timeout.
            self.refused.inc(subject=route.subject, reason="malformed")
            log.warning("malformed request on %s: %s", msg.subject, exc)
            return None, route.refusals.malformed(str(exc))
        refusal = route.check(msg, request) if route.check is not None else None
        if refusal is not None:
            self.refused.inc(subject=route.subject, reason="invalid")
            log.warning("request on %s refused: %s", msg.subject, _detail(refusal))
        return request, refusal

    def _failed(self, route: Route[Any, Reply], msg: Msg, exc: Exception) -> Reply:
        if is_unavailable(exc):
            # An election, a reconnect, or this replica stalled past its own timeouts:
            # asking again with the same request is right (every handler is idempotent),
            # and a caller must not count it against the job as it would a failure.
            self.refused.inc(subject=route.subject, reason="unavailable")
            log.warning("request on %s not finished: %s", msg.subject, type(exc).__name__)
            why = f"JetStream did not answer the {self.service} in time ({type(exc).__name__})"
            return route.refusals.busy(UNAVAILABLE_RETRY_AFTER_S, why)
        self.refused.inc(subject=route.subject, reason="failed")
        log.exception("request on %s failed", msg.subject)
        tracing.record_error(exc)
        return route.refusals.failed(exc)

    async def _reply(
        self, route: Route[Any, Any], msg: Msg, request: object, reply: msgspec.Struct
    ) -> None:
        try:
            if msg.reply:
                await self.nc.publish(msg.reply, _encoder.encode(reply))
            if route.after is not None:
                await route.after(msg, request, reply)
        except Exception:  # a reply lost on a closing connection: the caller asks again
            log.exception("replying on %s failed", msg.subject)


def _detail(reply: msgspec.Struct) -> str:
    return str(getattr(reply, "detail", reply))
