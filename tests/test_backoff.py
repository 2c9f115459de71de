"""The waits between asks to a busy or silent service (jetfleet/backoff.py): growing,
jittered, capped, and never shorter than the service asked. Pure, no servers."""

from __future__ import annotations

import random

from jetfleet.backoff import FIRST_WAIT_S, MAX_FLOOR_S, MAX_WAIT_S, Backoff


def test_waits_double_from_the_first_up_to_the_cap_each_jittered_to_half_or_more() -> None:
    for seed in range(20):
        backoff = Backoff(rng=random.Random(seed))
        for ask in range(12):
            full = min(MAX_WAIT_S, FIRST_WAIT_S * 2**ask)
            assert full / 2 <= backoff.next_s() <= full
    waits = {round(Backoff(rng=random.Random(s)).next_s(), 6) for s in range(20)}
    assert len(waits) > 10, "callers refused together must not come back together"


def test_a_services_retry_after_is_a_floor_but_cannot_park_the_caller() -> None:
    backoff = Backoff(rng=random.Random(1))
    assert backoff.next_s(floor_s=3.0) >= 3.0
    assert backoff.next_s(floor_s=1e9) == MAX_FLOOR_S
