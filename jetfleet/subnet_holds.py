"""Which worker of an egress subnet serves a target now: at most one at a time, in Redis.

"No two workers sharing an egress subnet serve the same target at once" (issue 10): to
the target, two workers behind one network look like one client sending twice as much.
One sorted set per target, ``jf:subnet:<target>``, holds a member per leased job of a
worker that declares a subnet, ``<job id>\\n<worker>\\n<subnet>``, scored by when that
lease runs out by Redis's clock. A grant for worker W of subnet S takes the job's
member only if no live member of S belongs to another worker; renewals lengthen it; a
release, revoke or settle drops it (with the job's in-flight place), and it expires
with its lease. So a subnet's target passes to its next worker as soon as the owner's
last lease of it ends, and at most one lease TTL after a worker that died.
Scripts are atomic, so any number of leaser replicas agree; a set holds at most the
target's in-flight jobs (``max_in_flight``) plus asks in progress, so the scans are
short. Redis unreachable: the caller fails closed (``CapsUnavailable``).
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal, cast

from redis.exceptions import RedisError

from jetfleet.inflight_caps import NOW_MS_LUA, CapsUnavailable
from jetfleet.redis_topology import RedisClient

KEY_PREFIX = "jf:subnet:"


# ARGV: job id, worker, subnet, ttl ms, own only (1 or 0). Returns {2, 0} when the job's
# member is new, {1, 0} when it was there (lengthened: another ask of the same worker and
# job, or a grant made again), {0, ms} when another worker of the subnet holds the target
# (ms: until the soonest of its members runs out, unless renewed). With own only, a worker
# with no live member of the subnet on the target is refused {0, -1}: see ``take``.
_TAKE = (
    NOW_MS_LUA
    + """
local mine = ARGV[1] .. '\\n' .. ARGV[2] .. '\\n' .. ARGV[3]
local suffix = '\\n' .. ARGV[3]
local busy = nil
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #members, 2 do
  local m = members[i]
  if string.sub(m, -#suffix) == suffix and m ~= mine then
    local rest = string.sub(m, 1, #m - #suffix)
    local worker = string.match(rest, '\\n(.*)$')
    if worker ~= ARGV[2] then
      local left = tonumber(members[i + 1]) - now
      if busy == nil or left < busy then busy = left end
    end
  end
end
if busy ~= nil then return {0, busy} end
local had = redis.call('ZSCORE', KEYS[1], mine)
if ARGV[5] == '1' and not had then
  local own = '\\n' .. ARGV[2] .. suffix
  local found = false
  for i = 1, #members, 2 do
    if string.sub(members[i], -#own) == own then found = true end
  end
  if not found then return {0, -1} end
end
-- GT adds a new member and only ever lengthens one there.
redis.call('ZADD', KEYS[1], 'GT', now + tonumber(ARGV[4]), mine)
if redis.call('PTTL', KEYS[1]) < 2 * tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[4]))
end
if had then return {1, 0} end
return {2, 0}
"""
)

# ARGV: member, ttl ms. Lengthens a member still there (XX): a renewal that lands after
# the job's release must not bring it back. 1 when it was there.
_KEEP = (
    NOW_MS_LUA
    + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', 'GT', now + tonumber(ARGV[2]), ARGV[1])
if redis.call('PTTL', KEYS[1]) < 2 * tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
end
return 1
"""
)

# ARGV: job id. Drops every member of the job (it has one per worker that asked): only for
# a settled job, which nobody is granted again.
DROP_JOB_LUA = """
local prefix = ARGV[1] .. '\\n'
local dropped = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(m, 1, #prefix) == prefix then
    redis.call('ZREM', KEYS[1], m)
    dropped = dropped + 1
  end
end
return dropped
"""


Took = Literal["taken", "kept"]
"""What a successful take did: made the job's member, or found it there (lengthened)."""
OWN_ONLY = -1.0
"""``take``'s answer when ``own_only`` refused a worker holding nothing of the target."""


def member(job_id: str, worker: str, subnet: str) -> str:
    """The set member of ``job_id`` leased to ``worker`` of ``subnet``."""
    return f"{job_id}\n{worker}\n{subnet}"


class SubnetHolds:
    """Take, keep and drop a job's hold on its target for its worker's subnet."""

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._take = client.register_script(_TAKE)
        self._keep = client.register_script(_KEEP)
        self._drop_job = client.register_script(DROP_JOB_LUA)

    async def take(
        self,
        target: str,
        job_id: str,
        worker: str,
        subnet: str,
        ttl_s: float,
        own_only: bool = False,
    ) -> Took | float:
        """Hold ``target`` for ``worker`` of ``subnet`` with this job: ``taken`` (a new
        member) or ``kept`` (it was there already, so it is not this ask's to drop),
        else the seconds until another worker's hold on it runs out unless renewed.
        ``own_only``: refuse (``OWN_ONLY``) unless ``worker`` holds the target for the
        subnet already: after Redis was unreachable, holds not renewed meanwhile may have
        run out, and their holders' renewals must restore them before anybody else of
        the subnet is let in."""
        flag = "1" if own_only else "0"
        took, left_ms = cast(
            list[int],
            await self._call(self._take, target, job_id, worker, subnet, _ms(ttl_s), flag),
        )
        if took:
            return "taken" if took == 2 else "kept"
        return OWN_ONLY if left_ms < 0 else max(0.0, left_ms / 1000)

    async def keep(self, target: str, job_id: str, worker: str, subnet: str, ttl_s: float) -> bool:
        """Lengthen the job's hold with its renewed lease; False when it was gone."""
        return bool(
            await self._call(self._keep, target, member(job_id, worker, subnet), _ms(ttl_s))
        )

    async def drop_member(self, target: str, job_id: str, worker: str, subnet: str) -> None:
        """Drop one holder's hold of the job: the one an ask took that led to no lease,
        or a released or revoked lease's (a later holder's stays)."""
        try:
            await self.client.zrem(KEY_PREFIX + target, member(job_id, worker, subnet))
        except RedisError as exc:
            raise CapsUnavailable(f"redis: {exc}") from exc

    async def drop(self, target: str, job_id: str) -> None:
        """Drop every hold of the job (it settled: nobody is granted it again)."""
        await self._call(self._drop_job, target, job_id)

    async def _call(self, script: Any, target: str, *args: object) -> Any:
        try:
            return await script(keys=[KEY_PREFIX + target], args=list(args))
        except RedisError as exc:
            raise CapsUnavailable(f"redis: {exc}") from exc


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def canonical_subnet(text: str) -> str:
    """``text`` as one network is always written (``10.1.0.0/24``), so two spellings of
    one subnet hold one place.

    Raises:
        ValueError: ``text`` is not a network (host bits set, or not an address at all).
    """
    return str(ipaddress.ip_network(text.strip()))
