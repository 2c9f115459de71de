"""`jetfleet demo`, the showcase, end to end in its own processes as a user runs it."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from jetfleet.dev import demo_cast

JOBS = 300


def test_demo_ends_with_nothing_lost_exactly_once_within_caps_and_every_fault_handled() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jetfleet", "demo", "--jobs", str(JOBS), "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    # Quiet with --json: no progress bar, not even on stderr.
    assert "\r" not in out.stderr and "jobs [" not in out.stderr, out.stderr[-500:]

    # Chromium is installed here and in CI (as for tests/test_browser_page.py), so the
    # demo runs its browser part: a browser worker, item pages read, removed prices.
    assert demo_cast.find_chromium() is not None
    assert report["browser"].startswith("ran: "), report["browser"]
    kinds = {k.name: n for k, n in demo_cast.counts(JOBS, demo_cast.mix(browser=True))}
    dead_wanted = {
        "selector-removed": kinds["removed-selector"] + kinds["browser-removed"],
        "http-404": kinds["gone-page"],
    }
    assert report["submitted"] == JOBS
    assert (report["lost"], report["unfinished"], report["rejected"]) == (0, 0, 0)
    assert report["dead_by_reason"] == dead_wanted
    assert report["dead"] == sum(dead_wanted.values())
    assert report["committed"] == JOBS - report["dead"]

    # Each committed browser job read its item's title and price in Chromium.
    pages = report["browser_pages"]
    assert len(pages) == kinds["browser-item"]
    assert all(p["title"] and p["values"]["title"] and p["values"]["price"] for p in pages), pages

    # Exactly once, by the sites' own counts of pages served.
    assert report["over_apply_ratio"] == 1.0
    assert report["side_effects"] == report["distinct_jobs"] == report["committed"], {
        k: report[k] for k in ("over_applied", "killed_worker", "events")
    }

    # Every target saw no more in any 1 s than its cap.
    rates = report["largest_1s_rate"]
    assert set(rates) == {"demo", "slow", "storm", "shop", demo_cast.ITEMS}
    assert all(r["observed"] <= r["cap"] and r["within_cap"] for r in rates.values()), rates

    # The streak retired one identity on one target, and nothing more.
    assert [(q["scope"], q["name"], q["target"]) for q in report["quarantines"]] == [
        ("identity", demo_cast.BLOCKED_IDENTITY, demo_cast.SHOP)
    ]
    assert report["second_order_retirements"] == 0

    # The killed worker's jobs came back after lease expiry and were committed once.
    killed = report["killed_worker"]
    assert killed["worker"] == demo_cast.VICTIM
    assert killed["jobs_held"], "the victim held no lease when it was killed"
    assert killed["committed_once"] == len(killed["jobs_held"])

    # The skewed worker really ran an hour ahead, and still committed work.
    skewed = report["skewed_worker"]
    assert skewed["applied"] and abs(skewed["measured_offset_s"] - demo_cast.SKEW_S) < 60
    assert skewed["committed"] > 0

    versions = report["version_success_rates"]
    assert set(versions) == {"release=1.4", "release=1.5"}
    assert all(0 < v["success_rate"] <= 1 and v["attempts"] > 0 for v in versions.values())
    assert report["dashboard_url"].startswith("http://127.0.0.1:")


def test_demo_shows_progress_on_a_terminal_and_none_in_its_output(tmp_path: Path) -> None:
    # stderr is a terminal (a pty), stdout a file: the bar goes to the terminal only. (With
    # stdout a pipe there is no bar at all: a script is reading; docs/cli.md "Progress".)
    leader, follower = pty.openpty()
    out_file = (tmp_path / "demo.out").open("w+b")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetfleet", "demo", "--jobs", "40"],
        stdout=out_file,
        stderr=follower,
        stdin=subprocess.DEVNULL,
    )
    os.close(follower)
    terminal = b""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal: EIO on Linux
            break
        if not chunk:
            break
        terminal += chunk
    assert proc.wait(30) == 0, terminal.decode(errors="replace")[-2000:]
    os.close(leader)
    out_file.seek(0)
    stdout = out_file.read().decode()
    out_file.close()
    shown = terminal.decode(errors="replace")
    assert "\rjobs [" in shown and "/40 committed" in shown, shown[-1000:]
    assert "\r" not in stdout
    assert "dashboard: http://127.0.0.1:" in stdout
    assert "over-apply ratio 1.00" in stdout
    assert "lost" in stdout and "quarantines: identity id-a on shop" in stdout
