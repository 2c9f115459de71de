"""jetfleet end to end: a DevStack in a temp folder, N jobs of one handler, submit -> commit.

Throughput is counted from the first submit to the last CommittedResult seen on
``jf.results.>``; latency per job is the time between just before its publish and the
arrival of its CommittedResult at a plain core-NATS subscription opened before the
first submit. Both clocks are this process's ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from harness import stop_stack
from stats import cpu_snapshot, latency_summary, usage_since

from jetfleet import subjects
from jetfleet.client import jobs_for, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.devstack import DevStack
from jetfleet.ops.status import fleet_status
from jetfleet.topology import declare

TARGET = "demo"
IN_FLIGHT = 256  # submissions awaiting their stream ack at once (= jetfleet.client.IN_FLIGHT)
START_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 60.0
_READY = re.compile(r"jetfleet\.service: \S+ started")


class _ResultHead(msgspec.Struct):
    """The few fields of a CommittedResult the bench needs (decoding all of it costs CPU)."""

    job_id: str
    attempt: int = 0


_decode_head = msgspec.json.Decoder(_ResultHead).decode


async def _wait_ready(stack: DevStack, timeout_s: float) -> float:
    """Wait until every child logged ``<service> started``; return the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout_s
    logs = stack.data_dir / "logs"
    while True:
        if stack.dead_children():
            raise RuntimeError("a child died during start:\n" + stack.describe_dead_children())
        waiting = [
            name for name in stack.children if not _READY.search(_read(logs / f"{name}.log"))
        ]
        if not waiting:
            return time.monotonic() - started
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout_s:.0f} s: {', '.join(waiting)}")
        await asyncio.sleep(0.1)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


async def _submit_all(
    batch: list[Any], submit_one: Callable[[Any], Awaitable[None]], rate: float | None
) -> None:
    """All at once (the gate in ``submit_one`` bounds what is in flight), or paced at a
    steady ``rate`` per second."""
    if not rate:
        await asyncio.gather(*(submit_one(j) for j in batch))
        return
    started = time.monotonic()
    pending: set[asyncio.Task[None]] = set()
    for n, job in enumerate(batch):
        await asyncio.sleep(max(0.0, started + n / rate - time.monotonic()))
        pending.add(asyncio.create_task(submit_one(job)))
        pending = {t for t in pending if not t.done()}
    await asyncio.gather(*pending)


async def run_jetfleet(
    handler: str,
    jobs: int,
    workers: int,
    timeout_s: float,
    keep: bool = False,
    leases: bool = True,
    rate: float | None = None,
    warmup: int = 0,
) -> dict[str, Any]:
    """Run one jetfleet scenario and return its figures (never leaves a process behind).

    ``leases=False`` sets ``fleet.leases = false``: the unfenced direct path, a baseline
    for what leasing costs, never a way to run production. ``rate`` submits at a steady
    ``rate`` jobs/s instead of all at once (the latency scenario), after ``warmup``
    jobs run to their commit and not counted. Status counts (dead, rejected) include
    the warm-up jobs; they all commit, so ``lost`` does not.
    """
    folder = Path(tempfile.mkdtemp(prefix=f"jetfleet-bench-{handler.replace('.', '-')}-"))
    user_config = None
    if not leases:
        user_config = folder / "bench-user.toml"
        user_config.write_text("[fleet]\nleases = false\n")
    stack = DevStack(folder, workers=workers, user_config=user_config)
    result: dict[str, Any] = {
        "system": "jetfleet",
        "handler": handler,
        "jobs": jobs,
        "workers": workers,
        "leases": leases,
        "paced_per_s": rate,
        "data_dir": str(folder) if keep else None,
    }
    nc = None
    try:
        await asyncio.wait_for(stack.start(), START_TIMEOUT_S)
        result["ready_s"] = await _wait_ready(stack, READY_TIMEOUT_S)
        assert stack.settings is not None
        settings = stack.settings
        nc = await connect_nats(settings.nats, "jetfleet-bench")
        js = nc.jetstream()
        await declare(js, settings)

        submitted_at: dict[str, float] = {}
        arrived_at: dict[str, float] = {}
        extra = {"duplicates": 0, "unknown": 0, "redelivered_commits": 0}
        warming: set[str] = set()  # warm-up jobs not committed yet
        warmed = asyncio.Event()

        async def on_result(msg: Any) -> None:
            now = time.monotonic()
            head = _decode_head(msg.data)
            if head.job_id in arrived_at:
                extra["duplicates"] += 1
            elif head.job_id not in submitted_at:
                extra["unknown"] += 1
            else:
                arrived_at[head.job_id] = now
                if head.attempt > 1:
                    extra["redelivered_commits"] += 1
                if head.job_id in warming:
                    warming.discard(head.job_id)
                    if not warming:
                        warmed.set()

        sub = await nc.subscribe(
            "jf.results.>",
            cb=on_result,
            pending_msgs_limit=max(65536, 4 * jobs),
            pending_bytes_limit=256 * 1024 * 1024,
        )
        await nc.flush()

        batch = jobs_for(TARGET, settings, [f"/page/{n}" for n in range(jobs)], handler=handler)
        gate = asyncio.Semaphore(IN_FLIGHT)
        rejected_at_submit = 0

        async def submit_one(job: Any) -> None:
            nonlocal rejected_at_submit
            async with gate:
                submitted_at[job.id] = time.monotonic()  # just before this job's publish
                (outcome,) = await submit_jobs(js, settings, TARGET, [job])
                if outcome.rejection is not None:
                    rejected_at_submit += 1

        if warmup:
            # Not counted: connections, buckets and code paths warmed, as in a fleet
            # that has been running.
            paths = [f"/warm/{n}" for n in range(warmup)]
            warm = jobs_for(TARGET, settings, paths, handler=handler)
            warming.update(j.id for j in warm)
            await asyncio.wait_for(asyncio.gather(*(submit_one(j) for j in warm)), timeout_s)
            await asyncio.wait_for(warmed.wait(), timeout_s)
            submitted_at.clear()
            arrived_at.clear()
            extra.update(duplicates=0, unknown=0, redelivered_commits=0)
            rejected_at_submit = 0
            result["warmup"] = warmup
        pids: dict[str, int | None] = {n: p.pid for n, p in stack.children.items()}
        pids["nats-server"] = stack.nats.process.pid if stack.nats.process else None
        pids["redis-server"] = stack.redis.process.pid if stack.redis.process else None
        cpu0 = cpu_snapshot(pids)
        first_submit = time.monotonic()
        await asyncio.wait_for(_submit_all(batch, submit_one, rate), timeout_s)
        submit_done = time.monotonic()

        deadline = first_submit + timeout_s
        status = None
        next_status = 0.0
        stop_reason = "all committed"
        while len(arrived_at) < jobs:
            now = time.monotonic()
            if now > deadline:
                stop_reason = f"timeout after {timeout_s:.0f} s"
                break
            if stack.dead_children():
                stop_reason = "a child died"
                break
            if now >= next_status:
                # Dead letters and rejections never reach jf.results: count them here.
                status = (await fleet_status(js, settings)).totals
                next_status = time.monotonic() + 1.0
                if len(arrived_at) + status.dead + status.rejected >= jobs:
                    stop_reason = "all terminal"
                    break
            await asyncio.sleep(0.05)
        usage = usage_since(pids, cpu0)  # before the checks below add their own work
        await asyncio.sleep(0.5)  # late duplicates, if any, would show up now
        await sub.unsubscribe()

        status = (await fleet_status(js, settings)).totals
        # One durable consumer per (target, tier): add the three up.
        consumers = [
            await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer(TARGET, tier))
            for tier in subjects.TIERS
        ]
        last = max(arrived_at.values()) if arrived_at else time.monotonic()
        elapsed = last - first_submit
        committed = len(arrived_at)
        result.update(
            {
                "stop_reason": stop_reason,
                "committed": committed,
                "dead": status.dead,
                "rejected": status.rejected,
                "rejected_at_submit": rejected_at_submit,
                "lost": jobs - committed - status.dead - status.rejected,
                "status_at_end": msgspec.structs.asdict(status),
                "work_consumer_at_end": {
                    "num_pending": sum(c.num_pending or 0 for c in consumers),
                    "num_ack_pending": sum(c.num_ack_pending or 0 for c in consumers),
                    "num_redelivered": sum(c.num_redelivered or 0 for c in consumers),
                },
                **extra,
                "submit_s": submit_done - first_submit,
                "elapsed_s": elapsed,
                "jobs_per_s": committed / elapsed if elapsed > 0 else 0.0,
                "latency": latency_summary(arrived_at[j] - submitted_at[j] for j in arrived_at),
                "latency_label": "submit -> CommittedResult seen",
            }
        )
        sim = stack.simulator.counts()
        result["target"] = {
            "requests": sim.get("total"),
            "max_in_any_1s": stack.simulator.max_in_any_window(1.0),
            "configured_rate_per_s": settings.target(TARGET).rate,
        }
        result["processes"] = usage
        result["dead_children"] = stack.dead_children()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        # Logs are scanned after the stop, so errors logged while draining count too.
        await stop_stack(stack, nc, folder, keep, result, extra_logs=[stack.redis.log_path])
    return result
