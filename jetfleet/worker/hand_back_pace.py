"""How long a delivery that spent no attempt stays away when it is handed back.

Every nak is a delivery, and a work consumer's ``max_deliver`` ends a job after that
many (the backstop, docs/dead-letters.md). A job refused again and again without running
(its target blocked us, is held here, is at its partition cap, is quarantined) must
not reach the backstop while it could still run, so its hand-backs are paced against
the deliveries it has:

- ``spare = max_deliver - 4 x max_attempts`` deliveries are the job's beyond what its
  attempts may use (settings.DELIVERIES_PER_ATTEMPT);
- the longest wait, ``cap``, is the least for which the waits below add up to the job's
  max age within three quarters of its spare deliveries (at least MIN_CAP_S);
- a hand-back waits FIRST_S doubled with each delivery up to ``cap``, and ``cap`` from
  half that span on (never less: the jitter only adds), so a passing refusal costs
  little and a lasting one settles at one ask per ``cap``;
- a job waiting for a place on a partitioned target (``target-busy``) waits the same
  TARGET_BUSY_S for every delivery, old or fresh, so old jobs get their fair share of
  freed places, for its first quarter of spare deliveries; past that, ``cap``.

So a job refused for ever reaches its max age (and ends ``expired``) before the backstop.
"""

from __future__ import annotations

import math
import random

from jetfleet.settings import DELIVERIES_PER_ATTEMPT, Settings

FIRST_S = 0.25
MIN_CAP_S = 2.0
"""The smallest cap, whatever the settings allow."""
TARGET_BUSY_S = 1.5
"""A ``target-busy`` hand-back's wait (jittered 2/3-4/3), the same for every delivery."""


class HandBackPace:
    """The waits of unrun hand-backs for one worker's settings."""

    def __init__(self, settings: Settings, rng: random.Random | None = None) -> None:
        self.settings = settings
        self._rng = rng or random.Random()
        self._caps: dict[str, float] = {}

    def spare(self, target: str) -> int:
        """Deliveries the job has beyond those its attempts may use."""
        attempts = self.settings.targets[target].max_attempts
        return max(1, self.settings.fleet.max_deliver - DELIVERIES_PER_ATTEMPT * attempts)

    def cap_s(self, target: str) -> float:
        """The longest wait (see the module's docstring)."""
        cap = self._caps.get(target)
        if cap is None:
            span = self._paced_span(target)
            max_age = self.settings.max_age_s(target)
            cap = max(MIN_CAP_S, max_age / span)
            while _waits_total(cap, span) < max_age:
                cap *= 1.25
            self._caps[target] = cap
        return cap

    def _paced_span(self, target: str) -> int:
        """Deliveries the growing waits must cover the max age in: 3/4 of the spare."""
        return max(1, self.spare(target) * 3 // 4)

    def growing_s(self, target: str, delivered: int, first_s: float = FIRST_S) -> float:
        """``first_s`` doubled per delivery up to the cap (the cap from half the paced
        span on), jittered upwards (0-25 %)."""
        cap = self.cap_s(target)
        if delivered > self._paced_span(target) // 2:
            return cap * self._rng.uniform(1.0, 1.25)
        doublings = min(max(0, delivered - 1), math.ceil(math.log2(cap / first_s)) + 1)
        return min(cap, first_s * 2.0**doublings) * self._rng.uniform(1.0, 1.25)

    def target_busy_s(self, target: str, delivered: int) -> float:
        """The wait of a job refused ``target-busy``: the same for old and fresh
        deliveries while the job has deliveries to spare, then the cap."""
        if delivered <= self.spare(target) - self._paced_span(target):
            return TARGET_BUSY_S * self._rng.uniform(2 / 3, 4 / 3)
        return self.cap_s(target) * self._rng.uniform(1.0, 1.25)


def _waits_total(cap: float, deliveries: int) -> float:
    """The least the growing waits of ``deliveries`` hand-backs add up to (it grows
    without bound with ``cap``, so a cap covering any max age is found)."""
    ramp = min(deliveries // 2, max(0, math.ceil(math.log2(cap / FIRST_S))))
    return FIRST_S * (2.0**ramp - 1) + (deliveries - ramp) * cap
