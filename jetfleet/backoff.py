"""Growing, jittered waits between asks to a service that is busy, silent or absent."""

from __future__ import annotations

import random

FIRST_WAIT_S = 0.25
MAX_WAIT_S = 5.0
MAX_FLOOR_S = 60.0
"""The longest a service's own retry-after is honoured: a wrong one cannot park a job."""
_SHARED_RNG = random.Random()
"""The jitter of every Backoff not given its own: seeding a Random reads os.urandom,
and a worker makes several Backoffs per job (8 % of its CPU under load when each
seeded its own)."""


class Backoff:
    """The waits before asking again: doubling from ``first_s`` up to ``max_s``, each
    jittered to 50-100 % so callers refused together do not come back together."""

    def __init__(
        self,
        first_s: float = FIRST_WAIT_S,
        max_s: float = MAX_WAIT_S,
        rng: random.Random | None = None,
    ) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.asks = 0
        self._rng = rng or _SHARED_RNG

    def next_s(self, floor_s: float = 0.0) -> float:
        """The wait before the next ask; never shorter than the service asked (``floor_s``,
        its retry-after, up to MAX_FLOOR_S)."""
        grown = min(self.max_s, self.first_s * 2.0 ** min(self.asks, 30))
        self.asks += 1
        return max(grown * self._rng.uniform(0.5, 1.0), min(floor_s, MAX_FLOOR_S))
