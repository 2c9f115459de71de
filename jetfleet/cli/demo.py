"""``jetfleet demo``: a throwaway local fleet runs N demo pages and reports."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time

import msgspec
from nats.js import JetStreamContext

from jetfleet import subjects
from jetfleet.cli.progress import ProgressBar, print_json, print_table
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.devstack import DevStack
from jetfleet.errors import JetfleetError
from jetfleet.ops.status import confirmed_status, fleet_status
from jetfleet.topology import declare


class DemoSummary(msgspec.Struct):
    """What the demo prints at the end."""

    submitted: int
    committed: int
    dead: int
    rejected: int
    unfinished: int
    """Jobs still queued, leased or awaiting admission when the demo stopped waiting."""
    lost: int
    """Submitted jobs in no state at all (submitted minus every state): always 0."""
    seconds: float
    jobs_per_s: float
    workers: int


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 0 only if every job reached a terminal state."""
    if args.jobs < 1:
        raise JetfleetError("--jobs must be at least 1")
    from jetfleet.cli.run_commands import temp_stack_dir

    folder = temp_stack_dir()
    try:
        summary = asyncio.run(_demo(folder, args.jobs, args.workers, args.timeout, args.json))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print_json(summary)
    else:
        print_table(
            [
                "submitted",
                "committed",
                "dead",
                "rejected",
                "unfinished",
                "lost",
                "seconds",
                "jobs/s",
            ],
            [
                [
                    summary.submitted,
                    summary.committed,
                    summary.dead,
                    summary.rejected,
                    summary.unfinished,
                    summary.lost,
                    f"{summary.seconds:.2f}",
                    f"{summary.jobs_per_s:.1f}",
                ]
            ],
        )
    return 0 if summary.lost == 0 and summary.unfinished == 0 else 1


async def _demo(
    folder: object, jobs: int, workers: int, timeout_s: float, quiet: bool
) -> DemoSummary:
    from pathlib import Path

    async with DevStack(Path(str(folder)), workers=workers) as stack:
        assert stack.settings is not None
        settings = stack.settings
        if not quiet:
            print(
                f"local fleet up: {workers} workers, target {stack.simulator.base_url}, "
                f"dashboard {stack.gateway_url}/",
                flush=True,
            )
        nc = await connect_nats(settings.nats, "jetfleet-demo", role="admin")
        try:
            js = nc.jetstream()
            await declare(js, settings)
            # Time the fleet, not the workers' start-up: wait until every worker pulls.
            await _workers_pulling(js, workers, deadline=time.monotonic() + 60)
            started = time.monotonic()
            await submit_jobs(
                js,
                settings,
                "demo",
                jobs_for("demo", settings, [f"/page/{n}" for n in range(jobs)]),
            )
            bar = ProgressBar(jobs, "jobs", enabled=None if not quiet else False)
            deadline = started + timeout_s
            while True:
                full = await fleet_status(js, settings)
                status = full.totals
                done = status.committed + status.dead + status.rejected
                bar.update(done, f"committed {status.committed} dead {status.dead}")
                if done >= jobs or time.monotonic() > deadline or stack.dead_children():
                    break
                await asyncio.sleep(0.2)
            elapsed = time.monotonic() - started
            bar.close()
            if not full.conserved:
                # The last read caught a job between two states: the summary's `lost`
                # must not report it, so read again until it adds up.
                full = await confirmed_status(js, settings)
                status = full.totals
        finally:
            await nc.close()
        if stack.dead_children():
            raise JetfleetError(stack.describe_dead_children())
    return DemoSummary(
        submitted=status.submitted,
        committed=status.committed,
        dead=status.dead,
        rejected=status.rejected,
        unfinished=status.queued + status.leased + full.admitting,
        lost=full.unaccounted,
        seconds=elapsed,
        jobs_per_s=done / elapsed if elapsed > 0 else 0.0,
        workers=workers,
    )


async def _workers_pulling(js: JetStreamContext, workers: int, deadline: float) -> None:
    consumer = subjects.work_consumer("demo", "normal")
    while time.monotonic() < deadline:
        info = await js.consumer_info(subjects.STREAM_WORK, consumer)
        if (info.num_waiting or 0) >= workers:
            return
        await asyncio.sleep(0.1)
    raise JetfleetError(f"the {workers} demo workers did not start pulling within 60 s")
