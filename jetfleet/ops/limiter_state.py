"""The rate limiter's side of ``jetfleet status``: whether permits can be given, and which
targets are held fleet-wide and for how long.

Status asks Redis itself, at the ``[redis] url`` every ratelimit replica uses, rather
than asking a replica: a permit is one script in that Redis, so when status cannot reach
it no replica can give a permit either (each fails closed). Holds are keys there (value:
when the hold ends, microseconds by Redis's clock, jetfleet/rate_cells.py), so they
survive any restart of the services and every process reads the same ones. What this
cannot see is a single replica cut off from a Redis the others reach; that replica's
``jetfleet_ratelimit_failing_closed`` gauge shows it (docs/rate-limits.md). With a Redis
Cluster the holds live on one shard, so status also pings every master: one silent
master fails its targets' permits closed, and status says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec

from jetfleet.auth.credentials import without_secrets
from jetfleet.rate_cells import RateCells, RateUnavailable
from jetfleet.settings import Settings

LimiterHealth = Literal["ok", "failing-closed"]
MAX_HOLDS_SHOWN = 50
"""Held targets listed one by one at most (the longest holds first); the rest are only
counted, so status stays small with thousands of targets held."""


class TargetHold(msgspec.Struct, frozen=True):
    """One target held fleet-wide: nobody is sent anything for ``seconds_left``."""

    target: str
    seconds_left: float


@dataclass
class LimiterState:
    """What status shows of the rate limiter."""

    health: LimiterHealth = "ok"
    detail: str = ""
    holds: list[TargetHold] = field(default_factory=list)
    held: int = 0
    """How many targets are held (``holds`` lists at most ``MAX_HOLDS_SHOWN``)."""


async def limiter_state(settings: Settings, max_shown: int = MAX_HOLDS_SHOWN) -> LimiterState:
    """Ping the limiter's Redis and read the holds in force."""
    cells = RateCells.connect(settings.redis.url)
    try:
        found = await cells.holds()
        silent = await cells.silent_masters()
    except RateUnavailable as exc:
        return LimiterState(
            health="failing-closed",
            detail=f"redis at {without_secrets(settings.redis.url)} does not answer ({exc}): "
            "the rate "
            "limiter gives no permits, so nothing is sent to any target; holds unknown",
        )
    finally:
        await cells.close()
    longest = sorted(found.items(), key=lambda item: (-item[1], item[0]))[:max_shown]
    return LimiterState(
        health="failing-closed" if silent else "ok",
        detail=f"Redis Cluster masters {', '.join(silent)} do not answer: the targets whose "
        "rate keys they hold get no permits until a replica takes over or they return"
        if silent
        else "",
        holds=[TargetHold(target=name, seconds_left=round(left, 3)) for name, left in longest],
        held=len(found),
    )
