"""Throughput with 1, 10 and 100 targets: the same total of noop jobs spread evenly.

    python bench/targets_bench.py [--targets 1,10,100] [--jobs 3000] [--workers 2] [--json]

Each count K gets a fresh DevStack (W workers) whose user config declares K targets:
``demo`` (which DevStack writes itself) and ``t001`` ... ``t<K-1>``, all with demo's
limits (rate 500/s, burst 100, max_in_flight 64) and a base_url on a target simulator
this bench runs itself (noop jobs never fetch it; the URL only has to be valid). Every
worker pulls every target: 3 consumers (tiers) per target, so 3K pull loops per worker.

Per K the bench measures, before any job: the idle CPU the fleet burns per second with K
targets, and how long one ``fleet_status`` (what ``jetfleet status`` and ``/v1/status``
compute) takes. Then it submits N/K jobs per target, interleaved across targets (256
publishes in flight), and counts jobs/s from the first submit to the last
CommittedResult seen on ``jf.results.>`` (as bench/run.py does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import msgspec  # noqa: E402
from harness import fmt_table, run_with_tree  # noqa: E402
from jetfleet_bench import _decode_head, _wait_ready  # noqa: E402
from stats import latency_summary, process_usage, scan_logs  # noqa: E402

from jetfleet.client import jobs_for, submit_jobs  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.devstack import DevStack  # noqa: E402
from jetfleet.settings_file import toml_tables  # noqa: E402
from jetfleet.simulator import TargetSimulator  # noqa: E402
from jetfleet.status import fleet_status  # noqa: E402
from jetfleet.topology import declare  # noqa: E402

IN_FLIGHT = 256
IDLE_MEASURE_S = 5.0
TIMEOUT_S = 600.0


def target_names(k: int) -> list[str]:
    return ["demo", *(f"t{i:03d}" for i in range(1, k))]


def _cpu(pids: dict[str, int | None]) -> dict[str, float]:
    return {k: (process_usage(v) or {}).get("cpu_s", 0.0) for k, v in pids.items()}


async def run_case(k: int, jobs: int, workers: int, keep: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"jetfleet-bench-targets{k}-"))
    sim = TargetSimulator()
    result: dict[str, Any] = {"targets": k, "jobs": jobs, "workers": workers}
    stack: DevStack | None = None
    nc = None
    try:
        base = await sim.start()
        names = target_names(k)
        user = folder / "bench-user.toml"
        user.write_text(
            toml_tables(
                {
                    f"targets.{name}": {
                        "base_url": base + "/",
                        "rate": 500.0,
                        "burst": 100,
                        "max_in_flight": 64,
                        "timeout_s": 10.0,
                    }
                    for name in names
                    if name != "demo"
                }
            )
        )
        stack = DevStack(folder / "stack", workers=workers, user_config=user)
        await asyncio.wait_for(stack.start(), 120.0)
        result["ready_s"] = await _wait_ready(stack, 120.0)
        assert stack.settings is not None
        settings = stack.settings
        assert sorted(settings.targets) == sorted(names), sorted(settings.targets)
        nc = await connect_nats(settings.nats, "bench-targets")
        js = nc.jetstream()
        await declare(js, settings)

        pids: dict[str, int | None] = {n: p.pid for n, p in stack.children.items()}
        pids["nats-server"] = stack.nats.process.pid if stack.nats.process else None
        pids["bench"] = os.getpid()

        # Idle cost: what K targets cost with nothing to do (pull loops polling).
        await asyncio.sleep(2.0)
        c0, t0 = _cpu(pids), time.monotonic()
        await asyncio.sleep(IDLE_MEASURE_S)
        c1, t1 = _cpu(pids), time.monotonic()
        result["idle_cpu_pct"] = {k_: 100.0 * (c1[k_] - c0[k_]) / (t1 - t0) for k_ in pids}
        started = time.perf_counter()
        await fleet_status(js, settings)
        result["status_ms_idle"] = 1000.0 * (time.perf_counter() - started)

        arrived: dict[str, float] = {}
        submitted: dict[str, float] = {}
        dups = 0

        async def on_result(msg: Any) -> None:
            nonlocal dups
            now = time.monotonic()
            job_id = _decode_head(msg.data).job_id
            if job_id in arrived:
                dups += 1
            else:
                arrived[job_id] = now

        sub = await nc.subscribe(
            "jf.results.>",
            cb=on_result,
            pending_msgs_limit=max(65536, 4 * jobs),
            pending_bytes_limit=256 * 1024 * 1024,
        )
        await nc.flush()

        per = jobs // k
        batches = {
            name: jobs_for(
                name, settings, [f"/page/{i * per + n}" for n in range(per)], handler="noop"
            )
            for i, name in enumerate(names)
        }
        # Interleaved: job n of every target, then job n+1 of every target, ...
        order = [(name, batches[name][n]) for n in range(per) for name in names]
        total = len(order)
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def submit_one(name: str, job: Any) -> None:
            async with gate:
                submitted[job.id] = time.monotonic()
                await submit_jobs(js, settings, name, [job])

        cpu0 = _cpu(pids)
        first = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(submit_one(n, j) for n, j in order)), TIMEOUT_S)
        submit_s = time.monotonic() - first
        stop = "all committed"
        while len(arrived) < total:
            if time.monotonic() > first + TIMEOUT_S:
                stop = "timeout"
                break
            if stack.dead_children():
                stop = "a child died"
                break
            await asyncio.sleep(0.05)
        cpu1 = _cpu(pids)
        await asyncio.sleep(0.5)
        await sub.unsubscribe()
        last = max(arrived.values()) if arrived else time.monotonic()
        elapsed = last - first
        started = time.perf_counter()
        status = await fleet_status(js, settings)
        result["status_ms_end"] = 1000.0 * (time.perf_counter() - started)
        result.update(
            {
                "jobs": total,
                "committed": len(arrived),
                "duplicates": dups,
                "stop_reason": stop,
                "submit_s": submit_s,
                "elapsed_s": elapsed,
                "jobs_per_s": len(arrived) / elapsed if elapsed > 0 else 0.0,
                "latency": latency_summary(arrived[j] - submitted[j] for j in arrived),
                "cpu_s_during_run": {k_: cpu1[k_] - cpu0[k_] for k_ in pids},
                "status_at_end": msgspec.structs.asdict(status.totals),
                "rss_mib": {k_: (process_usage(v) or {}).get("rss_mib") for k_, v in pids.items()},
            }
        )
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 10.0)
        logs: list[Path] = []
        if stack is not None:
            logs = [*sorted((stack.data_dir / "logs").glob("*.log")), stack.nats.log_path]
            try:
                await stack.stop()
            except Exception as exc:
                result.setdefault("error", f"stop failed: {exc}")
        await sim.stop()
        result["log_problems"] = scan_logs(logs)
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    return result


def render(results: list[dict[str, Any]]) -> str:
    header = [
        "targets",
        "jobs",
        "committed",
        "submit s",
        "elapsed s",
        "jobs/s",
        "p50 ms",
        "p99 ms",
        "status ms idle/end",
        "idle CPU % (all procs)",
        "log problems",
    ]
    rows = []
    for r in results:
        lat = r.get("latency") or {}
        idle = r.get("idle_cpu_pct") or {}
        rows.append(
            [
                r["targets"],
                r.get("jobs"),
                r.get("committed"),
                r.get("submit_s"),
                r.get("elapsed_s"),
                r.get("jobs_per_s"),
                lat.get("p50_ms"),
                lat.get("p99_ms"),
                f"{r.get('status_ms_idle', 0):.0f} / {r.get('status_ms_end', 0):.0f}",
                sum(idle.values()) if idle else None,
                sum(v["count"] for v in r.get("log_problems", {}).values()),
            ]
        )
    out = [fmt_table(header, rows), ""]
    for r in results:
        if r.get("idle_cpu_pct"):
            out.append(
                f"{r['targets']} targets, idle CPU %: "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["idle_cpu_pct"].items())
            )
        if r.get("cpu_s_during_run"):
            out.append(
                f"{r['targets']} targets, CPU s during the run: "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_s_during_run"].items())
            )
        if r.get("log_problems"):
            out.append(f"{r['targets']} targets, log problems: {r['log_problems']}")
        if r.get("error"):
            out.append(f"{r['targets']} targets: ERROR {r['error']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="1,10,100", help="target counts (1,10,100)")
    parser.add_argument("--jobs", type=int, default=3000, help="total noop jobs (3000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = []
    for k in [int(x) for x in args.targets.split(",") if x.strip()]:
        print(f"targets case: {k} targets, {args.jobs} jobs...", file=sys.stderr, flush=True)
        results.append(asyncio.run(run_case(k, args.jobs, args.workers, args.keep)))
    print(json.dumps(results, indent=2, default=str) if args.json else render(results))
    return 1 if any(r.get("error") or r.get("committed") != r.get("jobs") for r in results) else 0


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
