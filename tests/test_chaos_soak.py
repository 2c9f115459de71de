"""The chaos soak's short form, as CI runs it: ``bench/chaos.py --jobs 2000 --nats
cluster`` (the long form runs 20,000; docs/benchmarks.md has the last results of both).

Marked ``soak``: the suite leaves it out, and ``python -m pytest -m soak`` runs it alone,
as .ci/run does after the suite. Beside the suite it took a process for 3 to 8 minutes
and, with its fleet of a dozen processes, loaded the machine under the suite's timing
checks (rate caps counted per second at the targets).

On a 3-node NATS cluster (R3 streams, consumers and buckets, ``sync_interval: always``),
two replicas of every service and a few workers run 2,000 jobs while a random worker is
SIGKILLed every few seconds (and started again, also while a NATS node is down), each
service is restarted once, the node leading the work stream and its consumers is
SIGKILLed mid-run and started again on its store, one worker's clock is 37 s ahead,
another loses some acks, a worker is stopped past its lease and Redis comes back empty.
The script checks, from the streams, the lease buckets and the simulator's own counts,
and exits 1 when any check fails; this test fails with its report. The one-node form
(``--nats single``: nats-server SIGKILLed and started again) stays runnable by the script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "chaos.py"
JOBS = 2000
SCRIPT_TIMEOUT_S = 720
"""Measured with start-up and checks on 2 shared cores: 4.5 min, 6.5-8 min at load 20-30
(docs/benchmarks.md)."""


@pytest.mark.soak
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 20)
def test_chaos_short_form_loses_nothing_applies_once_takes_no_stale_commit_holds_caps() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--jobs", str(JOBS), "--nats", "cluster", "--json"],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert out.stdout.strip(), f"no report (exit {out.returncode}):\n{out.stderr[-4000:]}"
    report = json.loads(out.stdout)
    failed = [c for c in report["checks"] if not c["passed"]]
    summary = "\n".join(f"{c['name']}: {c['detail']}" for c in report["checks"])
    assert not failed and out.returncode == 0, f"{summary}\n{out.stderr[-3000:]}"
    assert report["jobs"] == JOBS
    assert report["lost"] == 0
    # Committed once each; the site's double serves are the check's (one per kill at most).
    assert report["over_apply_records"] == 1.0
    assert report["stale_commits_accepted"] == 0
    assert report["largest_1s_rate"] <= report["rate_cap"]
    assert report["committed"] + report["dead"] == JOBS
    assert set(report["dead_by_reason"]) == {"http-404"}
    assert report["nats"].startswith("kill the NATS stream leader")
    headline = (
        f"{report['jobs']} jobs in {report['seconds']} s; acks redelivered "
        f"{report['acks_lost']}; NATS step: {report['nats']}"
    )
    print(f"\n{headline}\n{summary}\n" + "\n".join(report["events"]))
