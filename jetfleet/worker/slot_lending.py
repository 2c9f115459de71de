"""Slots lent by a worker's held lanes to its lanes with a backlog (rebalancing).

Each work lane owns ``worker.concurrency`` slots (its share), so a lane whose target hangs
fills only its own. Together the shares are the worker's capacity. A lane whose every
target refused this worker for a reason about the target as a whole (quarantined or
cooling, paused, outside its window, circuit open, version not approved) cannot use its
share until the hold ends, so it lends it: a lane that wants more slots than it has (all
its own busy, work still coming) may run its share plus what held lanes lend, up to its
consumers' window (``WorkLane.max_in_flight``: the server would deliver no more).

A loan is capacity, not a job: the borrower gives a slot back as soon as it has one it
does not use, and at once to a lender whose hold has ended. Nobody borrows from a lane
that is no longer held, so it gets its share back as the borrowed jobs end. The slots of
every lane together never exceed the worker's capacity, and each job still takes its
lease (the target's in-flight cap), its rate permits and its consumer's window as before.

What does not lend: a lane that is merely idle (work may come any moment), one that is
slow or hanging (its slots are busy: isolation keeps its harm to its own share), one
waiting for a rate permit (``rate-limited``, ``target-held``: a permit frees within
1 / rate) or for a service it cannot reach (``caps-unavailable``,
``ratelimit-unavailable``: every lane suffers alike). A rate-bound lane does not borrow
(more slots would only fetch jobs to hand back).

A standby lane (``worker.standby_targets``) has no slots of its own: it runs only what
held lanes lend, after the worker's own lanes queued for a slot.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from jetfleet.errors import ConfigError
from jetfleet.metrics import GaugeFamily, MetricFamily
from jetfleet.work_lanes import LaneMap, WorkLane
from jetfleet.worker.tier_slots import TierSlots

log = logging.getLogger(__name__)

KEEPS_SLOTS = frozenset(
    {
        "rate-limited",
        "target-held",
        "caps-unavailable",
        "ratelimit-unavailable",
        # A 2 s hold while another worker of the subnet serves the target: lent slots
        # would come back only as the borrowed jobs end, long after.
        "subnet-busy",
    }
)
"""Target-wide refusals whose hold lends nothing (short, or not about the target)."""


def standby_lanes(
    lane_map: LaneMap, serving: Sequence[WorkLane], standby: Iterable[str], every: bool
) -> tuple[WorkLane, ...]:
    """The lanes of the ``standby`` targets of a worker serving the lanes ``serving``
    (``every``: it was given no targets, so it serves them all).

    Raises:
        ConfigError: a standby target the worker would serve with its own slots anyway.
    """
    standby = tuple(standby)
    if standby and every:
        raise ConfigError(
            "config: worker.standby_targets is set, but this worker serves every target "
            "(worker.targets and --targets are empty): name the targets it serves, or "
            "leave worker.standby_targets empty"
        )
    own = {lane.name for lane in serving}
    for target in standby:
        lane = lane_map.lane_of(target)
        if lane.name in own:
            where = f"in partition {lane.name}, which it serves" if lane.shared else "served"
            raise ConfigError(
                f"config: worker.standby_targets: {target} is {where} with this worker's own "
                "slots: leave it out of worker.standby_targets or out of the targets it serves"
            )
    return tuple(lane for lane in lane_map.lanes_for(standby) if lane.name not in own)


class SlotLending:
    """The loans between one worker's lanes, applied to each lane's ``TierSlots``; each
    lane's share is the slots it starts with (0 for a standby lane)."""

    def __init__(
        self,
        worker_id: str,
        lanes: Sequence[WorkLane],
        slots: Mapping[str, TierSlots],
        may_borrow: Callable[[WorkLane], bool] = lambda lane: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self._shares = {name: lane_slots.total for name, lane_slots in slots.items()}
        # Lanes queued for a slot are lent to in this order: own lanes before standby ones.
        self._offer_order = sorted(slots, key=lambda name: self._shares[name] == 0)
        self._lanes = {lane.name: lane for lane in lanes}
        self._lane_of = {t: lane.name for lane in lanes for t in lane.targets}
        self._slots = slots
        self._may_borrow = may_borrow
        self._clock = clock
        self._held_until: dict[str, float] = {}
        self._reason: dict[str, str] = {}
        self._lending: set[str] = set()
        self._loans: Counter[tuple[str, str]] = Counter()  # (lender, borrower) -> slots
        self.lent = GaugeFamily(
            "jetfleet_worker_slots_lent",
            "Slots a held lane of this worker has lent to its lanes with a backlog (still "
            "out), by worker and lane",
        )
        self.borrowed = GaugeFamily(
            "jetfleet_worker_slots_borrowed",
            "Slots a lane of this worker runs beyond its worker.concurrency, lent by held "
            "lanes, by worker and lane",
        )
        self.metrics: tuple[MetricFamily, ...] = (self.lent, self.borrowed)
        for name, lane_slots in slots.items():
            lane_slots.on_release = functools.partial(self._released, name)

    def held(self, target: str, reason: str, seconds: float) -> None:
        """This worker must leave ``target`` alone for ``seconds`` (a target-wide lease
        refusal, ``reason``): its lane lends once every one of its targets is so held."""
        if reason in KEEPS_SLOTS or target not in self._lane_of:
            return
        until = self._clock() + seconds
        self._held_until[target] = max(self._held_until.get(target, 0.0), until)
        self._reason[target] = reason
        self.refresh(self._lane_of[target])

    def refresh(self, lane: str) -> bool:
        """Whether ``lane`` lends now; logs when it starts or stops (its hold ended)."""
        if not self._held_until:
            return False  # (asked by every pull loop at every turn)
        now = self._clock()
        targets = self._lanes[lane].targets
        lends = self._shares[lane] > 0 and all(self._held_until.get(t, 0.0) > now for t in targets)
        if lends and lane not in self._lending:
            self._lending.add(lane)
            reasons = sorted({self._reason[t] for t in targets})
            log.info(
                "worker %s: lane %s lends its %d slots to lanes with a backlog while it "
                "is held (%s)",
                self.worker_id,
                lane,
                self._shares[lane],
                ", ".join(reasons),
            )
            self._offer()
        elif not lends and lane in self._lending:
            self._lending.discard(lane)
            log.info(
                "worker %s: lane %s no longer held: it stops lending, its %d slots out "
                "come back as their jobs end",
                self.worker_id,
                lane,
                self.lent_by(lane),
            )
            for borrower in self._borrowers_of(lane):
                self._give_back(borrower)
        return lends

    def top_up(self, lane: str, want: int) -> int:
        """Borrow up to ``want`` slots for ``lane`` when all its own are busy (it has
        work to fetch); how many it got."""
        slots = self._slots[lane]
        if not self._lending or not slots.contended() or lane in self._lending:
            return 0
        if not self._may_borrow(self._lanes[lane]):
            return 0
        return self._borrow(lane, want)

    def lent_by(self, lane: str) -> int:
        """Slots of ``lane`` other lanes hold now."""
        return sum(n for (lender, _), n in self._loans.items() if lender == lane)

    def borrowed_by(self, lane: str) -> int:
        """Slots ``lane`` holds beyond its share."""
        return sum(n for (_, borrower), n in self._loans.items() if borrower == lane)

    def _borrow(self, lane: str, want: int) -> int:
        share = self._shares[lane]
        room = max(share, self._lanes[lane].max_in_flight) - self._slots[lane].total
        want = min(want, room)
        got = 0
        for lender in sorted(self._lending):
            if got >= want:
                break
            if not self.refresh(lender):
                continue
            n = min(want - got, max(0, self._slots[lender].free()))
            if n > 0:
                self._move(lender, lane, n)
                got += n
        return got

    def _offer(self) -> None:
        """Lend held lanes' free slots to lanes queued for one (one slot per waiter: a
        lane that wants more borrows it when it fetches, ``top_up``)."""
        if not self._lending:
            return
        for name in self._offer_order:
            waiting = self._slots[name].waiting()
            if waiting and name not in self._lending and self._may_borrow(self._lanes[name]):
                self._borrow(name, waiting)

    def _released(self, lane: str) -> None:
        """A job of ``lane`` ended (or a slot went unused): return what it no longer
        needs, then lend what held lanes have free. A lender whose hold has ended is
        found here too: its pull loops may all be queued for its slots, not looking."""
        for lender in sorted(self._lending):
            self.refresh(lender)
        if self._loans:
            self._give_back(lane)
        self._offer()

    def _give_back(self, borrower: str) -> None:
        """Return the borrower's unused loans: any, to a lender no longer held; to a
        held one only what no queued job of the borrower's would take."""
        slots = self._slots[borrower]
        free = max(0, slots.free())
        spare = max(0, free - slots.waiting())
        for lender in sorted(self._lenders_of(borrower), key=lambda x: x in self._lending):
            unused = spare if lender in self._lending else free
            n = min(unused, self._loans[(lender, borrower)])
            if n > 0:
                self._move(lender, borrower, -n)
                free -= n
                spare = max(0, spare - n)

    def _move(self, lender: str, borrower: str, n: int) -> None:
        """Lend ``n`` slots (return them when negative) and resize both lanes."""
        self._loans[(lender, borrower)] += n
        if self._loans[(lender, borrower)] <= 0:
            del self._loans[(lender, borrower)]
        self._slots[lender].resize(self._slots[lender].total - n)
        self._slots[borrower].resize(self._slots[borrower].total + n)
        for gauge, lane, value in (
            (self.lent, lender, self.lent_by(lender)),
            (self.borrowed, borrower, self.borrowed_by(borrower)),
        ):
            if value:
                gauge.set(value, worker=self.worker_id, lane=lane)
            else:
                gauge.remove(worker=self.worker_id, lane=lane)

    def _lenders_of(self, borrower: str) -> list[str]:
        return [lender for (lender, b) in self._loans if b == borrower]

    def _borrowers_of(self, lender: str) -> list[str]:
        return [b for (le, b) in self._loans if le == lender]
