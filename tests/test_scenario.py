"""The leasing and containment walkthroughs' JSON, run against the real services (their
own nats-server and redis-server)."""

from __future__ import annotations

import json
import subprocess
import sys

REFERENCE_SAME = {
    "grants_refused_profile": 1,
    "grants_refused_quarantine": 1,
    "quarantines": 1,
    "reaped": 1,
    "commits": 4,
    "rejected_fenced": 1,
    "rejected_expired": 1,
    "distinct_jobs": 1,
}


def test_scenario_json_matches_the_reference_walkthrough() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jetfleet", "scenario", "--json", "--leasing-only"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    runs = json.loads(out.stdout)["runs"]
    assert [r["dedupe"] for r in runs] == [False, True]
    without, with_keys = runs
    for run in runs:
        for name, value in REFERENCE_SAME.items():
            assert run["metrics"][name] == value, (run["dedupe"], name)
        assert run["dead_letter"] == ["j-103:selector-removed"]
        # Differences from the reference are counted for real and explained.
        assert run["metrics"]["grants"] == 7 and run["metrics"]["requeued"] == 1
        assert any("two fewer" in note for note in run["notes"])
        assert any("grants" in note for note in run["notes"])
        assert all(set(e) == {"what", "detail"} for e in run["events"])
    assert without["metrics"]["accepted"] == 2
    assert without["metrics"]["suppressed_dedupe"] == 0
    assert (without["side_effects"], without["over_apply_ratio"]) == (2, 2.0)
    assert with_keys["metrics"]["accepted"] == 1
    assert with_keys["metrics"]["suppressed_dedupe"] == 1
    assert (with_keys["side_effects"], with_keys["over_apply_ratio"]) == (1, 1.0)
    events = [e["detail"] for e in with_keys["events"]]
    assert "j-101 by w-south: rejected:fenced-out" in events
    assert "j-105 by w-north: rejected:lease-expired" in events


# What the containment walkthrough must show, written out here rather than read from the
# module, so a change to its expectations has to change the test too.
CONTAINMENT = {
    "challenges_met": 3,
    "retirements": 1,
    "retired_on_other_targets": 0,
    "requeued_committed_elsewhere": 4,
    "revoked_committed_by_retired": 0,
    "shop_requests_by_retired_after_retirement": 0,
    "news_commits_by_retired": 3,
    "second_order_retirements": 0,
    "egress_proposals": 0,
    "breakers_opened": 0,
    "side_effects": 10,
    "distinct_jobs": 10,
}


def test_scenario_containment_retires_one_identity_on_one_target_and_requeues_its_work() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jetfleet", "scenario", "--json", "--containment-only"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    report = json.loads(out.stdout)
    assert report["runs"] == []
    run = report["containment"]
    assert run["figures"] == CONTAINMENT
    assert run["matches"] is True
    assert run["shop_max_1s"] <= run["shop_cap_1s"]
    what = [e["what"] for e in run["events"]]
    assert what == ["submit", "submit", "streak", "retire", "start", "requeue"]
