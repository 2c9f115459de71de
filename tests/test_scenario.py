"""The leasing walkthrough's JSON, run against the real services (its own nats-server)."""

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
        [sys.executable, "-m", "jetfleet", "scenario", "--json"],
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
