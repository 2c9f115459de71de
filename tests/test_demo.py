"""`jetfleet demo`, the README's main job, end to end in its own processes."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_commits_every_job_and_reports_nothing_lost() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jetfleet", "demo", "--jobs", "120", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["submitted"] == 120
    assert summary["committed"] == 120
    assert (summary["dead"], summary["rejected"]) == (0, 0)
    assert (summary["unfinished"], summary["lost"]) == (0, 0)
    assert summary["jobs_per_s"] > 0
