"""A worker's job slots, shared by priority tiers with reserved capacity.

Each tier has a guaranteed share of the slots and may borrow idle ones. A slot that
frees goes to a waiting tier that is below its share first (highest priority first),
then to the highest-priority waiter. So bulk never starves (its share is its own), and
high priority waits at most for one running job to finish when bulk has borrowed
every slot.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence


def reserved_slots(total: int, shares: Mapping[str, float], tiers: Sequence[str]) -> dict[str, int]:
    """Each tier's guaranteed slots: its share of ``total``, at least 1 while slots last."""
    weight = sum(shares.get(t, 0.0) for t in tiers) or 1.0
    reserved = {t: max(1, math.floor(total * shares.get(t, 0.0) / weight)) for t in tiers}
    # The minimum of one each can overshoot: trim the largest reservation first (the
    # lowest tier among equals), so every tier keeps one slot while slots last.
    while sum(reserved.values()) > total:
        largest = max(reserved.values())
        victim = next(t for t in reversed(tiers) if reserved[t] == largest)
        reserved[victim] -= 1
    return reserved


class TierSlots:
    """Counting slots per tier, with a priority hand-out to waiters."""

    def __init__(self, total: int, shares: Mapping[str, float], tiers: Sequence[str]) -> None:
        self.total = total
        self.tiers = tuple(tiers)
        self._shares = dict(shares)
        self.reserved = reserved_slots(total, shares, self.tiers)
        self.in_use = dict.fromkeys(self.tiers, 0)
        self._waiters: list[tuple[str, asyncio.Future[None]]] = []
        self.on_release: Callable[[], None] | None = None
        """Called after slots are given back, before they go to waiters (a lane that
        borrowed slots returns the ones it no longer uses: slot_lending.py)."""

    def free(self) -> int:
        """Slots nobody holds."""
        return self.total - sum(self.in_use.values())

    def waiting(self) -> int:
        """How many are queued for a slot."""
        return len(self._waiters)

    def resize(self, total: int) -> None:
        """Count ``total`` slots from now on (slots lent or borrowed between lanes). New
        slots go to waiters at once; fewer takes nothing from running jobs: no slot is
        handed out until enough of them have ended."""
        self.total = total
        self.reserved = reserved_slots(max(0, total), self._shares, self.tiers)
        self._hand_out()

    def contended(self) -> bool:
        """No slot is free, or someone is already queued for one."""
        return self.free() <= 0 or bool(self._waiters)

    def try_acquire(self, tier: str, want: int) -> int:
        """Take up to ``want`` free slots now, unless someone is already waiting (then 0:
        waiters are served first, in priority order)."""
        if self._waiters or self.free() <= 0:
            return 0
        taken = min(want, self.free())
        self.in_use[tier] += taken
        return taken

    async def acquire(self, tier: str, want: int = 1) -> int:
        """Wait for at least one slot for ``tier``; take up to ``want`` if free now."""
        if not (self.free() > 0 and not self._waiters):
            future = asyncio.get_running_loop().create_future()
            self._waiters.append((tier, future))
            try:
                await future  # resolved with one slot already counted for us
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self.release(tier)
                else:
                    self._waiters = [w for w in self._waiters if w[1] is not future]
                raise
            # (The pool may have shrunk since the slot was handed to us: resize.)
            extra = 0 if self._waiters else max(0, min(want - 1, self.free()))
            self.in_use[tier] += extra
            return 1 + extra
        taken = min(want, self.free())
        self.in_use[tier] += taken
        return taken

    def release(self, tier: str, n: int = 1) -> None:
        """Give ``n`` slots of ``tier`` back and hand them to waiters."""
        if n <= 0:
            return
        self.in_use[tier] -= n
        if self.on_release is not None:
            self.on_release()
        self._hand_out()

    def _hand_out(self) -> None:
        while self.free() > 0 and self._waiters:
            index = min(range(len(self._waiters)), key=self._rank)
            tier, future = self._waiters.pop(index)
            if future.done():
                continue
            self.in_use[tier] += 1
            future.set_result(None)

    def _rank(self, index: int) -> tuple[bool, int, int]:
        tier = self._waiters[index][0]
        below_share = self.in_use[tier] < self.reserved[tier]
        return (not below_share, self.tiers.index(tier), index)
