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

Keys and shards. A script's keys must live in one slot of a Redis Cluster, so they share
a hash tag: everything of one target (its birth time, hold, streak, daily count and its
target, egress and identity cells) is tagged ``{jf-rate:<target>}``, so targets spread
over the shards and each permit's target part is one script on one shard. The fleet
aggregate cell, its birth time and the index of holds are tagged ``{jf-rate}``: one
shard serves every permit's fleet part (the price of one fleet-wide count; without a
fleet rate nothing is asked of it). On one server (or a Sentinel's master) a permit is
still one script over all its keys, the fleet's cell judged by the target's birth time.
On a cluster a permit under a fleet rate is two scripts: the target's cells are taken
first, then the fleet's; when the fleet refuses, the target's are given back, each only
if nobody took from it since (else it stays taken, which can only slow the target,
never let one more through). Either step failing refuses the
permit: a dead shard stops its own targets' permits (and every one under a fleet rate,
if it holds ``{jf-rate}``), the others go on.

Each tag has its own birth time: a shard restarted empty or failed over, or a tag this
replica could not reach for ``OUTAGE_S``, restarts the no-burst span of that tag only.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from jetfleet.errors import JetfleetError
from jetfleet.redis_topology import RedisClient, close_redis, connect_redis, pool_size_for

log = logging.getLogger(__name__)

FLEET_TAG = "{jf-rate}"
"""The hash tag of the fleet aggregate's keys; a target's is ``target_tag(target)``."""
KEY_PATTERN = "{jf-rate*"
"""Every rate-limit key, the fleet's and each target's (the Redis ACL's key pattern)."""
KEY_HOLDS = f"{FLEET_TAG}:holds"
"""Every target's hold by when it ends (microseconds): status reads it, no SCAN."""
DOWN_FORGOTTEN_S = 10.0
"""A tag not tried for this long no longer counts as failing (its target may be gone)."""
RECOVERY_S = 10.0
"""How long after the state's birth (or a replica's recovery) cells start full."""
OUTAGE_S = 2.0
"""How long a replica must have failed closed before its recovery restarts the span: a
passing error (a pool wait, one slow answer) must not slow the whole fleet for 10 s."""
POOL_SIZE = 128
"""The fewest connections one ratelimit replica keeps (per node of a cluster; opened as
needed): a permit holds one for a single round trip, and up to
``fleet.service_concurrency`` permits may be in hand, so the service asks for that many
(``connect``'s callers; a pool of 32 made the 33rd wait, and the 100th fail closed, with
Redis healthy)."""
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

# KEYS: born, hold, daily (hash: day, used), then one key per cell, all of one tag (the
# fleet's part names a hold and a daily count that never exist, with daily 0).
# ARGV: recovery_us, daily limit (0: none), then per cell: interval_us, tau_us.
# Returns {1, day or -1, then per cell: its TAT before (-1: none) and after} when allowed
# (what giving it back needs, as text: Lua would cut 16 digits), else {0, wait_us, which}:
# which is -1 hold, -2 daily, else the cell's index (1-based).
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
local taken = {1, -1}
for i = 1, cells do
  local px = math.ceil((tats[i] - now) / 1000) + 1000
  local before = redis.call('GET', KEYS[3 + i]) or '-1'
  local after = string.format('%d', tats[i])
  redis.call('SET', KEYS[3 + i], after, 'PX', px)
  taken[#taken + 1] = before
  taken[#taken + 1] = after
end
if daily > 0 then
  redis.call('HSET', KEYS[3], 'day', day, 'used', used + 1)
  redis.call('PEXPIRE', KEYS[3], 2 * 86400000)
  taken[2] = day
end
return taken
"""
)

# Gives back what a permit's target part took when its fleet part refused. KEYS: daily,
# then the cells. ARGV: day (-1: no daily count taken), then per cell its TAT before (-1:
# none) and after. A cell is put back only if its TAT is still the one this permit wrote:
# if another permit took from it since, giving back now could free a slot already used
# (and let one more through than the cap), so it stays taken (only ever slower).
_GIVE_BACK = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local day = tonumber(ARGV[1])
if day >= 0 then
  local stored = redis.call('HMGET', KEYS[1], 'day', 'used')
  if stored[1] and tonumber(stored[1]) == day and tonumber(stored[2] or '0') > 0 then
    redis.call('HINCRBY', KEYS[1], 'used', -1)
  end
end
for i = 2, #KEYS do
  local before = ARGV[2 * i - 2]
  if redis.call('GET', KEYS[i]) == ARGV[2 * i - 1] then
    local px = -1
    if before ~= '-1' then px = math.ceil((tonumber(before) - now) / 1000) + 1000 end
    if px > 0 then
      redis.call('SET', KEYS[i], before, 'PX', px)
    else
      redis.call('DEL', KEYS[i])
    end
  end
end
return 1
"""

# KEYS: a tag's birth time. Restarts its no-burst span now, by the clock of its shard.
_REBORN = """
redis.replicate_commands()
local t = redis.call('TIME')
redis.call('SET', KEYS[1], string.format('%d', tonumber(t[1]) * 1000000 + tonumber(t[2])))
return 1
"""

# KEYS: the index of holds. ARGV: when a hold ends (microseconds), the target. Lists the
# hold (a longer one stays) and drops the ended ones.
_INDEX_HOLD = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local old = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[2]) or '0')
if tonumber(ARGV[1]) > old then redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return 1
"""

# KEYS: the index of holds. Returns {now, target, ends, target, ends, ...} for the holds
# in force, by the clock of the index's shard.
_HOLDS_NOW = """
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000000 + tonumber(t[2]))
local found = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
table.insert(found, 1, now)
return found
"""

# KEYS: born, hold, streak, the target's cell (all of the target's tag).
# ARGV: recovery_us, asked_us (-1: the target gave no Retry-After), base_us, cap_us,
# forgive_ms, jitter (a factor drawn by the caller), the target cell's tau_us.
# Returns {hold_us, streak, ends}: the hold in force after this one (a longer one stays)
# and when it ends (text), for the index of holds (on the fleet's tag: a second call).
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
else
  ends = old
end
-- Forgiven only after a quiet spell counted from when the hold ends.
redis.call('PEXPIRE', KEYS[3], math.ceil((ends - now) / 1000) + tonumber(ARGV[5]))
-- No burst when the hold ends: the target's cell resumes full, at its rate.
local tau = tonumber(ARGV[7])
local tat = tonumber(redis.call('GET', KEYS[4]) or '0')
if tat < ends + tau then
  local px = math.ceil((ends + tau - now) / 1000) + 1000
  redis.call('SET', KEYS[4], string.format('%d', ends + tau), 'PX', px)
end
return {ends - now, streak, string.format('%d', ends)}
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


def target_tag(target: str) -> str:
    """The hash tag of every key of ``target``: its slot, so its shard."""
    return "{jf-rate:" + target + "}"


def born_key(tag: str) -> str:
    """When the state of ``tag`` was born (or last restarted its no-burst span)."""
    return f"{tag}:born"


KEY_FLEET_BORN = born_key(FLEET_TAG)


def hold_key(target: str) -> str:
    """Where ``target``'s fleet-wide hold is kept (value: when it ends, microseconds)."""
    return f"{target_tag(target)}:hold"


def streak_key(target: str) -> str:
    """How many slow-down episodes in a row ``target`` has had."""
    return f"{target_tag(target)}:streak"


def daily_key(target: str) -> str:
    """``target``'s daily count (a hash: the UTC day, the requests used)."""
    return f"{target_tag(target)}:daily"


def fleet_cell_key() -> str:
    """The fleet aggregate's cell."""
    return f"{FLEET_TAG}:cell:fleet"


def target_cell_key(target: str, *parts: str) -> str:
    """The key of a cell of ``target``: ``("target",)`` its own, ``("egress", label)``
    or ``("identity", name)`` a sender's to it."""
    return ":".join((target_tag(target), "cell", *parts))


@dataclass
class _Down:
    """A tag whose scripts failed: since when (monotonic), and when last."""

    since: float
    last: float


class RateCells:
    """Permits and holds over one Redis, a Sentinel's master, or a Redis Cluster."""

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._permit = client.register_script(_PERMIT)
        self._give_back = client.register_script(_GIVE_BACK)
        self._hold = client.register_script(_HOLD)
        self._reborn = client.register_script(_REBORN)
        self._index_hold = client.register_script(_INDEX_HOLD)
        self._holds_now = client.register_script(_HOLDS_NOW)
        self._down: dict[str, _Down] = {}

    @classmethod
    def connect(cls, url: str, callers: int = 0) -> RateCells:
        """Cells over the Redis at ``url`` (any form of jetfleet/redis_topology.py;
        connects lazily, on the first call), with a connection for each of up to
        ``callers`` calls at once (at least ``POOL_SIZE``)."""
        return cls(connect_redis(url, pool_size_for(POOL_SIZE, callers)))

    @property
    def failing(self) -> bool:
        """Whether some tag's scripts failed lately and have not worked since: its
        permits are refused (with a cluster, perhaps only the targets of one shard)."""
        now = time.monotonic()
        return any(now - down.last < DOWN_FORGOTTEN_S for down in self._down.values())

    async def permit(self, target: str, cells: list[Cell], daily: int) -> Decision:
        """Take one permit from every cell (and the daily budget), or none.

        ``cells`` are the target's (keys of ``target_tag(target)``) and at most the
        fleet's (``fleet_cell_key()``): on one server all in one script, on a cluster the
        fleet's taken after the target's (see the module's docstring).

        Raises:
            RateUnavailable: Redis did not answer.
        """
        fleet = [c for c in cells if c.key == fleet_cell_key()]
        own = [c for c in cells if c.key != fleet_cell_key()]
        if not isinstance(self.client, RedisCluster):
            # One server holds every key: one script takes them all, in one round trip.
            own, fleet = own + fleet, []
        tag = target_tag(target)
        keys = [born_key(tag), hold_key(target), daily_key(target)] + [c.key for c in own]
        reply = await self._run(tag, self._permit, keys, _permit_args(own, daily))
        if int(reply[0]) != 1:
            return _refusal(reply, own)
        if not fleet:
            return Decision(allowed=True)
        fleet_keys = [KEY_FLEET_BORN, f"{FLEET_TAG}:hold", f"{FLEET_TAG}:daily", fleet[0].key]
        try:
            answer = await self._run(FLEET_TAG, self._permit, fleet_keys, _permit_args(fleet, 0))
        except RateUnavailable:
            await self._return(tag, keys, own, reply)
            raise
        if int(answer[0]) == 1:
            return Decision(allowed=True)
        await self._return(tag, keys, own, reply)
        return _refusal(answer, fleet)

    async def _return(self, tag: str, keys: list[str], own: list[Cell], taken: list[Any]) -> None:
        """Give back what the target part took (best effort: kept, it only slows)."""
        args = [int(taken[1]), *(_text(v) for v in taken[2:])]
        try:
            await self._run(tag, self._give_back, [keys[2]] + [c.key for c in own], args)
        except RateUnavailable as exc:
            log.info("could not give back a permit's target part (it stays taken): %s", exc)

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
        tag = target_tag(target)
        keys = [born_key(tag), hold_key(target), streak_key(target), target_cell.key]
        asked = -1 if asked_s is None else round(asked_s * US)
        args = [
            round(RECOVERY_S * US),
            asked,
            round(base_s * US),
            round(cap_s * US),
            max(1, round(forgive_s * 1000)),
            repr(jitter),
            target_cell.tau_us,
        ]
        reply = await self._run(tag, self._hold, keys, args)
        try:
            await self._run(FLEET_TAG, self._index_hold, [KEY_HOLDS], [_text(reply[2]), target])
        except RateUnavailable as exc:
            # The hold is in force (it lives with the target); only status misses it.
            log.warning("hold of %s not listed for status: %s", target, exc)
        return int(reply[0]) / US, int(reply[1])

    async def recovering(self, target: str | None = None) -> None:
        """Restart the no-burst span of ``target``'s keys (None: the fleet's), as after
        an outage: permits refused meanwhile would otherwise all be asked for at once.

        Raises:
            RateUnavailable: Redis did not answer.
        """
        tag = FLEET_TAG if target is None else target_tag(target)
        await self._call(self._reborn, [born_key(tag)], [])

    async def holds(self) -> dict[str, float]:
        """Every target held now and the seconds left (one read of the holds' index,
        however many targets there are)."""
        found = await self._call(self._holds_now, [KEY_HOLDS], [])
        now = int(_text(found[0]))
        pairs = found[1:]
        return {
            _text(pairs[i]): (int(float(_text(pairs[i + 1]))) - now) / US
            for i in range(0, len(pairs), 2)
        }

    async def silent_masters(self) -> list[str]:
        """The masters of a Redis Cluster that do not answer a ping now (``host:port``):
        the targets whose keys they hold get no permits. Empty for one server."""
        if not isinstance(self.client, RedisCluster):
            return []
        silent = []
        for node in self.client.get_primaries():
            try:
                await self.client.ping(target_nodes=node)
            except (RedisError, OSError):
                silent.append(node.name)
        return silent

    async def ping(self) -> bool:
        """Whether Redis answers now."""
        try:
            return bool(await self.client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        """Close every connection the client opened."""
        await close_redis(self.client)

    async def _run(self, tag: str, script: Any, keys: list[str], args: list[Any]) -> list[Any]:
        """Run a script of ``tag``'s keys, first restarting its no-burst span if its
        shard did not answer for ``OUTAGE_S`` or more (a passing error does not)."""
        down = self._down.get(tag)
        now = time.monotonic()
        try:
            if down is not None and now - down.since >= OUTAGE_S:
                await self._call(self._reborn, [born_key(tag)], [])
            reply = await self._call(script, keys, args)
        except RateUnavailable:
            if down is None:
                self._down[tag] = _Down(now, now)
            else:
                down.last = now
            raise
        # Permits of one tag run concurrently: only the first success after a failure
        # finds its record.
        if down is not None and self._down.pop(tag, None) is not None:
            log.info("%s answers again after %.1f s", tag, now - down.since)
        return reply

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> list[Any]:
        try:
            return cast(list[Any], await script(keys=keys, args=args))
        except (RedisError, OSError) as exc:
            raise RateUnavailable(f"redis: {exc}") from exc


def _permit_args(cells: list[Cell], daily: int) -> list[int]:
    args = [round(RECOVERY_S * US), daily]
    for cell in cells:
        args += [cell.interval_us, cell.tau_us]
    return args


def _refusal(reply: list[Any], cells: list[Cell]) -> Decision:
    which = int(reply[2])
    limit = {-1: "hold", -2: "daily"}.get(which) or cells[which - 1].name
    return Decision(allowed=False, wait_s=int(reply[1]) / US, limit=limit)


def _text(value: bytes | str | int | float) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def jitter_factor(draw: float) -> float:
    """A backoff's jitter from a uniform draw in [0, 1): 0.75 to 1.25."""
    if not math.isfinite(draw):
        return 1.0
    return 0.75 + 0.5 * min(max(draw, 0.0), 1.0)
