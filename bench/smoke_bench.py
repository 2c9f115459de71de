"""The speed guard: the full job path next to the raw JetStream floor, in one run.

    python bench/smoke_bench.py [--jobs N] [--json]        (make bench-smoke)

Two measurements, one after the other, each on its own nats-server in a temp folder:

    floor      plain nats-py: publish N messages to a WorkQueue stream (256 awaiting their
               PubAck at once), pull them in batches of 200 and ack each: what one
               process gets from the server with no leases, no results, no workers
               (bench/floor_bench.py's batched floor; ``python -m bench`` also prints
               the per-job flow floor the throughput target is judged against)
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
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench/ is not a package: its modules import each other flat
    sys.path.insert(0, str(HERE))

from floor_bench import batched_floor  # noqa: E402
from harness import fmt_table, run_with_tree  # noqa: E402
from jetfleet_bench import run_jetfleet  # noqa: E402

DEFAULT_JOBS = 3000
WORKERS = 2  # jetfleet dev's default
TIMEOUT_S = 300.0


async def smoke(jobs: int) -> dict[str, Any]:
    floor = await batched_floor(jobs)
    full = await run_jetfleet("noop", jobs, WORKERS, TIMEOUT_S)
    ratio = full.get("jobs_per_s", 0.0) / floor["jobs_per_s"] if floor["jobs_per_s"] else 0.0
    return {"floor": floor, "full_path": full, "ratio": ratio}


def _table(result: dict[str, Any]) -> str:
    floor, full = result["floor"], result["full_path"]
    rows = [
        [
            "raw nats-py publish+fetch+ack",
            floor["jobs"],
            floor["committed"],
            floor["jobs_per_s"],
            "",
        ],
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
