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


@pytest.mark.parametrize("total", [demo_cast.least_jobs(demo_cast.mix(browser=True)), 300])
def test_the_browser_mix_adds_item_pages_and_removed_prices_on_distinct_pages(total: int) -> None:
    counts = dict((k.name, n) for k, n in demo_cast.counts(total, demo_cast.mix(browser=True)))
    assert sum(counts.values()) == total
    assert counts["browser-item"] == demo_cast.BROWSER_ITEMS
    assert counts["browser-removed"] == demo_cast.BROWSER_REMOVED
    items = demo_cast.by_target(total, browser=True)[demo_cast.ITEMS]
    assert all(j.handler == "browser.page" and j.page is not None for j in items)
    # A removed page's visit must not count as a second effect of a committed item.
    paths = [j.url.split("?")[0] for j in items]
    assert len(paths) == len(set(paths))
    assert demo_cast.ITEMS not in demo_cast.by_target(total, browser=False)


def test_too_few_jobs_for_the_mix_are_refused_with_the_least_that_fits() -> None:
    with pytest.raises(ValueError, match=f"at least {demo_cast.least_jobs()}"):
        demo_cast.counts(demo_cast.least_jobs() - 1)


def test_the_skewed_clock_is_an_hour_ahead_for_a_child_process() -> None:
    skew = clock_skew(demo_cast.SKEW)
    assert skew.applied, skew.via  # the dev extra installs libfaketime
    offset = measured_offset_s(skew)
    assert offset is not None and abs(offset - demo_cast.SKEW_S) < 60
