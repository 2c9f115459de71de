"""Activity windows (jetfleet/activity_window.py): open or not at a given moment, and how
long until they open, at the boundaries."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from jetfleet.activity_window import ActivityWindow, WindowError, window_of
from jetfleet.errors import ConfigError
from jetfleet.settings import Settings, load_settings

UTC = datetime.UTC


def at(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text)


def window(
    hours: tuple[str, ...] = (), days: tuple[str, ...] = (), tz: str = "UTC"
) -> ActivityWindow:
    parsed = ActivityWindow.parse(hours, days, tz)
    assert parsed is not None
    return parsed


def test_no_hours_and_no_days_is_always_open() -> None:
    assert ActivityWindow.parse((), (), "") is None
    assert ActivityWindow.parse((), (), "Europe/Lisbon") is None


def test_a_day_span_is_open_from_its_start_up_to_but_not_at_its_end() -> None:
    w = window(("08:00-18:00",))
    assert w.opens_in_s(at("2026-03-02T08:00:00+00:00")) == 0.0  # at open
    assert w.opens_in_s(at("2026-03-02T07:59:59+00:00")) == 1.0  # a second before
    assert w.opens_in_s(at("2026-03-02T17:59:59+00:00")) == 0.0
    # At close: shut, and it opens again the next morning.
    assert w.opens_in_s(at("2026-03-02T18:00:00+00:00")) == 14 * 3600.0


def test_a_span_across_midnight_runs_into_the_next_day() -> None:
    w = window(("22:00-02:00",))
    assert w.opens_in_s(at("2026-03-02T23:30:00+00:00")) == 0.0
    assert w.opens_in_s(at("2026-03-03T01:59:59+00:00")) == 0.0
    assert w.opens_in_s(at("2026-03-03T02:00:00+00:00")) == 20 * 3600.0
    assert w.opens_in_s(at("2026-03-02T21:59:59+00:00")) == 1.0


def test_days_pick_the_day_a_span_starts_on() -> None:
    # 2026-03-06 is a Friday.
    w = window(("22:00-02:00",), ("fri",))
    assert w.opens_in_s(at("2026-03-07T01:00:00+00:00")) == 0.0  # Friday's span, Saturday
    # Saturday night is shut: the next opening is next Friday 22:00.
    saturday_night = at("2026-03-07T22:00:00+00:00")
    assert w.opens_in_s(saturday_night) == 6 * 86400.0


def test_several_spans_and_the_nearest_opening_wins() -> None:
    w = window(("06:00-07:00", "12:00-13:30"))
    assert w.opens_in_s(at("2026-03-02T07:00:00+00:00")) == 5 * 3600.0
    assert w.opens_in_s(at("2026-03-02T13:00:00+00:00")) == 0.0


def test_seconds_are_allowed_and_a_whole_day_span_is_always_open() -> None:
    assert window(("10:00:30-11:00",)).opens_in_s(at("2026-03-02T10:00:00+00:00")) == 30.0
    always = window(("00:00-24:00",))
    assert always.opens_in_s(at("2026-03-02T23:59:59+00:00")) == 0.0
    assert always.longest_closed_s() == 0.0


def test_a_named_zone_is_judged_in_its_local_hours() -> None:
    # Lisbon is UTC+1 in summer: 08:00 local is 07:00 UTC.
    w = window(("08:00-18:00",), tz="Europe/Lisbon")
    assert w.opens_in_s(at("2026-07-01T07:00:00+00:00")) == 0.0
    assert w.opens_in_s(at("2026-07-01T06:59:59+00:00")) == 1.0
    # The same moment given in another offset is the same moment.
    assert w.opens_in_s(at("2026-07-01T09:00:00+02:00")) == 0.0


def test_a_dst_day_keeps_the_local_hours() -> None:
    # Europe/Lisbon springs forward on 2026-03-29 at 01:00 UTC (01:00 -> 02:00 local).
    w = window(("03:00-04:00",), tz="Europe/Lisbon")
    # On the day before, 03:00 local is 03:00 UTC; on the DST day it is 02:00 UTC.
    assert w.opens_in_s(at("2026-03-29T00:00:00+00:00")) == 2 * 3600.0
    assert w.opens_in_s(at("2026-03-29T02:00:00+00:00")) == 0.0
    # A start in the gap (01:30 does not exist that day) opens as the gap ends, 02:00.
    gap = window(("01:30-05:00",), tz="Europe/Lisbon")
    assert gap.opens_in_s(at("2026-03-29T00:59:59+00:00")) == 1.0
    # A span ending just past the gap, or wholly in it, still opens that day (read
    # naively it began after it ended, or vanished, and the day was skipped).
    for span, closes in (("01:30-02:15", "01:15"), ("01:10-01:40", "01:40")):
        w = window((span,), tz="Europe/Lisbon")
        assert w.opens_in_s(at("2026-03-29T00:59:59+00:00")) == 1.0, span
        assert w.opens_in_s(at("2026-03-29T01:00:00+00:00")) == 0.0, span
        assert w.opens_in_s(at(f"2026-03-29T{closes}:00+00:00")) > 0, span


def test_longest_closed_spell_over_a_week() -> None:
    assert window(("08:00-18:00",)).longest_closed_s() == 14 * 3600.0
    weekdays = window(("08:00-18:00",), ("mon", "tue", "wed", "thu", "fri"))
    assert weekdays.longest_closed_s() == (14 + 48) * 3600.0
    assert window(("22:00-02:00",), ("friday",)).longest_closed_s() == (7 * 24 - 4) * 3600.0


@pytest.mark.parametrize(
    ("hours", "days", "tz", "says"),
    [
        (("8-18",), (), "UTC", "'8' is not a time"),
        (("08:00",), (), "UTC", "is not START-END"),
        (("08:00-08:00",), (), "UTC", "is empty"),
        (("24:00-02:00",), (), "UTC", "starts at 24:00"),
        (("08:00-24:30",), (), "UTC", "past 24:00"),
        ((), ("mo",), "UTC", "day 'mo' is not a day: use mon, tue"),
        (("08:00-18:00",), (), "Europe/Lisbn", "time zone 'Europe/Lisbn' is not known"),
        ((), (), "Mars/Olympus", "time zone 'Mars/Olympus' is not known"),
    ],
)
def test_unreadable_settings_say_what_to_write(
    hours: tuple[str, ...], days: tuple[str, ...], tz: str, says: str
) -> None:
    with pytest.raises(WindowError, match=says.replace("(", r"\(")):
        ActivityWindow.parse(hours, days, tz)


# --- the settings: checked at load ------------------------------------------------------


def _load(tmp_path: Path, body: str) -> Settings:
    path = tmp_path / "jetfleet.toml"
    path.write_text('[targets.shop]\nbase_url = "https://shop.example/"\n' + body)
    return load_settings(path, {})


def test_a_window_in_the_settings_is_read(tmp_path: Path) -> None:
    settings = _load(
        tmp_path,
        'active_hours = ["08:00-18:00", "22:00-02:00"]\nactive_days = ["mon", "fri"]\n'
        'timezone = "Europe/Lisbon"\n',
    )
    target = settings.targets["shop"]
    parsed = window_of(target.active_hours, target.active_days, target.timezone)
    assert parsed is not None and parsed.days == frozenset({0, 4})


@pytest.mark.parametrize(
    ("body", "key", "says"),
    [
        ('active_hours = ["8h-18h"]\n', "targets.shop.active_hours", "HH:MM"),
        ('active_days = ["weekday"]\n', "targets.shop.active_days", "use mon, tue"),
        ('timezone = "Europe/Lisbn"\n', "targets.shop.timezone", "IANA name"),
    ],
)
def test_a_bad_window_setting_names_its_key_and_the_fix(
    tmp_path: Path, body: str, key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, body)
    assert f"{key} is invalid" in str(info.value)
    assert says in str(info.value)


def test_a_window_closed_longer_than_the_jobs_max_age_is_refused(tmp_path: Path) -> None:
    # Open one hour a week; jobs live a day: a job submitted at closing would expire.
    with pytest.raises(ConfigError) as info:
        _load(
            tmp_path, 'active_hours = ["10:00-11:00"]\nactive_days = ["mon"]\nmax_age_s = 86400\n'
        )
    message = str(info.value)
    assert "targets.shop.active_hours is invalid" in message
    assert "closed for up to 167 h" in message
    assert "set targets.shop.max_age_s above 604800" in message
    # max_age_s may not pass fleet.retention_s (a week by default): the advice says so,
    # and following it loads.
    assert "and fleet.retention_s (now 604800) at least as high" in message
    weekly = 'active_hours = ["10:00-11:00"]\nactive_days = ["mon"]\nmax_age_s = 604900\n'
    with pytest.raises(ConfigError, match=r"fleet\.retention_s"):
        _load(tmp_path, weekly)
    path = tmp_path / "jetfleet.toml"
    path.write_text(
        '[fleet]\nretention_s = 604900\n[targets.shop]\nbase_url = "https://shop.example/"\n'
        + weekly
    )
    load_settings(path, {})
    # Open on Mondays and Thursdays, the longest spell is Thu 11:00 to Mon 10:00 (95 h):
    # a max age above it plus the DST hour loads.
    body = 'active_hours = ["10:00-11:00"]\nactive_days = ["mon", "thu"]\nmax_age_s = {}\n'
    with pytest.raises(ConfigError, match="closed for up to 95 h"):
        _load(tmp_path, body.format(96 * 3600))
    _load(tmp_path, body.format(96 * 3600 + 1))
