"""SlotLending (jetfleet/worker/slot_lending.py): a worker's lanes whose targets are all
held lend their slots to lanes with a backlog, and get them back as the borrowed jobs end
once the hold is over. Pure unit tests over real TierSlots and a fake monotonic clock, no
servers (the worker's rebalancing against real services: tests/test_rebalancing.py)."""

from __future__ import annotations

import asyncio
import logging
import random

import msgspec
import pytest

from jetfleet.errors import ConfigError
from jetfleet.subjects import TIERS
from jetfleet.work_lanes import LaneMap, WorkLane
from jetfleet.worker.slot_lending import SlotLending, standby_lanes
from jetfleet.worker.tier_slots import TierSlots
from tests.conftest import make_settings
from tests.queueing.helpers import target

SHARES = {"high": 0.5, "normal": 0.3, "bulk": 0.2}
SHARE = 2  # worker.concurrency


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lanes_of(*specs: tuple[str, tuple[str, ...], int]) -> list[WorkLane]:
    return [WorkLane(name=name, targets=targets, max_in_flight=cap) for name, targets, cap in specs]


def pools(lanes: list[WorkLane]) -> dict[str, TierSlots]:
    return {lane.name: TierSlots(SHARE, SHARES, TIERS) for lane in lanes}


def lending_for(
    lanes: list[WorkLane], clock: Clock, may_borrow: bool = True
) -> tuple[SlotLending, dict[str, TierSlots]]:
    slots = pools(lanes)
    lending = SlotLending("w-1", lanes, slots, lambda lane: may_borrow, clock)
    return lending, slots


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def totals(slots: dict[str, TierSlots]) -> dict[str, int]:
    return {name: s.total for name, s in slots.items()}


TWO = lanes_of(("a", ("a",), 8), ("b", ("b",), 8))


def test_a_lane_held_by_a_target_wide_refusal_lends_its_share_to_a_busy_lane() -> None:
    lending, slots = lending_for(TWO, Clock())
    assert slots["b"].try_acquire("normal", 10) == SHARE  # b's own share, all busy
    assert lending.top_up("b", 10) == 0  # nobody lends yet

    lending.held("a", "quarantined", 5.0)
    assert lending.top_up("b", 10) == SHARE  # a's whole share
    assert totals(slots) == {"a": 0, "b": 4}
    assert slots["b"].try_acquire("normal", 10) == 2  # b runs 4 at once
    assert slots["a"].try_acquire("normal", 1) == 0  # a has none left to start a job
    assert lending.lent.get(worker="w-1", lane="a") == 2
    assert lending.borrowed.get(worker="w-1", lane="b") == 2


def test_a_borrowed_slot_not_in_use_goes_back_at_once_and_is_borrowed_again_while_held() -> None:
    lending, slots = lending_for(TWO, Clock())
    slots["b"].try_acquire("normal", 10)
    lending.held("a", "paused", 5.0)
    assert lending.top_up("b", 10) == 2
    taken = slots["b"].try_acquire("normal", 2)
    slots["b"].release("normal", taken - 1)  # the fetch brought one job, not two
    assert totals(slots) == {"a": 1, "b": 3}
    slots["b"].release("normal")  # a borrowed job ends, nothing queued in b
    assert totals(slots) == {"a": 2, "b": 2}
    assert lending.borrowed.get(worker="w-1", lane="b") is None
    assert lending.top_up("b", 10) == 2  # b still busy, a still held: it borrows again


async def test_a_slot_a_held_lane_frees_goes_to_a_lane_queued_for_one() -> None:
    lending, slots = lending_for(TWO, Clock())
    slots["b"].try_acquire("normal", 10)
    queued = asyncio.create_task(slots["b"].acquire("high", 1))
    await settle()
    assert slots["a"].try_acquire("normal", 2) == 2  # a's jobs, about to be refused
    lending.held("a", "outside-window", 5.0)
    assert not queued.done()  # a has nothing free to lend yet
    slots["a"].release("normal")  # the refused job goes back: its slot is lent at once
    await settle()
    assert queued.done() and queued.result() == 1
    assert totals(slots) == {"a": 1, "b": 3}
    assert slots["b"].in_use == {"high": 1, "normal": 2, "bulk": 0}


async def test_after_the_hold_nobody_borrows_and_each_loan_returns_as_its_job_ends() -> None:
    clock = Clock()
    lending, slots = lending_for(TWO, clock)
    slots["b"].try_acquire("normal", 10)
    lending.held("a", "quarantined", 5.0)
    lending.top_up("b", 10)
    assert slots["b"].try_acquire("normal", 10) == 2  # b runs 4, two of them borrowed

    clock.now += 5.0  # a's hold is over
    assert not lending.refresh("a")
    a_waits = asyncio.create_task(slots["a"].acquire("normal", 2))
    b_waits = asyncio.create_task(slots["b"].acquire("normal", 1))  # b still has a backlog
    await settle()
    assert lending.top_up("b", 10) == 0  # a lends no more
    slots["b"].release("normal")  # a borrowed job ends: the slot is a's, though b waits
    await settle()
    assert a_waits.done() and a_waits.result() == 1
    assert not b_waits.done()
    assert totals(slots) == {"a": 1, "b": 3}
    slots["b"].release("normal")
    await settle()
    assert totals(slots) == {"a": 2, "b": 2}  # a has its whole share back
    assert not b_waits.done()  # b's own two are still running
    assert lending.lent.get(worker="w-1", lane="a") is None
    slots["b"].release("normal")
    await settle()
    assert b_waits.done()  # b's own slot, for b
    assert totals(slots) == {"a": 2, "b": 2}


@pytest.mark.parametrize("reason", ["rate-limited", "target-held", "caps-unavailable"])
def test_a_hold_for_a_rate_permit_or_an_unreachable_service_lends_nothing(reason: str) -> None:
    lending, slots = lending_for(TWO, Clock())
    slots["b"].try_acquire("normal", 10)
    lending.held("a", reason, 5.0)
    assert not lending.refresh("a")
    assert lending.top_up("b", 10) == 0


def test_an_idle_lane_lends_nothing() -> None:
    lending, slots = lending_for(TWO, Clock())
    slots["b"].try_acquire("normal", 10)  # a has no work at all: it is not held
    assert lending.top_up("b", 10) == 0
    assert totals(slots) == {"a": 2, "b": 2}


def test_a_partition_lends_only_while_every_member_is_held() -> None:
    lanes = lanes_of(("P0", ("m1", "m2"), 8), ("b", ("b",), 8))
    clock = Clock()
    lending, slots = lending_for(lanes, clock)
    slots["b"].try_acquire("normal", 10)
    lending.held("m1", "quarantined", 10.0)
    assert lending.top_up("b", 10) == 0  # m2 may still have work
    lending.held("m2", "paused", 3.0)
    assert lending.top_up("b", 10) == 2
    clock.now += 3.0  # m2's pause ends: the partition stops lending
    assert not lending.refresh("P0")


def test_a_lane_borrows_no_more_than_its_consumers_window() -> None:
    lanes = lanes_of(("a", ("a",), 8), ("b", ("b",), 3))  # b's max_ack_pending is 3
    lending, slots = lending_for(lanes, Clock())
    slots["b"].try_acquire("normal", 10)
    lending.held("a", "quarantined", 5.0)
    assert lending.top_up("b", 10) == 1
    assert totals(slots) == {"a": 1, "b": 3}


def test_a_lane_that_may_not_borrow_gets_nothing() -> None:
    lending, slots = lending_for(TWO, Clock(), may_borrow=False)  # rate-bound, say
    slots["b"].try_acquire("normal", 10)
    lending.held("a", "quarantined", 5.0)
    assert lending.top_up("b", 10) == 0


def test_the_lanes_together_never_hold_more_than_the_workers_capacity() -> None:
    rng = random.Random(10)
    lanes = lanes_of(*((name, (name,), 6) for name in ("a", "b", "c", "d")))
    clock = Clock()
    lending, slots = lending_for(lanes, clock)
    capacity = SHARE * len(lanes)
    for _ in range(5000):
        name = rng.choice(list(slots))
        lane_slots = slots[name]
        op = rng.random()
        if op < 0.35:
            lending.top_up(name, rng.randint(1, 4))
            lane_slots.try_acquire(rng.choice(TIERS), rng.randint(1, 4))
        elif op < 0.7:
            busy = [t for t, n in lane_slots.in_use.items() if n]
            if busy:
                lane_slots.release(rng.choice(busy))
        elif op < 0.8:
            lending.held(name, rng.choice(["quarantined", "paused", "rate-limited"]), 3.0)
        elif op < 0.95:
            lending.refresh(name)
        else:
            clock.now += 1.0
        assert sum(s.total for s in slots.values()) == capacity
        assert sum(sum(s.in_use.values()) for s in slots.values()) <= capacity
        for s in slots.values():
            assert 0 <= sum(s.in_use.values()) <= s.total
        assert sum(lending.borrowed_by(n) for n in slots) == sum(lending.lent_by(n) for n in slots)


def test_a_lane_logs_once_when_it_starts_lending_and_once_when_it_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    lending, _ = lending_for(TWO, clock)
    with caplog.at_level(logging.INFO, logger="jetfleet.worker.slot_lending"):
        for _ in range(3):
            lending.held("a", "quarantined", 5.0)
            lending.refresh("a")
        clock.now += 6.0
        for _ in range(3):
            lending.refresh("a")
    assert [r.getMessage() for r in caplog.records] == [
        "worker w-1: lane a lends its 2 slots to lanes with a backlog while it is held "
        "(quarantined)",
        "worker w-1: lane a no longer held: it stops lending, its 0 slots out come back "
        "as their jobs end",
    ]


async def test_a_lender_whose_hold_ended_gets_its_slot_back_though_its_loops_never_looked() -> None:
    clock = Clock()
    slots = pools(TWO)
    rate_bound: set[str] = set()
    lending = SlotLending("w-1", TWO, slots, lambda lane: lane.name not in rate_bound, clock)
    slots["b"].try_acquire("normal", 10)
    lending.held("a", "quarantined", 5.0)
    lending.top_up("b", 10)
    slots["b"].try_acquire("normal", 10)
    a_waits = asyncio.create_task(slots["a"].acquire("normal", 1))  # a's loop, queued
    b_waits = asyncio.create_task(slots["b"].acquire("normal", 1))
    await settle()
    rate_bound.add("b")  # b borrows no more, so it asks nothing of the lenders
    clock.now += 5.0  # the hold is over, and nobody has called refresh("a")
    slots["b"].release("normal")
    await settle()
    assert a_waits.done() and not b_waits.done()


# --- standby lanes: pulled only with lent slots --------------------------------------------


def fleet_of(*names: str, dedicated: int) -> LaneMap:
    targets = {name: target(f"https://{name}.example/") for name in names}
    settings = make_settings("nats://127.0.0.1:1", "redis://127.0.0.1:1", targets)
    fleet = msgspec.structs.replace(settings.fleet, dedicated_targets=dedicated)
    return LaneMap(msgspec.structs.replace(settings, fleet=fleet))


def test_standby_lanes_are_the_lanes_of_standby_targets_the_worker_does_not_serve() -> None:
    lanes = fleet_of("a", "b", "c", dedicated=3)
    serving = lanes.lanes_for(["a"])
    assert [lane.name for lane in standby_lanes(lanes, serving, ["c", "b"], every=False)] == [
        "b",
        "c",
    ]


def test_a_standby_target_the_worker_serves_anyway_is_refused_with_the_fix() -> None:
    lanes = fleet_of("a", "b", dedicated=2)
    with pytest.raises(ConfigError, match=r"worker\.standby_targets: a is served with"):
        standby_lanes(lanes, lanes.lanes_for(["a"]), ["a"], every=False)
    with pytest.raises(ConfigError, match="serves every target"):
        standby_lanes(lanes, lanes.lanes_for(["a", "b"]), ["b"], every=True)
    shared = fleet_of("h", "q", dedicated=0)
    assert shared.lane_of("h") == shared.lane_of("q")  # crc32: both in partition 7 of 16
    with pytest.raises(ConfigError, match="q is in partition P7, which it serves"):
        standby_lanes(shared, shared.lanes_for(["h"]), ["q"], every=False)


async def test_a_standby_lane_runs_only_lent_slots_after_the_workers_own_lanes() -> None:
    lanes = lanes_of(("a", ("a",), 8), ("b", ("b",), 8), ("c", ("c",), 8))
    slots = {
        "a": TierSlots(SHARE, SHARES, TIERS),
        "b": TierSlots(SHARE, SHARES, TIERS),
        "c": TierSlots(0, SHARES, TIERS),  # standby: no slot of its own
    }
    lending = SlotLending("w-1", lanes, slots, clock=Clock())
    assert slots["c"].try_acquire("normal", 1) == 0
    slots["b"].try_acquire("normal", 10)
    assert slots["a"].try_acquire("normal", 2) == 2  # a's jobs, about to be refused
    standby = asyncio.create_task(slots["c"].acquire("normal", 1))  # queued first
    await settle()
    own = asyncio.create_task(slots["b"].acquire("normal", 1))
    await settle()
    lending.held("a", "quarantined", 5.0)
    slots["a"].release("normal")
    await settle()
    assert own.done() and not standby.done()  # the worker's own lane first
    slots["a"].release("normal")
    await settle()
    assert standby.done()
    assert totals(slots) == {"a": 0, "b": 3, "c": 1}
    assert lending.borrowed.get(worker="w-1", lane="c") == 1
