"""The fleet's rate limits as GCRA cells in Redis, each decision one atomic Lua script.

A permit checks, in one script, every limit that applies to a request: the hold its
target asked for, its daily budget, and the cells of the fleet aggregate, the target, the
(egress, target) and the (identity, target). Either all allow and all are taken, or none
is and the answer is how long to wait (the longest of those that refuse). Time is
Redis's clock (``TIME``), never a caller's.

A cell keeps its theoretical arrival time (TAT, microseconds). With emission interval
``T = 1 / rate`` and tolerance ``tau = (burst - 1) * T``, a request at ``now`` conforms
when ``now >= TAT - tau``, and then ``TAT = max(TAT, now) + T``: at most ``burst`` at once
after an idle spell, ``rate`` per second after that, so any window of ``w`` seconds sees
at most ``rate * w + burst``.

No burst after trouble. Losing Redis's state, or the limiter having been cut off from it
for a while, must not let a burst through on top of the traffic sent just before. So the
state has a birth time (``KEY_BORN``, set when the script finds it missing, and again by
a replica that reconnects after failing closed for ``OUTAGE_S`` or more): for
``RECOVERY_S`` after it, and for a slow cell as long as it remembers (``tau + T``), a
cell with no state starts full (``TAT = now + tau``), so traffic resumes at the rate
with no burst. Only a cell with no state: one already taken from keeps its TAT and so
its tolerance, or every request a little late (a permit is asked again only after a
round trip) would lose that lateness for good, and a backlogged target would get well
under its rate (about 60 % of 8/s in the I4 test) for the whole span. A cell that has
state is accurate: the burst it allows is one the target has really gone without.

Every key shares the hash tag ``{jf-rate}``, so the one script runs on one shard of a
Redis Cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from jetfleet.errors import JetfleetError

TAG = "{jf-rate}"
KEY_BORN = f"{TAG}:born"
KEY_HOLDS = f"{TAG}:holds"
"""Every target's hold by when it ends (microseconds): status reads it, no SCAN."""
RECOVERY_S = 10.0
"""How long after the state's birth (or a replica's recovery) cells start full."""
OUTAGE_S = 2.0
"""How long a replica must have failed closed before its recovery restarts the span: a
passing error (a pool wait, one slow answer) must not slow the whole fleet for 10 s."""
POOL_SIZE = 128
"""Connections one ratelimit replica keeps: a permit holds one for a single round trip,
and up to ``fleet.service_concurrency`` permits may be in hand (a pool of 32 made the
33rd wait, and the 100th fail closed, with Redis healthy)."""
US = 1_000_000

# Shared prelude: now (microseconds, Redis clock) and whether the state is recovering.
# ARGV[1] is the recovery span in microseconds. Times are written with %d: Lua's own
# number formatting keeps 14 digits, and a time in microseconds has 16.
_PRELUDE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local born = redis.call('GET', KEYS[1])
if not born then
  redis.call('SET', KEYS[1], string.format('%d', now))
  born = now
else
  born = tonumber(born)
end
local age = now - born
local span = tonumber(ARGV[1])
"""

# KEYS: born, hold, daily (hash: day, used), then one key per cell.
# ARGV: recovery_us, daily limit (0: none), then per cell: interval_us, tau_us.
# Returns {1} when allowed, else {0, wait_us, which}: which is -1 hold, -2 daily, else the
# cell's index (1-based).
_PERMIT = (
    _PRELUDE
    + """
local hold = redis.call('GET', KEYS[2])
if hold and tonumber(hold) > now then
  return {0, tonumber(hold) - now, -1}
end
local daily = tonumber(ARGV[2])
local day = math.floor(now / 86400000000)
local used = 0
if daily > 0 then
  local stored = redis.call('HMGET', KEYS[3], 'day', 'used')
  if stored[1] and tonumber(stored[1]) == day then used = tonumber(stored[2] or '0') end
  if used >= daily then
    return {0, (day + 1) * 86400000000 - now, -2}
  end
end
local cells = #KEYS - 3
local tats = {}
local wait = 0
local which = 0
for i = 1, cells do
  local interval = tonumber(ARGV[1 + 2 * i])
  local tau = tonumber(ARGV[2 + 2 * i])
  local stored = redis.call('GET', KEYS[3 + i])
  local tat = tonumber(stored or '0')
  -- A cell remembers its last requests for up to tau + interval: for as long as that,
  -- at least, a cell that lost its state (or never had one) must start full.
  if not stored and age < math.max(span, tau + interval) then tat = now + tau end
  local at = tat - tau
  if now < at and at - now > wait then
    wait = at - now
    which = i
  end
  tats[i] = math.max(tat, now) + interval
end
if wait > 0 then return {0, wait, which} end
for i = 1, cells do
  local px = math.ceil((tats[i] - now) / 1000) + 1000
  redis.call('SET', KEYS[3 + i], string.format('%d', tats[i]), 'PX', px)
end
if daily > 0 then
  redis.call('HSET', KEYS[3], 'day', day, 'used', used + 1)
  redis.call('PEXPIRE', KEYS[3], 2 * 86400000)
end
return {1}
"""
)

# KEYS: born, hold, streak, the target's cell, the index of holds (a sorted set).
# ARGV: recovery_us, asked_us (-1: the target gave no Retry-After), base_us, cap_us,
# forgive_ms, jitter (a factor drawn by the caller), the target cell's tau_us, target.
# Returns {hold_us, streak}: the hold in force after this one (a longer one stays).
_HOLD = (
    _PRELUDE
    + """
local old = tonumber(redis.call('GET', KEYS[2]) or '0')
-- One slow-down episode counts once: the answers of requests already in flight when
-- the hold began (and any during it) do not grow the backoff.
local streak
if old > now then
  streak = tonumber(redis.call('GET', KEYS[3]) or '1')
else
  streak = redis.call('INCR', KEYS[3])
end
local asked = tonumber(ARGV[2])
local cap = tonumber(ARGV[4])
local wait
if asked >= 0 then
  -- What the target said, but never less than the first backoff: a Retry-After of 0
  -- (or a date already past) must not let the whole fleet straight back in.
  wait = math.max(asked, tonumber(ARGV[3]))
else
  wait = tonumber(ARGV[3]) * math.pow(2, math.min(streak - 1, 40)) * tonumber(ARGV[6])
end
wait = math.min(math.floor(wait), cap)
local ends = now + wait
if ends > old then
  redis.call('SET', KEYS[2], string.format('%d', ends), 'PX', math.ceil(wait / 1000) + 1)
  redis.call('ZADD', KEYS[5], ends, ARGV[8])
else
  ends = old
end
-- Forgiven only after a quiet spell counted from when the hold ends.
redis.call('PEXPIRE', KEYS[3], math.ceil((ends - now) / 1000) + tonumber(ARGV[5]))
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
-- No burst when the hold ends: the target's cell resumes full, at its rate.
local tau = tonumber(ARGV[7])
local tat = tonumber(redis.call('GET', KEYS[4]) or '0')
if tat < ends + tau then
  local px = math.ceil((ends + tau - now) / 1000) + 1000
  redis.call('SET', KEYS[4], string.format('%d', ends + tau), 'PX', px)
end
return {ends - now, streak}
"""
)


class RateUnavailable(JetfleetError):
    """Redis did not answer: no permit can be given (the limiter fails closed)."""


@dataclass(frozen=True)
class Cell:
    """One GCRA limit: a key, its rate (per second) and its burst."""

    name: str
    """What it limits, for the answer: fleet, target, egress or identity."""
    key: str
    rate: float
    burst: int
    slack_us: int = 0
    """Taken off the burst tolerance: requests permitted up to this far apart may arrive
    together (a target's ``send_jitter_s``), and must still keep to rate and burst."""

    @property
    def interval_us(self) -> int:
        # Rounded up: never a hair faster than the rate asked for.
        return max(1, math.ceil(US / self.rate))

    @property
    def tau_us(self) -> int:
        return max(0, (self.burst - 1) * self.interval_us - self.slack_us)


@dataclass(frozen=True)
class Decision:
    """A permit's answer: allowed, or the wait and the limit that asked for it."""

    allowed: bool
    wait_s: float = 0.0
    limit: str = ""


def hold_key(target: str) -> str:
    """Where ``target``'s fleet-wide hold is kept (value: when it ends, microseconds)."""
    return f"{TAG}:hold:{target}"


def cell_key(*parts: str) -> str:
    """The key of the cell limiting ``parts`` (for example ``("target", "shop")``)."""
    return ":".join((TAG, "cell", *parts))


class RateCells:
    """Permits and holds over one Redis (or one shard of a cluster)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._permit = client.register_script(_PERMIT)
        self._hold = client.register_script(_HOLD)

    @classmethod
    def connect(cls, url: str) -> RateCells:
        """Cells over the Redis at ``url`` (connects lazily, on the first call).

        The pool blocks (up to a second) for a free connection: the default pool refuses
        at once past its size, which under a burst of permits would fail them closed
        (and restart the no-burst span) for want of a connection, not of Redis."""
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_SIZE,
            timeout=1.0,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
        )
        return cls(aioredis.Redis(connection_pool=pool))

    async def permit(self, target: str, cells: list[Cell], daily: int) -> Decision:
        """Take one permit from every cell (and the daily budget), or none.

        Raises:
            RateUnavailable: Redis did not answer.
        """
        keys = [KEY_BORN, hold_key(target), f"{TAG}:daily:{target}"] + [c.key for c in cells]
        args: list[int] = [round(RECOVERY_S * US), daily]
        for cell in cells:
            args += [cell.interval_us, cell.tau_us]
        reply = await self._call(self._permit, keys, args)
        if int(reply[0]) == 1:
            return Decision(allowed=True)
        which = int(reply[2])
        limit = {-1: "hold", -2: "daily"}.get(which) or cells[which - 1].name
        return Decision(allowed=False, wait_s=int(reply[1]) / US, limit=limit)

    async def hold(
        self,
        target: str,
        target_cell: Cell,
        asked_s: float | None,
        base_s: float,
        cap_s: float,
        forgive_s: float,
        jitter: float,
    ) -> tuple[float, int]:
        """Hold ``target`` for everyone: ``asked_s`` if the target said (at least
        ``base_s``), else ``base_s`` doubled per answer in a row (times ``jitter``), at
        most ``cap_s``. Returns the
        hold now in force (seconds) and the streak.

        Raises:
            RateUnavailable: Redis did not answer.
        """
        keys = [
            KEY_BORN,
            hold_key(target),
            f"{TAG}:streak:{target}",
            target_cell.key,
            KEY_HOLDS,
        ]
        asked = -1 if asked_s is None else round(asked_s * US)
        args = [
            round(RECOVERY_S * US),
            asked,
            round(base_s * US),
            round(cap_s * US),
            max(1, round(forgive_s * 1000)),
            repr(jitter),
            target_cell.tau_us,
            target,
        ]
        reply = await self._call(self._hold, keys, args)
        return int(reply[0]) / US, int(reply[1])

    async def recovering(self) -> None:
        """This replica could not reach Redis and now can: start the no-burst span again,
        since permits refused meanwhile would otherwise all be asked for at once."""
        try:
            await self.client.set(KEY_BORN, await self._now_us())
        except (RedisError, OSError) as exc:
            raise RateUnavailable(f"redis: {exc}") from exc

    async def holds(self) -> dict[str, float]:
        """Every target held now and the seconds left (one read of the holds' index,
        however many targets there are)."""
        try:
            now = await self._now_us()
            found = await self.client.zrangebyscore(KEY_HOLDS, f"({now}", "+inf", withscores=True)
        except (RedisError, OSError) as exc:
            raise RateUnavailable(f"redis: {exc}") from exc
        pairs = cast(list[tuple[bytes | str, float]], found)
        return {
            (name.decode() if isinstance(name, bytes) else name): (int(ends) - now) / US
            for name, ends in pairs
        }

    async def ping(self) -> bool:
        """Whether Redis answers now."""
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        """Close the connection pool (a pool given to the client is not closed with it)."""
        await self.client.aclose(close_connection_pool=True)

    async def _now_us(self) -> int:
        seconds, micros = await self.client.time()
        return int(seconds) * US + int(micros)

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> list[Any]:
        try:
            return cast(list[Any], await script(keys=keys, args=args))
        except (RedisError, OSError) as exc:
            raise RateUnavailable(f"redis: {exc}") from exc


def jitter_factor(draw: float) -> float:
    """A backoff's jitter from a uniform draw in [0, 1): 0.75 to 1.25."""
    if not math.isfinite(draw):
        return 1.0
    return 0.75 + 0.5 * min(max(draw, 0.0), 1.0)
