"""The showcase's script: the job mix fits ``--jobs`` and every kind is present; the
clock skew is real where libfaketime is installed (the dev extra)."""

from __future__ import annotations

import pytest

from jetfleet.dev import demo_cast
from jetfleet.dev.clock_skew import clock_skew, measured_offset_s


@pytest.mark.parametrize("total", [demo_cast.least_jobs(), 20, 200, 300, 1000])
def test_the_mix_holds_exactly_the_jobs_asked_for_with_every_kind(total: int) -> None:
    counts = demo_cast.counts(total)
    assert sum(n for _, n in counts) == total
    assert all(n >= 1 for _, n in counts)
    assert {k.name for k, _ in counts} == {k.name for k in demo_cast.MIX} | {"page"}
    streak = dict((k.name, n) for k, n in counts)["challenge-streak"]
    assert streak == demo_cast.STREAK
    ids = [j.id for jobs in demo_cast.by_target(total).values() for j in jobs]
    assert len(ids) == len(set(ids)) == total


def test_too_few_jobs_for_the_mix_are_refused_with_the_least_that_fits() -> None:
    with pytest.raises(ValueError, match=f"at least {demo_cast.least_jobs()}"):
        demo_cast.counts(demo_cast.least_jobs() - 1)


def test_the_skewed_clock_is_an_hour_ahead_for_a_child_process() -> None:
    skew = clock_skew(demo_cast.SKEW)
    assert skew.applied, skew.via  # the dev extra installs libfaketime
    offset = measured_offset_s(skew)
    assert offset is not None and abs(offset - demo_cast.SKEW_S) < 60
