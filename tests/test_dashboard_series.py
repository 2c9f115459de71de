"""The dashboard's outcome tallies: bounded in buckets and keys, bucketed by server time."""

from __future__ import annotations

from jetfleet.schemas import Outcome
from jetfleet.schemas.report import Versions
from jetfleet.services.gateway import outcome_series
from jetfleet.services.gateway.outcome_series import BUCKET_S, BUCKETS, MAX_KEYS, OutcomeSeries


def _event(kind: str = "ok", worker: str = "w-0", version: str = "v1", **more: object) -> Outcome:
    fields: dict[str, object] = {"identity": "id-a", "target": "demo", **more}
    return Outcome(
        job_id="j",
        worker=worker,
        attempt=1,
        kind=kind,  # type: ignore[arg-type]
        duration_s=0.1,
        versions=Versions(jetfleet="0", id=version),
        **fields,  # type: ignore[arg-type]
    )


def test_each_version_gets_one_point_per_bucket_with_its_successes_and_total() -> None:
    series = OutcomeSeries()
    series.add(_event("ok"), 1000.0)
    series.add(_event("blocked"), 1001.0)
    series.add(_event("ok"), 1000.0 + BUCKET_S)
    series.add(_event("permanent", version="v2"), 1000.0)
    points = series.series(1000.0 + BUCKET_S)
    assert [(p.ok, p.total) for p in points["v1"]] == [(1, 2), (1, 1)]
    assert [(p.ok, p.total) for p in points["v2"]] == [(0, 1)]
    assert points["v1"][1].t - points["v1"][0].t == BUCKET_S


def test_worker_and_identity_rows_split_successes_blocks_and_failures() -> None:
    series = OutcomeSeries()
    for kind in ("ok", "ok", "blocked", "retryable", "permanent"):
        series.add(_event(kind), 50.0)
    series.add(_event("ok", worker="w-1", identity=""), 50.0)
    [w0, w1] = series.rows("worker", 50.0)
    assert (w0.name, w0.ok, w0.blocked, w0.failed) == ("w-0", 2, 1, 2)
    assert (w1.name, w1.ok) == ("w-1", 1)
    # A worker without an identity adds no identity row.
    assert [(r.name, r.ok) for r in series.rows("identity", 50.0)] == [("id-a", 2)]


def test_the_buckets_and_keys_kept_are_bounded() -> None:
    series = OutcomeSeries()
    for n in range(BUCKETS + 20):
        series.add(_event(), n * BUCKET_S)
    newest = (BUCKETS + 19) * BUCKET_S
    assert len(series.series(newest)["v1"]) == BUCKETS
    for n in range(MAX_KEYS + 10):
        series.add(_event(worker=f"w-{n}"), newest)
    assert len(series.rows("worker", newest)) == MAX_KEYS
    assert "w-0" not in {r.name for r in series.rows("worker", newest)}  # least recently seen


def test_a_targets_rate_counts_only_called_outcomes_in_the_last_whole_window() -> None:
    series = OutcomeSeries()
    window = int(outcome_series.RATE_WINDOW_S)
    for n in range(window * 9):  # 3 windows: 3 a second, 2 of them called
        series.add(_event(called=n % 3 != 0), 100.0 + n / 3)
    now = 100.0 + window * 3.5  # the window in progress is not counted
    assert series.rates(now)["demo"] == 2.0
    assert series.rates(now + 3 * outcome_series.RATE_WINDOW_S)["demo"] == 0.0


def test_only_the_last_15_minutes_are_counted_however_sparse_the_events() -> None:
    # A key seen once an hour keeps few buckets, far fewer than BUCKETS: the window is
    # time, so a gateway running for hours shows what a freshly started one (which read
    # the last 15 minutes again) shows.
    window = BUCKET_S * BUCKETS
    series = OutcomeSeries()
    for hour in range(3):
        series.add(_event(worker="w-hourly", version="v-hourly"), 3600.0 * hour)
    series.add(_event(worker="w-gone", version="v-gone"), 3600.0 * 2 - window - 1)
    now = 3600.0 * 2 + 60
    assert [(r.name, r.ok) for r in series.rows("worker", now)] == [("w-hourly", 1)]
    assert {k: len(v) for k, v in series.series(now).items()} == {"v-hourly": 1}
    assert series.rows("identity", now)[0].ok == 1
    # Once the window has moved past every event, nothing is left.
    assert series.rows("worker", now + window) == []
    assert series.series(now + window) == {}


def test_a_late_bucket_is_put_in_time_order() -> None:
    series = OutcomeSeries()
    for at in (100.0, 300.0, 200.0):
        series.add(_event(), at)
    assert [p.t for p in series.series(300.0)["v1"]] == [100.0, 200.0, 300.0]
