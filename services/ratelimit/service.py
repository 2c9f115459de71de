"""Serve ``jf.ratelimit`` (permits and holds) in the ``ratelimit`` queue group.

Stateless: the cells live in Redis and every decision is atomic scripts there, so any
number of replicas agree. Redis unreachable means no permits at all (``refused:
ratelimit-unavailable``): the fleet stops sending rather than sending unlimited (with a
Redis Cluster, the targets of a shard that does not answer). A replica that recovers
restarts the no-burst span of what it could not reach (jetfleet/rate_cells.py), so the
requests refused meanwhile do not all go at once.
"""

from __future__ import annotations

import logging
import random
import time

import msgspec
from jetfleet.schemas.permit import (
    HoldPlaced,
    HoldRequest,
    PermitAllowed,
    PermitCall,
    PermitRefused,
    PermitRequest,
    PermitWait,
    RatelimitReply,
)
from jetfleet.services.ratelimit.target_limits import TargetLimitBook
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.auth.credentials import without_secrets
from jetfleet.metrics import CounterFamily, GaugeFamily, MetricFamily
from jetfleet.rate_cells import RateCells, RateUnavailable, jitter_factor
from jetfleet.rate_layout_upgrade import adopt_one_tag_state
from jetfleet.responder import Refusals, Responder, Route
from jetfleet.settings import Settings

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(PermitCall)
UNAVAILABLE_RETRY_S = 1.0
# One log line per this many seconds while failing closed.
FAILING_LOG_EVERY_S = 10.0

REFUSALS = Refusals[RatelimitReply](
    malformed=lambda error: PermitRefused(
        reason="malformed-request", detail=f"not a permit call (schemas/permit.py): {error}"
    ),
    busy=lambda wait, why: PermitRefused(reason="busy", retry_after_s=wait, detail=why),
    failed=lambda exc: PermitRefused(reason="ratelimit-error", detail=str(exc)[:500]),
    too_large=lambda why: PermitRefused(reason="request-too-large", detail=why),
)


class RateLimiter:
    """Answers permits and holds from the Redis cells."""

    name = "ratelimit"

    def __init__(self, settings: Settings, nc: NatsClient) -> None:
        self.settings = settings
        self.nc = nc
        self.cells = RateCells.connect(settings.redis.url, settings.fleet.service_concurrency)
        self.limits = TargetLimitBook(settings, nc.jetstream())
        self.responder = Responder(
            nc, self.name, subjects.QUEUE_RATELIMIT, settings.fleet.service_concurrency
        )
        self.answers = CounterFamily(
            "jetfleet_ratelimit_answers_total",
            "Permit and hold answers by answer (allowed, wait, held, refused), limit and target",
        )
        self.failing = GaugeFamily(
            "jetfleet_ratelimit_failing_closed",
            "1 while this replica cannot reach Redis (or a shard of its cluster) and refuses "
            "the permits that need it",
        )
        self.metrics: list[MetricFamily] = [self.answers, self.failing, self.responder.refused]
        self.failing_since: float | None = None
        """Monotonic time since when Redis has not answered (None: it answers)."""
        self._failing_logged_at = 0.0
        self._rng = random.Random()

    async def start(self) -> None:
        """Follow the target limits and start answering."""
        await self.limits.start()
        if not await self.cells.ping():
            self._failed(
                RateUnavailable(
                    f"redis at {without_secrets(self.settings.redis.url)} does not answer"
                )
            )
        else:
            await self._adopt_one_tag_state()
        self.failing.set(1.0 if self.failing_since is not None else 0.0)
        await self.responder.serve(
            Route(
                subjects.RATELIMIT,
                _decoder,
                self.answer,
                REFUSALS,
                max_bytes=self.settings.fleet.max_request_bytes,
                check=self._check,
            )
        )
        await self.nc.flush()

    async def _adopt_one_tag_state(self) -> None:
        """Carry holds, daily counts and cells over from the key layout before issue 14
        (jetfleet/rate_layout_upgrade.py)."""
        try:
            copied = await adopt_one_tag_state(self.cells.client, list(self.settings.targets))
        except RateUnavailable as exc:
            log.warning("could not carry the older key layout's rate state over: %s", exc)
            return
        if copied:
            log.warning(
                "carried %d rate keys over from the older key layout ({jf-rate}:...:<target>); "
                "a ratelimit replica of that older jetfleet still running counts in those "
                "keys only: stop it",
                copied,
            )

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, answer those in hand, close."""
        await self.responder.drain(timeout_s)
        await self.limits.stop()
        await self.cells.close()

    def _check(self, msg: Msg, call: PermitCall) -> RatelimitReply | None:
        if call.target not in self.settings.targets:
            return PermitRefused(
                reason="unknown-target",
                retry_after_s=5.0,
                detail=f"no target {call.target!r} in the ratelimit service's settings",
            )
        return None

    async def answer(self, call: PermitCall) -> RatelimitReply:
        """Answer one permit or hold."""
        try:
            # Before the permit, the cells of a tag that was out of reach start full
            # again (RateCells), or the first answers after an outage would be a burst of
            # everything refused in it.
            reply = await (
                self.permit(call) if isinstance(call, PermitRequest) else self.hold(call)
            )
            if self.failing_since is not None and not self.cells.failing:
                self._recovered()
        except RateUnavailable as exc:
            self._failed(exc)
            reply = PermitRefused(
                reason="ratelimit-unavailable",
                retry_after_s=UNAVAILABLE_RETRY_S,
                detail=f"the rate limiter cannot reach Redis ({exc}): no permits until it can",
            )
        self._count(call, reply)
        return reply

    async def permit(self, request: PermitRequest) -> RatelimitReply:
        """Take the permit, or say how long to wait."""
        cells, daily = self.limits.cells(request)
        decision = await self.cells.permit(request.target, cells, daily)
        if decision.allowed:
            return PermitAllowed()
        return PermitWait(
            retry_after_s=decision.wait_s,
            limit=decision.limit,
            detail=f"{request.target}: the {decision.limit} limit allows the next request "
            f"in {decision.wait_s:.3f} s",
        )

    async def hold(self, request: HoldRequest) -> RatelimitReply:
        """Hold the target for the whole fleet."""
        target = self.settings.targets[request.target]
        fleet = self.settings.fleet
        hold_s, streak = await self.cells.hold(
            request.target,
            self.limits.target_cell(request.target),
            request.retry_after_s if request.said_how_long else None,
            base_s=fleet.hold_base_s,
            cap_s=target.max_retry_after_s,
            forgive_s=fleet.hold_forgive_s,
            jitter=jitter_factor(self._rng.random()),
        )
        log.warning(
            "target %s answered %d to %s: held for every worker for %.1f s (%s, streak %d)",
            request.target,
            request.status,
            request.worker or "a worker",
            hold_s,
            "as it asked" if request.said_how_long else "adaptive backoff",
            streak,
        )
        return HoldPlaced(hold_s=hold_s, streak=streak)

    def _failed(self, exc: Exception) -> None:
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
            self.failing.set(1.0)
            log.error("rate limiter failing closed: %s; no permits until Redis answers", exc)
            self._failing_logged_at = now
        elif now - self._failing_logged_at >= FAILING_LOG_EVERY_S:
            log.error(
                "rate limiter still failing closed (%.0f s): %s", now - self.failing_since, exc
            )
            self._failing_logged_at = now

    def _recovered(self) -> None:
        """Redis answers again, for every tag that failed lately (RateCells)."""
        assert self.failing_since is not None
        down_s = time.monotonic() - self.failing_since
        self.failing_since = None
        self.failing.set(0.0)
        log.warning(
            "rate limiter reaches Redis again after %.1f s: permits resume at the rate, "
            "with no burst",
            down_s,
        )

    def _count(self, call: PermitCall, reply: RatelimitReply) -> None:
        answer = {
            PermitAllowed: "allowed",
            PermitWait: "wait",
            HoldPlaced: "held",
            PermitRefused: "refused",
        }[type(reply)]
        limit = reply.limit if isinstance(reply, PermitWait) else ""
        if isinstance(reply, PermitRefused):
            limit = reply.reason
        self.answers.inc(answer=answer, limit=limit, target=call.target)
