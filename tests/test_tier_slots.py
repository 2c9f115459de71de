"""TierSlots (jetfleet/worker/tier_slots.py), the worker's slot pool shared by priority
tiers: pure unit tests, no servers. Each tier has a reserved share; idle slots are lent;
a freed slot goes first to a waiting tier below its share (highest priority first), then
to the highest-priority waiter; a cancelled waiter never keeps a slot."""

from __future__ import annotations

import asyncio

import pytest

from jetfleet.subjects import TIERS
from jetfleet.worker.tier_slots import TierSlots, reserved_slots

SHARES = {"high": 0.5, "normal": 0.3, "bulk": 0.2}  # the WorkerSettings default


async def _settle() -> None:
    """Let every ready task run (futures resolved by a release wake their waiters)."""
    for _ in range(5):
        await asyncio.sleep(0)


def _waiter(slots: TierSlots, tier: str, want: int = 1) -> asyncio.Task[int]:
    return asyncio.create_task(slots.acquire(tier, want))


# --- reserved_slots arithmetic -----------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "expected"),
    [
        (16, {"high": 8, "normal": 4, "bulk": 3}),  # floors: 8, 4.8, 3.2 (one slot unreserved)
        (10, {"high": 5, "normal": 3, "bulk": 2}),
        (4, {"high": 2, "normal": 1, "bulk": 1}),  # bulk's 0.8 is raised to the minimum of 1
        (3, {"high": 1, "normal": 1, "bulk": 1}),
        (2, {"high": 1, "normal": 1, "bulk": 0}),  # minimums overshoot: trimmed from the lowest
        (1, {"high": 1, "normal": 0, "bulk": 0}),
        (0, {"high": 0, "normal": 0, "bulk": 0}),
    ],
)
def test_reserved_slots_are_floored_shares_with_a_minimum_of_one_while_slots_last(
    total: int, expected: dict[str, int]
) -> None:
    reserved = reserved_slots(total, SHARES, TIERS)
    assert reserved == expected
    assert sum(reserved.values()) <= total


def test_reserved_slots_never_exceed_the_total_for_any_size_and_weighting() -> None:
    weightings = [
        SHARES,
        {"high": 1.0, "normal": 1.0, "bulk": 1.0},
        {"high": 0.9, "normal": 0.05, "bulk": 0.05},
        {"high": 0.0, "normal": 0.0, "bulk": 1.0},
        {},  # no shares at all: one slot each while slots last
    ]
    for shares in weightings:
        for total in range(0, 40):
            reserved = reserved_slots(total, shares, TIERS)
            assert sum(reserved.values()) <= total, (shares, total, reserved)
            assert all(n >= 0 for n in reserved.values()), (shares, total, reserved)


@pytest.mark.parametrize("total", [3, 4, 5])
def test_every_tier_keeps_one_reserved_slot_while_slots_last_even_with_skewed_shares(
    total: int,
) -> None:
    # "at least 1 while slots last": with as many slots as tiers, the overshoot of the
    # minimums must come out of a tier holding more than one, never leave bulk at 0
    # (a tier with no reserved slot can be starved, which the design rules out).
    reserved = reserved_slots(total, {"high": 0.9, "normal": 0.05, "bulk": 0.05}, TIERS)
    assert sum(reserved.values()) <= total, reserved
    assert all(n >= 1 for n in reserved.values()), reserved


def test_reserved_slots_are_relative_to_the_sum_of_the_shares() -> None:
    # Shares that do not add up to 1 are weights: 2:1:1 of 8 is 4:2:2.
    assert reserved_slots(8, {"high": 2, "normal": 1, "bulk": 1}, TIERS) == {
        "high": 4,
        "normal": 2,
        "bulk": 2,
    }


# --- hand-out -----------------------------------------------------------------------------


async def test_an_idle_pool_lends_every_slot_to_one_tier_and_caps_at_the_total() -> None:
    slots = TierSlots(4, SHARES, TIERS)
    assert await slots.acquire("bulk", 10) == 4  # bulk borrows all idle slots
    assert slots.in_use == {"high": 0, "normal": 0, "bulk": 4}
    assert slots.free() == 0
    slots.release("bulk", 4)
    assert slots.free() == 4
    assert await slots.acquire("high", 3) == 3
    assert await slots.acquire("normal", 3) == 1  # only what is free, never more
    assert slots.free() == 0


async def test_a_freed_slot_goes_to_a_tier_below_its_share_before_a_higher_tier_above_it() -> None:
    slots = TierSlots(4, SHARES, TIERS)  # reserved high 2, normal 1, bulk 1
    assert await slots.acquire("high", 4) == 4  # high borrowed everything (above its 2)
    high = _waiter(slots, "high")  # waits first...
    bulk = _waiter(slots, "bulk")  # ...but bulk is below its share
    await _settle()
    assert not high.done() and not bulk.done()

    slots.release("high")  # high now holds 3, still above its share of 2
    await _settle()
    assert bulk.done() and await bulk == 1
    assert not high.done()
    assert slots.in_use == {"high": 3, "normal": 0, "bulk": 1}

    slots.release("bulk")  # nobody is below share now: the highest tier wins
    await _settle()
    assert high.done() and await high == 1
    assert slots.in_use == {"high": 4, "normal": 0, "bulk": 0}


async def test_high_gets_the_first_slot_bulk_frees_when_bulk_borrowed_every_slot() -> None:
    slots = TierSlots(4, SHARES, TIERS)
    assert await slots.acquire("bulk", 10) == 4
    bulk = _waiter(slots, "bulk", 10)  # more bulk queued before the high job shows up
    normal = _waiter(slots, "normal", 10)
    high = _waiter(slots, "high", 10)
    await _settle()
    slots.release("bulk")  # one running bulk job ends
    await _settle()
    assert high.done(), "high must get the very first freed slot"
    assert await high == 1  # others still wait: no extra slots taken
    assert not bulk.done() and not normal.done()
    slots.release("bulk")
    await _settle()
    assert normal.done() and not bulk.done()  # normal is below its share, bulk holds 2 > 1
    slots.release("bulk")
    await _settle()
    # bulk holds 1 (its share), high 1 (below its 2): high would win, but it is not waiting
    assert bulk.done()
    assert slots.in_use == {"high": 1, "normal": 1, "bulk": 2}


async def test_between_waiters_of_one_tier_the_first_to_wait_is_served_first() -> None:
    slots = TierSlots(2, {"high": 1, "normal": 1, "bulk": 1}, TIERS)
    assert await slots.acquire("normal", 2) == 2
    first = _waiter(slots, "bulk")
    second = _waiter(slots, "bulk")
    await _settle()
    slots.release("normal")
    await _settle()
    assert first.done() and not second.done()
    slots.release("normal")
    await _settle()
    assert second.done()


async def test_a_waiter_takes_extra_free_slots_only_when_nobody_else_waits() -> None:
    slots = TierSlots(4, SHARES, TIERS)
    assert await slots.acquire("bulk", 4) == 4
    high = _waiter(slots, "high", 10)
    await _settle()
    slots.release("bulk", 3)  # three free at once, one waiter
    await _settle()
    assert await high == 3  # the one handed over plus the two still free
    assert slots.in_use == {"high": 3, "normal": 0, "bulk": 1}


async def test_bulk_is_not_starved_while_high_keeps_the_pool_busy() -> None:
    slots = TierSlots(4, SHARES, TIERS)  # bulk reserves 1
    assert await slots.acquire("high", 4) == 4
    served: list[str] = []
    for _ in range(6):  # high keeps asking for more than the pool has, bulk asks once
        high = _waiter(slots, "high")
        bulk = _waiter(slots, "bulk")
        await _settle()
        slots.release("high")
        await _settle()
        winner = "bulk" if bulk.done() else "high"
        served.append(winner)
        # The winner's slot is given straight back; the loser stops waiting.
        loser = high if winner == "bulk" else bulk
        loser.cancel()
        await asyncio.gather(loser, return_exceptions=True)
        slots.release(winner)
        await slots.acquire("high")  # high refills the pool, as its backlog would
    assert served == ["bulk"] * 6, served
    assert sum(slots.in_use.values()) == 4


# --- cancellation -------------------------------------------------------------------------


async def test_cancelling_a_waiter_before_it_is_served_leaks_no_slot() -> None:
    slots = TierSlots(2, SHARES, TIERS)
    assert await slots.acquire("bulk", 2) == 2
    waiter = _waiter(slots, "high")
    await _settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    slots.release("bulk", 2)
    assert slots.free() == 2
    assert slots.in_use == {"high": 0, "normal": 0, "bulk": 0}
    assert await slots.acquire("normal", 5) == 2  # the pool is whole again


async def test_cancelling_a_waiter_just_after_it_was_handed_a_slot_gives_the_slot_back() -> None:
    slots = TierSlots(2, SHARES, TIERS)
    assert await slots.acquire("bulk", 2) == 2
    waiter = _waiter(slots, "high")
    other = _waiter(slots, "normal")
    await _settle()
    slots.release("bulk")  # hands the slot to `waiter` (counted for high already)...
    assert slots.in_use["high"] == 1
    waiter.cancel()  # ...which is cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await _settle()
    # The slot went on to the next waiter instead of vanishing with the cancelled one.
    assert other.done() and await other == 1
    assert slots.in_use == {"high": 0, "normal": 1, "bulk": 1}
    slots.release("normal")
    slots.release("bulk")
    assert slots.free() == 2


async def test_many_cancelled_waiters_leave_the_pool_whole() -> None:
    slots = TierSlots(3, SHARES, TIERS)
    assert await slots.acquire("bulk", 3) == 3
    waiters = [_waiter(slots, TIERS[n % 3], 4) for n in range(30)]
    await _settle()
    for n, task in enumerate(waiters):
        if n % 2:
            task.cancel()
    slots.release("bulk", 3)
    await _settle()
    for task in waiters:
        if not task.done():
            task.cancel()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    held = sum(r for r in results if isinstance(r, int))
    assert held == sum(slots.in_use.values()) <= 3
    for tier in TIERS:
        slots.release(tier, slots.in_use[tier])
    assert slots.free() == 3
    assert not slots._waiters  # nothing stale left behind


# --- resizing (slots lent between lanes, jetfleet/worker/slot_lending.py) ----------------


async def test_a_grown_pool_hands_its_new_slots_to_waiters_at_once() -> None:
    slots = TierSlots(2, SHARES, TIERS)
    assert await slots.acquire("normal", 2) == 2
    queued = _waiter(slots, "normal", 3)
    await _settle()
    slots.resize(4)
    await _settle()
    assert queued.done() and await queued == 2  # one handed out, one more taken as free
    assert slots.free() == 0


async def test_a_shrunk_pool_hands_out_nothing_until_enough_running_jobs_end() -> None:
    slots = TierSlots(4, SHARES, TIERS)
    assert await slots.acquire("normal", 4) == 4
    slots.resize(2)  # its lent slots go back to their lane: 4 still run
    assert slots.in_use["normal"] == 4 and slots.free() == -2
    assert slots.try_acquire("high", 1) == 0
    queued = _waiter(slots, "high", 5)
    for _ in range(2):
        slots.release("normal")
        await _settle()
        assert not queued.done()
    slots.release("normal")
    await _settle()
    assert queued.done() and await queued == 1  # never more than the pool has
    assert slots.free() == 0
