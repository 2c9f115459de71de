"""The permit and hold scripts (jetfleet/rate_cells.py) against a real redis-server:
GCRA burst then rate, all limits taken together or none, the daily budget, holds, and no
burst after the state is lost or a replica recovers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from jetfleet.rate_cells import (
    KEY_FLEET_BORN,
    RECOVERY_S,
    US,
    Cell,
    RateCells,
    born_key,
    daily_key,
    fleet_cell_key,
    hold_key,
    streak_key,
    target_cell_key,
    target_tag,
)
from jetfleet.rate_layout_upgrade import adopt_one_tag_state

TARGET = "shop"
KEY_BORN = born_key(target_tag(TARGET))


@pytest.fixture
async def cells(redis_url: str, redis_client: aioredis.Redis) -> AsyncIterator[RateCells]:
    made = RateCells.connect(redis_url)
    yield made
    await made.close()


async def _settled_state(client: aioredis.Redis) -> None:
    """A limiter state born long ago (not in its no-burst span after a loss)."""
    seconds, micros = await client.time()
    for key in (KEY_BORN, KEY_FLEET_BORN):
        await client.set(key, (int(seconds) - 30 * 86400) * US + int(micros))


async def _int(client: aioredis.Redis, key: str) -> int:
    value = await client.get(key)
    assert value is not None, f"{key} is not set"
    return int(value)


def _target(rate: float, burst: int) -> Cell:
    return Cell("target", target_cell_key(TARGET, "target"), rate, burst)


async def _allowed_in_a_row(cells: RateCells, cell_list: list[Cell], daily: int = 0) -> int:
    allowed = 0
    while (await cells.permit(TARGET, cell_list, daily)).allowed:
        allowed += 1
        assert allowed < 1000
    return allowed


async def test_a_cell_allows_its_burst_at_once_then_asks_for_one_interval(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    cell = _target(rate=10, burst=3)
    assert await _allowed_in_a_row(cells, [cell]) == 3
    refused = await cells.permit(TARGET, [cell], 0)
    assert not refused.allowed and refused.limit == "target"
    assert 0.05 < refused.wait_s <= 0.1


async def test_send_jitter_slack_cuts_the_burst_so_late_permits_still_arrive_within_the_cap(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    # rate 40, burst 10, 0.1 s of slack: a window of 1.1 s of permits (what one second at
    # the target can hold when sends lag up to 0.1 s) must hold at most 40 + 10.
    cell = Cell("target", target_cell_key(TARGET, "target"), 40, 10, slack_us=100_000)
    assert cell.tau_us == 9 * 25_000 - 100_000
    at_once = await _allowed_in_a_row(cells, [cell])
    assert at_once == 6  # tau 125 ms at 25 ms: 5 more than the first
    assert 40 * 1.1 + at_once <= 40 + 10
    # Never below a single request, and no slack leaves the burst as it was.
    assert Cell("t", "k", 40, 2, slack_us=900_000).tau_us == 0
    assert Cell("t", "k", 40, 10).tau_us == 9 * 25_000


async def test_a_refusal_by_one_limit_takes_nothing_from_the_others(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    fleet = Cell("fleet", fleet_cell_key(), 1, 1)
    roomy = _target(rate=0.01, burst=50)  # no refill while the test runs
    assert (await cells.permit(TARGET, [roomy, fleet], 0)).allowed
    for _ in range(5):
        refused = await cells.permit(TARGET, [roomy, fleet], 0)
        assert not refused.allowed and refused.limit == "fleet"
    # The target's cell gave one permit only: 49 of its burst are still there.
    assert await _allowed_in_a_row(cells, [roomy]) == 49


async def test_a_fleet_refusal_takes_nothing_from_the_targets_daily_count(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    # One script on one server; on a cluster the target's part is taken first and given
    # back (tests/test_redis_beyond_one_node.py): either way the day's count is untouched.
    await _settled_state(redis_client)
    fleet = Cell("fleet", fleet_cell_key(), 1, 1)
    roomy = _target(rate=0.01, burst=50)
    assert (await cells.permit(TARGET, [roomy, fleet], 10)).allowed
    for _ in range(5):
        assert (await cells.permit(TARGET, [roomy, fleet], 10)).limit == "fleet"
    assert await _allowed_in_a_row(cells, [roomy], daily=10) == 9


async def test_a_give_back_never_frees_a_slot_another_permit_took_since(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    cell = _target(rate=0.01, burst=3)
    assert (await cells.permit(TARGET, [cell], 0)).allowed
    first = str(await _int(redis_client, cell.key))
    assert (await cells.permit(TARGET, [cell], 0)).allowed
    # Giving the first back now would free a slot the second one's TAT builds on, and
    # let a fourth request through a burst of three: it stays taken.
    await cells._give_back(keys=[daily_key(TARGET), cell.key], args=[-1, "-1", first])
    assert await _allowed_in_a_row(cells, [cell]) == 1


async def test_the_daily_budget_stops_at_its_count_until_the_next_utc_day(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    cell = _target(rate=1e6, burst=1000)
    assert await _allowed_in_a_row(cells, [cell], daily=7) == 7
    refused = await cells.permit(TARGET, [cell], 7)
    seconds, _ = await redis_client.time()
    to_midnight = 86400 - int(seconds) % 86400
    assert refused.limit == "daily" and abs(refused.wait_s - to_midnight) < 2


async def test_a_lost_state_allows_no_burst_for_the_recovery_span(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    # The fixture emptied the database: as after a Redis restart that lost everything.
    assert await redis_client.get(KEY_BORN) is None
    cell = _target(rate=10, burst=5)
    assert await _allowed_in_a_row(cells, [cell]) == 1
    born = await _int(redis_client, KEY_BORN)
    seconds, micros = await redis_client.time()
    assert 0 <= int(seconds) * US + int(micros) - born < RECOVERY_S * US


async def test_a_replica_recovering_from_an_outage_restarts_the_no_burst_span(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    cell = _target(rate=10, burst=5)
    await cells.recovering(TARGET)
    assert await _allowed_in_a_row(cells, [cell]) == 1


async def test_a_hold_refuses_every_permit_for_its_time_then_resumes_without_a_burst(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    cell = _target(rate=10, burst=5)
    hold_s, streak = await cells.hold(TARGET, cell, 3.0, 1.0, 300.0, 60.0, 1.0)
    assert abs(hold_s - 3.0) < 0.01 and streak == 1
    refused = await cells.permit(TARGET, [cell], 0)
    assert not refused.allowed and refused.limit == "hold"
    assert 2.9 < refused.wait_s <= 3.0
    # A shorter ask does not cut the hold in force.
    again, _ = await cells.hold(TARGET, cell, 1.0, 1.0, 300.0, 60.0, 1.0)
    assert again > 2.9
    # The cell was pushed past the hold's end: when it ends, one at a time.
    tat = await _int(redis_client, cell.key)
    hold_ends = await _int(redis_client, hold_key(TARGET))
    assert tat >= hold_ends + cell.tau_us


async def test_without_retry_after_the_hold_doubles_with_the_streak_up_to_the_cap(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    cell = _target(rate=10, burst=1)
    holds = []
    for _ in range(5):
        holds.append((await cells.hold(TARGET, cell, None, 1.0, 5.0, 60.0, 1.0))[0])
        # The hold has passed (as if its time ran out) before the target says 429 again.
        await redis_client.delete(hold_key(TARGET))
    # Each episode doubles the hold: 1, 2, 4, then the 5 s cap.
    assert [round(h) for h in holds[:3]] == [1, 2, 4]
    assert all(h <= 5.0 for h in holds) and round(holds[-1]) == 5
    # Retry-After: 0 still holds for the first backoff.
    await redis_client.delete(hold_key(TARGET), streak_key(TARGET))
    zero, _ = await cells.hold(TARGET, cell, 0.0, 1.0, 5.0, 60.0, 1.0)
    assert abs(zero - 1.0) < 0.01


async def test_holds_lists_the_held_targets_with_the_time_left(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    await cells.hold(TARGET, _target(10, 1), 30.0, 1.0, 300.0, 60.0, 1.0)
    held = await cells.holds()
    assert set(held) == {TARGET} and 29 < held[TARGET] <= 30


async def test_a_slow_cell_starts_full_for_as_long_as_it_remembers_after_a_loss(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    # State born 60 s ago (past RECOVERY_S), but a cell at 0.05/s with burst 5 remembers
    # 100 s: used for the first time now, after the loss, it must not burst.
    seconds, micros = await redis_client.time()
    await redis_client.set(KEY_BORN, (int(seconds) - 60) * US + int(micros))
    slow = _target(rate=0.05, burst=5)
    assert await _allowed_in_a_row(cells, [slow]) == 1


async def test_one_slow_down_episode_grows_the_backoff_once_and_is_remembered_past_it(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    await _settled_state(redis_client)
    cell = _target(rate=10, burst=1)
    # Sixteen answers of one episode (the requests in flight when the target said 429).
    first = [await cells.hold(TARGET, cell, None, 1.0, 300.0, 0.5, 1.0) for _ in range(16)]
    assert {streak for _, streak in first} == {1}
    assert all(round(hold) == 1 for hold, _ in first)
    # The streak outlives the hold by the quiet spell (0.5 s here), not 0.5 s from when
    # the hold began: so the backoff can grow.
    ttl_ms = await redis_client.pttl(streak_key(TARGET))
    assert ttl_ms > 1000, ttl_ms


async def test_a_replica_carries_the_older_layouts_hold_daily_count_and_cell_over(
    cells: RateCells, redis_client: aioredis.Redis
) -> None:
    # State written by a ratelimit replica from before issue 14 (one tag for every key).
    await _settled_state(redis_client)
    seconds, micros = await redis_client.time()
    now_us = int(seconds) * US + int(micros)
    day = now_us // (86400 * US)
    await redis_client.set(f"{{jf-rate}}:hold:{TARGET}", now_us + 20 * US, px=20_000)
    await redis_client.set(f"{{jf-rate}}:streak:{TARGET}", 3, px=60_000)
    await redis_client.hset(f"{{jf-rate}}:daily:{TARGET}", mapping={"day": day, "used": 7})
    await redis_client.pexpire(f"{{jf-rate}}:daily:{TARGET}", 86_400_000)
    await redis_client.set(f"{{jf-rate}}:cell:target:{TARGET}", now_us + 5 * US, px=6_000)
    # A key of the new layout already written (by an upgraded replica) is left alone.
    await redis_client.set(streak_key(TARGET), 1, px=60_000)

    assert await adopt_one_tag_state(cells.client, [TARGET, "other"]) == 3

    held = await cells.permit(TARGET, [_target(10, 1)], 0)
    assert held.limit == "hold" and 19 < held.wait_s <= 20
    assert 19_000 < await redis_client.pttl(hold_key(TARGET)) <= 20_000
    assert await _int(redis_client, streak_key(TARGET)) == 1
    assert await redis_client.hget(daily_key(TARGET), "used") == b"7"
    assert await _int(redis_client, target_cell_key(TARGET, "target")) == now_us + 5 * US
    # Copied once: a replica started later copies nothing.
    assert await adopt_one_tag_state(cells.client, [TARGET]) == 0
