"""Fleet-wide in-flight caps of targets, kept in Redis.

A target's ``max_in_flight`` counts across all its tiers (and its partition's shared
consumers), which no single consumer's ``max_ack_pending`` can enforce, so the leaser
caps it: one sorted set per target, ``jf:inflight:<target>``, holding the job ids with a
live lease, each scored by when that lease runs out by Redis's clock. Taking and
keeping a place are Lua scripts and dropping one is a ZREM, each atomic, so any number
of leaser and sink replicas agree.
The leaser takes and keeps places and drops them on release or revoke; the sink drops a
job's place when it settles the job. Entries expire with their lease, so a worker that
dies frees its places by itself; losing Redis loses only the counts, and the leaser
refuses (fails closed) while Redis is unreachable.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal, cast

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisError

from jetfleet.errors import JetfleetError
from jetfleet.redis_topology import RedisClient, close_redis, connect_redis, pool_size_for

KEY_PREFIX = "jf:inflight:"
# The fewest connections one leaser (or sink) keeps to Redis (opened as needed); each call
# holds one for a single round trip. 32 ran dry at about 1,000 renewals/s (10,000 workers
# renewing every 10 s, bench/fleet_leases_bench.py): each renewal extends its job's place,
# and the extensions waited for a connection until they failed ("No connection
# available"). A service gets one per call it may have in hand (``connect``'s callers).
POOL_SIZE = 128

# Every script first drops the places whose lease ran out, by Redis's clock (a sorted
# set scored by expiry in ms; jetfleet/subnet_holds.py starts its scripts with it too).
NOW_MS_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
"""

# ARGV: job id, cap, ttl in ms. 2 when the job took a new place, 1 when it held one
# already (its place is lengthened), 0 when the target is full.
# The key itself expires once idle (twice the longest lease seen); its expiry only ever
# grows, so a shorter lease cannot take other jobs' places with it.
_TAKE = (
    NOW_MS_LUA
    + """
local taken = 1
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  taken = 2
else
  redis.call('ZADD', KEYS[1], 'GT', now + tonumber(ARGV[3]), ARGV[1])
end
if redis.call('PTTL', KEYS[1]) < 2 * tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[3]))
end
return taken
"""
)

# ARGV: job id, ttl in ms, restore (1/0). Without restore only a place still held is
# kept (XX): a renewal that lands after the job's release or settle must not bring back a
# freed place (a ghost that would keep a small target's cap full for a whole TTL). With
# restore the place is put back even if missing: the caller has checked that the job is
# still running (Redis lost its places). GT: a place is only ever lengthened, never cut
# short. Returns 1 when the job held its place, 0 when it was missing.
_KEEP = (
    NOW_MS_LUA
    + """
local held = redis.call('ZSCORE', KEYS[1], ARGV[1]) and 1 or 0
if held == 1 or ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], 'GT', now + tonumber(ARGV[2]), ARGV[1])
  if redis.call('PTTL', KEYS[1]) < 2 * tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
  end
end
return held
"""
)

# Every key given: drop expired places, then count. One round trip for many targets (per
# slot of a Redis Cluster, whose scripts take keys of one slot only).
_COUNT_MANY = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local counts = {}
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  counts[i] = redis.call('ZCARD', key)
end
return counts
"""
# Keys per counting call: one round trip each, without one huge script call.
COUNT_BATCH = 500


class CapsUnavailable(JetfleetError):
    """Redis could not be reached: no place can be given (the cap fails closed)."""


class InFlightCaps:
    """Take, keep and drop a job's place under its target's in-flight cap."""

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._take = client.register_script(_TAKE)
        self._keep = client.register_script(_KEEP)
        self._count_many = client.register_script(_COUNT_MANY)

    @classmethod
    def connect(cls, url: str, callers: int = 0) -> InFlightCaps:
        """A client for ``url`` (any form of jetfleet/redis_topology.py) that gives up
        quickly, so a grant never waits long on Redis, with a connection for each of up
        to ``callers`` calls at once (a leaser's ``fleet.service_concurrency``; at least
        ``POOL_SIZE``).

        Past that, a caller waits (up to a second) for a free connection rather than
        failing: the default pool refuses at once past its size, which under a burst of
        grants would refuse them as ``caps-unavailable`` and leave places to expire. A
        pool of 128 under a leaser's 512 grants at once made the last ones wait their
        turn four deep, past that second on a loaded machine.
        """
        return cls(connect_redis(url, pool_size_for(POOL_SIZE, callers)))

    async def reachable(self) -> bool:
        """Whether Redis answers a ping now."""
        try:
            return bool(await self.client.ping())
        except RedisError:
            return False

    async def close(self) -> None:
        """Close every connection the client opened."""
        await close_redis(self.client)

    async def take(
        self, target: str, job_id: str, cap: int, ttl_s: float
    ) -> Literal["full", "kept", "taken"]:
        """Give ``job_id`` a place under ``cap``: ``full`` when the target is. A job
        that already holds a place keeps it (``kept``: a grant made again never counts
        twice); ``taken`` is a new place."""
        taken = await self._call(self._take, target, job_id, cap, _ms(ttl_s))
        return "taken" if taken == 2 else "kept" if taken == 1 else "full"

    async def keep(self, target: str, job_id: str, ttl_s: float, restore: bool = False) -> bool:
        """Extend the job's place with its renewed lease, if it still holds one (a freed
        place is not brought back unless ``restore``, nor a place ever shortened).
        Whether the job held its place."""
        held = await self._call(self._keep, target, job_id, _ms(ttl_s), 1 if restore else 0)
        return bool(held)

    async def drop(self, target: str, job_id: str) -> None:
        """Free the job's place (its lease was released or revoked)."""
        try:
            await self.client.zrem(KEY_PREFIX + target, job_id)
        except RedisError as exc:
            # Not fatal: the place frees itself when the lease's time runs out.
            raise CapsUnavailable(f"redis: {exc}") from exc

    async def counts(self, targets: list[str]) -> dict[str, int]:
        """Jobs of each target holding a place now, in one round trip per 500 targets."""
        found: dict[str, int] = {}
        for group in self._by_slot(targets):
            for start in range(0, len(group), COUNT_BATCH):
                batch = group[start : start + COUNT_BATCH]
                try:
                    values = await self._count_many(keys=[KEY_PREFIX + t for t in batch])
                except RedisError as exc:
                    raise CapsUnavailable(f"redis: {exc}") from exc
                found.update(zip(batch, (int(v) for v in values), strict=True))
        return found

    def _by_slot(self, targets: list[str]) -> list[list[str]]:
        """``targets`` in groups a script may take together: all at once on one server,
        one group per slot on a cluster."""
        if not isinstance(self.client, RedisCluster):
            return [targets]
        groups: dict[int, list[str]] = defaultdict(list)
        for target in targets:
            groups[key_slot((KEY_PREFIX + target).encode())].append(target)
        return list(groups.values())

    async def _call(self, script: Any, target: str, *args: object) -> int:
        try:
            return cast(int, await script(keys=[KEY_PREFIX + target], args=list(args)))
        except RedisError as exc:
            raise CapsUnavailable(f"redis: {exc}") from exc


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
