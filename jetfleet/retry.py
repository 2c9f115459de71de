"""The one retry policy: bounded exponential backoff with jitter, Retry-After honoured."""

from __future__ import annotations

import random
from dataclasses import dataclass

from jetfleet.settings import FleetSettings


@dataclass(frozen=True)
class RetryPolicy:
    """How long to wait before attempt ``n + 1`` after attempt ``n`` failed."""

    base_s: float
    max_backoff_s: float

    @classmethod
    def from_settings(cls, fleet: FleetSettings) -> RetryPolicy:
        """The fleet's policy."""
        return cls(base_s=fleet.retry_base_s, max_backoff_s=fleet.retry_max_backoff_s)

    def delay_s(
        self, attempt: int, hint_s: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Backoff after the ``attempt``-th failure (1-based).

        Full exponential growth capped at ``max_backoff_s``, with jitter in [50 %, 100 %]
        so a retry storm spreads out. A target's Retry-After (``hint_s``) is a floor: we
        never come back sooner than the target asked.
        """
        exp: float = min(self.max_backoff_s, self.base_s * 2.0 ** max(0, attempt - 1))
        jittered = exp * (0.5 + 0.5 * (rng or random).random())
        return max(jittered, hint_s or 0.0)
