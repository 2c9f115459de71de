"""The circuit breaker's count: K distinct identities refused on one target within the
window open it, K-1 do not, nor K spread over more than the window; by the events' own
(server) times."""

from __future__ import annotations

from pathlib import Path

import pytest
from jetfleet.services.quarantine.breaker_windows import BreakerWindows

from jetfleet.errors import ConfigError
from jetfleet.settings import (
    BreakerSettings,
    QuarantineSettings,
    Settings,
    load_settings,
    validate,
)
from tests.test_quarantine_rules import Events

BREAKER = BreakerSettings(identities=3, window_s=600.0, cool_s=900.0)


def test_k_minus_1_identities_open_nothing_and_the_kth_opens() -> None:
    windows, event = BreakerWindows(BREAKER), Events()
    assert windows.observe(event(0, identity="id-a")) is None
    assert windows.observe(event(100, identity="id-b", reason="blocked")) is None
    opening = windows.observe(event(200, identity="id-c"))
    assert opening is not None
    assert opening.target == "shop"
    assert opening.identities == ("id-a", "id-b", "id-c")
    assert [s.seq for s in opening.evidence] == [1, 2, 3]
    # The window starts empty: the next refusals start a new count.
    assert windows.observe(event(300, identity="id-d")) is None


def test_the_same_identity_refused_again_counts_once() -> None:
    windows, event = BreakerWindows(BREAKER), Events()
    for n in range(5):
        assert windows.observe(event(n, identity="id-a")) is None
    assert windows.observe(event(10, identity="id-b")) is None
    opening = windows.observe(event(20, identity="id-c"))
    assert opening is not None
    assert opening.identities == ("id-a", "id-b", "id-c")
    assert len(opening.evidence) == 7


def test_k_identities_spread_over_more_than_the_window_open_nothing() -> None:
    windows, event = BreakerWindows(BREAKER), Events()
    assert windows.observe(event(0, identity="id-a")) is None
    assert windows.observe(event(300, identity="id-b")) is None
    # Exactly window_s after the first: the first is outside (t - window_s, t].
    assert windows.observe(event(600, identity="id-c")) is None
    # Just inside: id-b (300) and id-c (600) are in the window with id-d.
    assert windows.observe(event(899.999, identity="id-d")) is not None


def test_the_window_ends_at_the_newest_time_seen() -> None:
    windows, event = BreakerWindows(BREAKER), Events()
    assert windows.observe(event(1000, identity="id-a")) is None
    # A new stream leader stamps a little earlier: still in the window ending at 1000.
    assert windows.observe(event(999, identity="id-b")) is None
    assert windows.observe(event(1001, identity="id-c")) is not None


def test_only_refusals_it_counts_on_the_same_target_count() -> None:
    windows, event = BreakerWindows(BREAKER), Events()
    assert windows.observe(event(0, identity="id-a")) is None
    assert windows.observe(event(1, identity="id-b", kind="ok", reason="")) is None
    assert windows.observe(event(2, identity="id-b", reason="rate-limited")) is None
    assert windows.observe(event(3, identity="id-b", target="news")) is None
    assert windows.observe(event(4, identity="id-c")) is None
    assert windows.observe(event(5, identity="id-d")) is not None


def test_outcomes_without_an_identity_count_by_worker() -> None:
    windows, event = BreakerWindows(BREAKER), Events()
    assert windows.observe(event(0, identity="", worker="w-0")) is None
    assert windows.observe(event(1, identity="", worker="w-0")) is None
    assert windows.observe(event(2, identity="", worker="w-1")) is None
    opening = windows.observe(event(3, identity="id-a", worker="w-1"))
    assert opening is not None
    assert opening.identities == ("worker:w-0", "worker:w-1", "id-a")


def test_a_redelivered_event_counts_once_and_a_disabled_breaker_counts_nothing() -> None:
    windows, event = BreakerWindows(BREAKER), Events()
    first = event(0, identity="id-a")
    assert windows.observe(first) is None
    assert windows.observe(event(1, identity="id-b")) is None
    assert windows.observe(first) is None
    off, again = BreakerWindows(BreakerSettings(enabled=False)), Events()
    assert all(off.observe(again(n, identity=f"id-{n}")) is None for n in range(5))


def test_restore_puts_back_only_the_events_newer_than_the_marker() -> None:
    windows, event = BreakerWindows(BreakerSettings(identities=2)), Events()
    windows.observe(event(0, identity="id-a"))
    opening = windows.observe(event(1, identity="id-b"))
    assert opening is not None
    windows.restore(opening, after_seq=1)  # id-a's event opened it before; id-b's did not
    assert windows.observe(event(2, identity="id-b")) is None
    assert windows.observe(event(3, identity="id-c")) is not None


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"identities": 0}, "quarantine.breaker.identities"),
        ({"window_s": 0.0}, "quarantine.breaker.window_s"),
        ({"cool_s": 0.5}, "quarantine.breaker.cool_s"),
        ({"cool_s": 600.0, "max_cool_s": 300.0}, "quarantine.breaker.max_cool_s"),
        ({"on": "ok"}, "quarantine.breaker.on"),
        ({"on": ()}, "quarantine.breaker.on"),
    ],
)
def test_bad_breaker_settings_name_the_key_and_the_fix(fields: dict[str, object], key: str) -> None:
    bad = Settings(quarantine=QuarantineSettings(breaker=BreakerSettings(**fields)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=rf"{key} is invalid: set it to"):
        validate(bad)


def test_the_breaker_is_read_from_its_toml_table_and_bad_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "jetfleet.toml"
    path.write_text(
        '[quarantine.breaker]\nidentities = 4\nwindow_s = 120\ncool_s = 60\non = "challenged"\n'
    )
    breaker = load_settings(path, {}).quarantine.breaker
    assert (breaker.identities, breaker.window_s, breaker.cool_s) == (4, 120.0, 60.0)
    assert breaker.reasons == ("challenged",)
    assert Settings().quarantine.breaker == BreakerSettings(
        enabled=True, identities=3, window_s=600.0, cool_s=900.0, on=("challenged", "blocked")
    )
    path.write_text("[quarantine.breaker]\nidentity = 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'quarantine.breaker.identity'"):
        load_settings(path, {})
    path.write_text("[quarantine.breaker]\ncool_s = 0\n")
    with pytest.raises(ConfigError, match=r"quarantine.breaker.cool_s is invalid"):
        load_settings(path, {})
