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
    points = series.series()
    assert [(p.ok, p.total) for p in points["v1"]] == [(1, 2), (1, 1)]
    assert [(p.ok, p.total) for p in points["v2"]] == [(0, 1)]
    assert points["v1"][1].t - points["v1"][0].t == BUCKET_S


def test_worker_and_identity_rows_split_successes_blocks_and_failures() -> None:
    series = OutcomeSeries()
    for kind in ("ok", "ok", "blocked", "retryable", "permanent"):
        series.add(_event(kind), 50.0)
    series.add(_event("ok", worker="w-1", identity=""), 50.0)
    [w0, w1] = series.rows("worker")
    assert (w0.name, w0.ok, w0.blocked, w0.failed) == ("w-0", 2, 1, 2)
    assert (w1.name, w1.ok) == ("w-1", 1)
    # A worker without an identity adds no identity row.
    assert [(r.name, r.ok) for r in series.rows("identity")] == [("id-a", 2)]


def test_the_buckets_and_keys_kept_are_bounded() -> None:
    series = OutcomeSeries()
    for n in range(BUCKETS + 20):
        series.add(_event(), n * BUCKET_S)
    assert len(series.series()["v1"]) == BUCKETS
    for n in range(MAX_KEYS + 10):
        series.add(_event(worker=f"w-{n}"), 0.0)
    assert len(series.rows("worker")) == MAX_KEYS
    assert "w-0" not in {r.name for r in series.rows("worker")}  # least recently seen


def test_a_targets_rate_counts_only_called_outcomes_in_the_last_whole_window() -> None:
    series = OutcomeSeries()
    window = int(outcome_series.RATE_WINDOW_S)
    for n in range(window * 9):  # 3 windows: 3 a second, 2 of them called
        series.add(_event(called=n % 3 != 0), 100.0 + n / 3)
    now = 100.0 + window * 3.5  # the window in progress is not counted
    assert series.rates(now)["demo"] == 2.0
    assert series.rates(now + 3 * outcome_series.RATE_WINDOW_S)["demo"] == 0.0
