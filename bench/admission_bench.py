"""Admission latency: how long a submission waits before its work order is stored.

    python bench/admission_bench.py [--jobs 200] [--gap-ms 0,10,50,200] [--json]

One embedded nats-server and one in-process scheduler. Jobs are submitted one at a time,
``gap`` apart (a trickle; 0 is a burst of ``--jobs`` at once, 256 in flight). Latency is
the work order's stored time minus the submission's stored time, both from the server's
clock (stream message timestamps), so no client clock takes part.

It answers one question: does the scheduler's ``fetch(200, timeout=1)`` hold a lone
submission back until its batch fills or the second is over? (It does not: nats-py
sends the first pull request with ``no_wait``, and the server ends it as soon as what
was there, or the first arrival, is delivered.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness import fmt_table, load, run_with_tree, write_config  # noqa: E402
from jetfleet.services.scheduler import Scheduler  # noqa: E402
from stats import latency_summary  # noqa: E402

from jetfleet import subjects  # noqa: E402
from jetfleet.client import jobs_for, submit_jobs  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.dev.embedded import EmbeddedNats  # noqa: E402
from jetfleet.settings import Settings  # noqa: E402
from jetfleet.topology import declare  # noqa: E402


async def _stored_times(settings: Settings, stream: str) -> dict[str, float]:
    """Server timestamp of each message of ``stream``, by job id (read by sequence: the
    work stream is a WorkQueue, which takes no extra consumer)."""
    nc = await connect_nats(settings.nats, "bench-reader")
    js = nc.jetstream()
    times: dict[str, float] = {}
    try:
        last = (await js.stream_info(stream)).state.last_seq
        for seq in range(1, last + 1):
            msg = await js.get_msg(stream, seq=seq)
            body = json.loads(msg.data or b"{}")
            job_id = body["job"]["id"] if stream == subjects.STREAM_WORK else body["id"]
            assert msg.time is not None
            times[job_id] = msg.time.timestamp()
    finally:
        await nc.close()
    return times


async def _until_routed(js: Any, jobs: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await js.stream_info(subjects.STREAM_WORK)).state.messages >= jobs:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"fewer than {jobs} work orders after {timeout_s:g} s")


async def one_run(jobs: int, gap_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        server = EmbeddedNats(folder / "nats").start()
        try:
            config = write_config(
                folder, server.url, {"targets.demo": {"base_url": "http://127.0.0.1:9/"}}
            )
            settings = load(config)
            nc = await connect_nats(settings.nats, "bench")
            await declare(nc.jetstream(), settings)
            scheduler = Scheduler(settings, await connect_nats(settings.nats, "scheduler"))
            await scheduler.start()
            batch = jobs_for("demo", settings, [f"/page/{n}" for n in range(jobs)], handler="noop")
            began = time.monotonic()
            if gap_s == 0:
                await submit_jobs(nc.jetstream(), settings, "demo", batch)
            else:
                for job in batch:
                    await submit_jobs(nc.jetstream(), settings, "demo", [job])
                    await asyncio.sleep(gap_s)
            await _until_routed(nc.jetstream(), jobs)
            elapsed = time.monotonic() - began
            await scheduler.drain(5.0)
            await scheduler.nc.close()
            await nc.close()
            submitted = await _stored_times(settings, subjects.STREAM_SUBMIT)
            routed = await _stored_times(settings, subjects.STREAM_WORK)
            waits = [routed[j] - submitted[j] for j in routed if j in submitted]
            return {
                "gap_ms": round(gap_s * 1000),
                "jobs": len(waits),
                "latency": latency_summary(waits),
                "elapsed_s": round(elapsed, 2),
            }
        finally:
            server.stop()


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for gap_ms in [int(g) for g in args.gap_ms.split(",")]:
        rows.append(await one_run(args.jobs, gap_ms / 1000))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--gap-ms", default="0,10,50,200")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [
        [
            r["gap_ms"],
            r["jobs"],
            r["latency"]["p50_ms"],
            r["latency"]["p99_ms"],
            r["latency"]["max_ms"],
        ]
        for r in rows
    ]
    print(fmt_table(["gap ms", "jobs", "p50 ms", "p99 ms", "max ms"], table))
    return 0


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
