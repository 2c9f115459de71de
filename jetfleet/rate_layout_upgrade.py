"""Carry a target's rate state over from the one-tag key layout (before issue 14).

Before issue 14 every rate key shared the hash tag ``{jf-rate}``; now a target's keys
carry its own (``{jf-rate:<target>}``, jetfleet/rate_cells.py), so a Redis Cluster
spreads targets over its shards. The fleet's keys (``{jf-rate}:born``,
``{jf-rate}:cell:fleet``, ``{jf-rate}:holds``) kept their names; a target's hold, streak,
daily count and own cell did not. A ratelimit replica copies those of every declared
target into the new keys when it starts, where the new key does not exist yet, with
the time the old one had left: so a hold in force, the day's count and the cell's
spacing survive the upgrade. Egress and identity cells are not copied (their names are
not known without a SCAN): they start full, within the no-burst span, and the
target's own cell still bounds the target. The old keys then expire by themselves.

A replica of the older layout still running counts in the old keys only: stop every
older ratelimit replica before starting a new one (docs/rate-limits.md, "Upgrading").
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisError

from jetfleet.rate_cells import (
    FLEET_TAG,
    RateUnavailable,
    daily_key,
    hold_key,
    streak_key,
    target_cell_key,
)
from jetfleet.redis_topology import RedisClient

# KEYS: the new key. ARGV: kind ('string' or 'hash'), ms left (-1: no expiry), then the
# value, or the hash's field, value pairs. Writes only where the key is missing: a
# replica of the new layout may have written it already, and its value is the newer.
_ADOPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if ARGV[1] == 'string' then
  redis.call('SET', KEYS[1], ARGV[3])
else
  for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


def old_keys(target: str) -> list[tuple[str, str, str]]:
    """``target``'s keys of the one-tag layout: (old key, new key, kind)."""
    return [
        (f"{FLEET_TAG}:hold:{target}", hold_key(target), "string"),
        (f"{FLEET_TAG}:streak:{target}", streak_key(target), "string"),
        (f"{FLEET_TAG}:daily:{target}", daily_key(target), "hash"),
        (f"{FLEET_TAG}:cell:target:{target}", target_cell_key(target, "target"), "string"),
    ]


async def adopt_one_tag_state(client: RedisClient, targets: list[str]) -> int:
    """Copy the old layout's state of ``targets`` into the new keys; how many keys were
    copied (0 once the old keys have expired).

    Raises:
        RateUnavailable: Redis did not answer.
    """
    pairs = [pair for target in targets for pair in old_keys(target)]
    try:
        found = await _read(client, pairs)
        adopt = client.register_script(_ADOPT)
        copied = 0
        for (_old, new, kind), (value, left_ms) in zip(pairs, found, strict=True):
            if value:
                copied += int(await adopt(keys=[new], args=[kind, left_ms, *_flat(value)]))
        return copied
    except (RedisError, OSError) as exc:
        raise RateUnavailable(f"redis: {exc}") from exc


async def _read(client: RedisClient, pairs: list[tuple[str, str, str]]) -> list[tuple[Any, int]]:
    """Every old key's value and ms left, in one round trip (they share one slot)."""
    pipe = client.pipeline()
    for old, _new, kind in pairs:
        if kind == "hash":
            pipe.hgetall(old)
        else:
            pipe.get(old)
        pipe.pttl(old)
    replies = await pipe.execute()
    return [(replies[i], int(replies[i + 1])) for i in range(0, len(replies), 2)]


def _flat(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [item for pair in value.items() for item in pair]
    return [value]
