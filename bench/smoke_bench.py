"""The speed guard: the full job path next to the raw JetStream floor, in one run.

    python bench/smoke_bench.py [--jobs N] [--json]        (make bench-smoke)

Two measurements, one after the other, each on its own nats-server in a temp folder:

    floor      plain nats-py: publish N messages to a WorkQueue stream (256 awaiting their
               PubAck at once), pull them in batches of 200 and ack each: what one
               process gets from the server with no leases, no results, no workers
    full path  ``jetfleet dev``'s defaults (every service, 2 workers, the demo target)
               running N ``noop`` jobs, submit -> CommittedResult (bench/jetfleet_bench.py)

and the ratio full/floor. The floor is measured in the same run so the ratio stays
comparable on a machine that is busier or quieter than the last one. No figure is
asserted anywhere: it is for people to read, before and after a change to the job's path,
and to record in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench/ is not a package: its modules import each other flat
    sys.path.insert(0, str(HERE))

import nats  # noqa: E402
from harness import fmt_table, run_with_tree, start_nats  # noqa: E402
from jetfleet_bench import run_jetfleet  # noqa: E402
from nats.js import api as js_api  # noqa: E402

DEFAULT_JOBS = 3000
WORKERS = 2  # jetfleet dev's default
IN_FLIGHT = 256
FETCH_BATCH = 200
TIMEOUT_S = 300.0


async def raw_floor(jobs: int) -> dict[str, Any]:
    """Publish ``jobs`` messages with acks, then fetch and ack them all; jobs/s overall."""
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-floor-"))
    server = await start_nats(folder)
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(
            js_api.StreamConfig(
                name="FLOOR",
                subjects=["floor.>"],
                retention=js_api.RetentionPolicy.WORK_QUEUE,
                storage=js_api.StorageType.FILE,
            )
        )
        sub = await js.pull_subscribe("floor.>", durable="floor", stream="FLOOR")
        gate = asyncio.Semaphore(IN_FLIGHT)
        body = b'{"id":"job","url":"http://127.0.0.1/page"}'

        async def publish(n: int) -> None:
            async with gate:
                await js.publish(f"floor.demo.{n % 3}", body)

        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(publish(n) for n in range(jobs))), TIMEOUT_S)
        published = time.monotonic()
        acked = 0
        deadline = published + TIMEOUT_S
        while acked < jobs and time.monotonic() < deadline:
            for msg in await sub.fetch(FETCH_BATCH, timeout=5.0):
                await msg.ack()
                acked += 1
        done = time.monotonic()
        return {
            "jobs": jobs,
            "acked": acked,
            "publish_per_s": jobs / (published - started),
            "fetch_ack_per_s": acked / (done - published),
            "jobs_per_s": acked / (done - started),
        }
    finally:
        await nc.close()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def smoke(jobs: int) -> dict[str, Any]:
    floor = await raw_floor(jobs)
    full = await run_jetfleet("noop", jobs, WORKERS, TIMEOUT_S)
    ratio = full.get("jobs_per_s", 0.0) / floor["jobs_per_s"] if floor["jobs_per_s"] else 0.0
    return {"floor": floor, "full_path": full, "ratio": ratio}


def _table(result: dict[str, Any]) -> str:
    floor, full = result["floor"], result["full_path"]
    rows = [
        ["raw nats-py publish+fetch+ack", floor["jobs"], floor["acked"], floor["jobs_per_s"], ""],
        [
            f"jetfleet full path (noop, {WORKERS} workers)",
            full["jobs"],
            full.get("committed", 0),
            full.get("jobs_per_s", 0.0),
            f"lost {full.get('lost')}, dead {full.get('dead')}, {full.get('stop_reason', '')}"
            + (f", error {full['error']}" if "error" in full else ""),
        ],
    ]
    table = fmt_table(["path", "jobs", "done", "jobs/s", "note"], rows)
    return f"{table}\nfull path / floor = {result['ratio']:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="jobs (default 3000)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    result = asyncio.run(smoke(args.jobs))
    print(json.dumps(result, indent=2, default=str) if args.json else _table(result))
    return 0 if "error" not in result["full_path"] else 1


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
