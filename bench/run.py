"""Issue 13's one table: jetfleet against the raw floor and its peers, in one run.

    python -m bench [--jobs N] [--workers W] [--only NAME,...] [--skip NAME,...]
                    [--memory] [--json]                 (also: python bench/run.py; make bench)

Each scenario runs on its own fresh servers in a temp folder, one after the other, and
reports the CPU its own processes used while it ran:

    floor-batched          raw nats-py: publish N (256 PubAcks awaited at once), then pull
                           200 at a time and ack; one process (bench/floor_bench.py)
    floor-flow             raw nats-py per job: W consumer processes, 8 pull loops each,
                           fetch one, ack it, while the producer publishes (the floor the
                           0.3x target is judged against; bench/floor_bench.py says why)
    jetfleet-noop          the full path: DevStack (every service, W workers), N ``noop``
                           jobs, submit -> CommittedResult (lease, fenced commit, ack)
    jetfleet-noop-nolease  the same with ``fleet.leases = false`` (the unfenced direct path)
    arq-noop               arq 0.28 with its defaults (max_jobs 10, poll_delay 0.5 s), W
                           worker processes, a no-op task, on an embedded redis-server
    arq-noop-tuned         the same with poll_delay 0.01 s (the only change)
    celery-noop            Celery, prefork pool with concurrency W, Redis broker on the same
                           kind of redis-server, a no-op task; worker running as jobs are
                           enqueued (bench/celery_bench.py)
    celery-noop-drain      the same, all N enqueued first, then the worker started
    latency                jetfleet at a steady half of jetfleet-noop's jobs/s (this run's),
                           submit -> commit p50/p99, beside the raw publish -> fetch -> ack
                           round trip at the same rate (bench/latency_bench.py)
    fleet-leases           10,000 simulated workers holding and renewing leases against 1
                           and 2 leaser replicas (bench/fleet_leases_bench.py)

and, only when asked for:

    jetfleet-http          jetfleet-noop with ``http.get`` on the target simulator (--only)
    memory                 1,000,000 jobs queued, RSS of every service at 10k, 100k and 1M,
                           status time (bench/queue_memory_bench.py; --memory; slow)

Then one table (jobs/s, latency p50/p99, CPU ms per job, CPU seconds per process) and
the ratios against issue 13's targets, each with PASS or FAIL. arq or Celery missing:
their rows say so, with the pip command. Use the venv's Python (the one jetfleet is
installed in): DevStack starts its children with ``sys.executable -m jetfleet``.
docs/benchmarks.md says what each figure means and how each peer is configured.

Standalone benchmarks of single paths live next to this file, each run as
``python bench/<name>.py`` (``--help`` for options): lease_bench.py, dlq_bench.py,
targets_bench.py, admission_bench.py, ratelimit_bench.py, smoke_bench.py
(``make bench-smoke``), and the scenario modules named above.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench/ is not a package: its modules import each other flat
    sys.path.insert(0, str(HERE))

from harness import fmt_table  # noqa: E402

DEFAULT_SCENARIOS = (
    "floor-batched",
    "floor-flow",
    "jetfleet-noop",
    "jetfleet-noop-nolease",
    "arq-noop",
    "arq-noop-tuned",
    "celery-noop",
    "celery-noop-drain",
    "latency",
    "fleet-leases",
)
SCENARIOS = (*DEFAULT_SCENARIOS, "jetfleet-http", "memory")
DEFAULT_JOBS = 5000
DEFAULT_HTTP_JOBS = 2000
TUNED_POLL_DELAY_S = 0.01
PEERS = {"arq": "pip install arq", "celery": "pip install 'celery<5.7' 'kombu<5.7'"}
# Issue 13's targets.
ARQ_RATIO_TARGET = 1.5
FLOOR_RATIO_TARGET = 0.3
MEMORY_MARKS = (10_000, 100_000, 1_000_000)


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help=f"jobs per throughput scenario ({DEFAULT_JOBS})",
    )
    parser.add_argument(
        "--http-jobs", type=int, default=DEFAULT_HTTP_JOBS, help="jobs for jetfleet-http"
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--only", default="", help=f"comma-separated scenarios, of: {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--skip", default="", help="comma-separated scenarios to leave out")
    parser.add_argument(
        "--memory", action="store_true", help="also run the memory scenario (slow: 1M jobs)"
    )
    parser.add_argument(
        "--memory-jobs", type=int, default=MEMORY_MARKS[-1], help="jobs queued by memory"
    )
    parser.add_argument(
        "--latency-s", type=float, default=10.0, help="seconds of paced submits (latency)"
    )
    parser.add_argument(
        "--peak",
        type=float,
        default=None,
        help="latency: jobs/s to halve (default: this run's jetfleet-noop, else measured)",
    )
    parser.add_argument(
        "--fleet-workers", type=int, default=10_000, help="simulated workers (fleet-leases)"
    )
    parser.add_argument(
        "--lease-replicas", default="1,2", help="leaser replicas, one case each (1,2)"
    )
    parser.add_argument("--lease-rounds", type=int, default=3, help="renewals per worker (3)")
    parser.add_argument(
        "--lease-ttl", type=float, default=None, help="fleet.lease_ttl_s (default: the settings')"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="give up on one scenario after this (s)"
    )
    parser.add_argument(
        "--arq-max-jobs", type=int, default=10, help="arq max_jobs per worker (arq default 10)"
    )
    parser.add_argument("--keep", action="store_true", help="keep each scenario's temp folder")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(DEFAULT_SCENARIOS)
    if names == ["all"]:
        names = list(SCENARIOS)
    if args.memory and "memory" not in names:
        names.append("memory")
    skip = [n.strip() for n in args.skip.split(",") if n.strip()]
    unknown = sorted(set(names + skip) - set(SCENARIOS))
    if unknown:
        parser.error(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}"
        )
    if min(args.workers, args.jobs, args.http_jobs, args.fleet_workers, args.lease_rounds) < 1:
        parser.error("--jobs, --http-jobs, --workers, --fleet-workers, --lease-rounds: >= 1")
    args.names = [n for n in names if n not in skip]
    return args


def _missing_peer(name: str) -> str | None:
    """Why a peer scenario cannot run here (its package is not installed), or None."""
    for peer, command in PEERS.items():
        if name.startswith(peer) and _installed(peer) is None:
            return f"skipped: {peer} is not installed ({command})"
    return None


def _run(name: str, args: argparse.Namespace, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run one scenario to its figures (each module never leaves a process behind)."""
    jobs, workers, timeout, keep = args.jobs, args.workers, args.timeout, args.keep
    if name == "floor-batched":
        from floor_bench import batched_floor

        return asyncio.run(batched_floor(jobs))
    if name == "floor-flow":
        from floor_bench import flow_floor

        return asyncio.run(flow_floor(jobs, workers, timeout_s=timeout))
    if name.startswith("jetfleet"):
        from jetfleet_bench import run_jetfleet

        handler = "http.get" if name == "jetfleet-http" else "noop"
        n = args.http_jobs if name == "jetfleet-http" else jobs
        leases = name != "jetfleet-noop-nolease"
        return asyncio.run(run_jetfleet(handler, n, workers, timeout, keep=keep, leases=leases))
    if name.startswith("arq"):
        from arq_bench import run_arq

        poll = TUNED_POLL_DELAY_S if name == "arq-noop-tuned" else 0.5
        return asyncio.run(
            run_arq(jobs, workers, timeout, max_jobs=args.arq_max_jobs, poll_delay=poll, keep=keep)
        )
    if name.startswith("celery"):
        from celery_bench import run_celery

        mode = "drain" if name.endswith("drain") else "live"
        return asyncio.run(run_celery(jobs, workers, timeout, mode=mode, keep=keep))
    if name == "latency":
        from latency_bench import latency_at_half_peak

        peak = args.peak or (done.get("jetfleet-noop") or {}).get("jobs_per_s")
        return asyncio.run(latency_at_half_peak(peak, workers, args.latency_s, keep))
    if name == "fleet-leases":
        from fleet_leases_bench import quiet_console, run_cases

        quiet_console()
        replicas = [int(x) for x in args.lease_replicas.split(",") if x.strip()]
        cases = run_cases(
            args.fleet_workers, replicas, args.lease_rounds, args.lease_ttl, None, keep, quiet=True
        )
        return {"cases": cases}
    if name == "memory":
        from queue_memory_bench import memory_summary
        from queue_memory_bench import run as run_memory

        marks = [m for m in MEMORY_MARKS if m < args.memory_jobs] + [args.memory_jobs]
        r = asyncio.run(run_memory(args.memory_jobs, 900.0, 1024, marks, 0.0, keep))
        r["summary"] = memory_summary(r)
        return r
    raise ValueError(name)


def _version(argv: list[str], pattern: str) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    match = re.search(pattern, out.stdout + out.stderr)
    return match.group(1) if match else (out.stdout + out.stderr).strip()[:80]


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import psutil

    from jetfleet.dev.embedded import find_nats_server, find_redis_server

    peers = {name: _installed(name) for name in ("arq", "celery", "kombu", "redis", "nats-py")}
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu_model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nats_server": _version([str(find_nats_server()), "--version"], r"(v\d+\.\d+\.\d+)"),
        "redis_server": _version([str(find_redis_server()), "--version"], r"v=(\S+)"),
        **peers,
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}" if abs(value) >= 10 or digits == 0 else f"{value:.2f}"
    return str(value)


def _cpu_cells(processes: dict[str, Any] | None, count: int | None) -> tuple[str, str, str]:
    """CPU ms per job of the system under test, the same with the load generator, and
    each process's CPU seconds (its own window) as one cell."""
    if not processes:
        return "-", "-", "-"
    own = {k: (v or {}).get("cpu_s") for k, v in processes.items()}
    system = sum(v for k, v in own.items() if v is not None and not k.startswith("bench"))
    total = sum(v for v in own.values() if v is not None)
    per = (lambda s: _fmt(1000.0 * s / count)) if count else (lambda s: "-")
    each = ", ".join(f"{k} {v:.2f}" for k, v in own.items() if v is not None)
    return per(system), per(total), each


def _row(name: str, r: dict[str, Any]) -> list[str]:
    lat = r.get("latency") or {}
    cpu_sys, cpu_all, each = _cpu_cells(r.get("processes"), r.get("committed"))
    note = r.get("skipped") or r.get("error") or ""
    if not note and (r.get("lost") or r.get("duplicates")):
        note = f"LOST {r.get('lost')} / duplicates {r.get('duplicates')}"
    return [
        name,
        _fmt(r.get("jobs")),
        _fmt(r.get("committed")),
        _fmt(r.get("jobs_per_s"), 0),
        _fmt(lat.get("p50_ms")),
        _fmt(lat.get("p99_ms")),
        cpu_sys,
        cpu_all,
        each,
        note,
    ]


def _lease_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for c in r.get("cases") or []:
        renew = c.get("renew") or {}
        cpu = c.get("cpu_ms_per_renewal") or {}
        system = sum(v for k, v in cpu.items() if not k.startswith("bench"))
        note = c.get("error") or (
            f"spurious losses {c.get('spurious_losses')}, unanswered "
            f"{c.get('unanswered_renewals')}, live after {c.get('live_leases_after')}"
        )
        if c.get("stop_reason") not in (None, "every worker renewed its rounds"):
            note = f"STOPPED EARLY: {c['stop_reason']}; {note}"
        rows.append(
            [
                f"fleet-leases {c['workers']} x{c['replicas']} leaser",
                _fmt(c.get("renewals")),
                _fmt(c.get("renewals")),
                _fmt(c.get("renewals_per_s"), 0),
                _fmt(renew.get("p50_ms")),
                _fmt(renew.get("p99_ms")),
                _fmt(system) if cpu else "-",
                _fmt(sum(cpu.values())) if cpu else "-",
                ", ".join(f"{k} {v:.3f} ms" for k, v in cpu.items()),
                note,
            ]
        )
    return rows


def _latency_rows(r: dict[str, Any]) -> list[list[str]]:
    if r.get("skipped") or (r.get("error") and not r.get("jetfleet")):
        return [["latency", *["-"] * 8, r.get("skipped") or r.get("error") or ""]]
    rate = r.get("rate_per_s") or 0.0
    rows = []
    for key, label in (("jetfleet", "submit -> commit"), ("raw", "publish -> ack confirmed")):
        row = _row(f"latency {key} @ {rate:.0f}/s", r.get(key) or {})
        row[-1] = row[-1] or label
        rows.append(row)
    return rows


def _memory_rows(r: dict[str, Any]) -> list[list[str]]:
    s = r.get("summary") or {}
    note = r.get("error") or (
        f"largest service {_fmt(s.get('largest_service_mb'))} MB, slowest status "
        f"{_fmt(s.get('slowest_status_ms'))} ms"
    )
    cpu_sys, cpu_all, each = _cpu_cells(_memory_cpu(r), r.get("queued_at_end"))
    return [
        [
            f"memory: {r.get('jobs')} queued",
            _fmt(r.get("published")),
            _fmt(r.get("queued_at_end")),
            _fmt(r.get("admit_per_s"), 0),
            "-",
            "-",
            cpu_sys,
            cpu_all,
            each,
            note,
        ]
    ]


def _memory_cpu(r: dict[str, Any]) -> dict[str, Any] | None:
    marks = r.get("marks_reached") or {}
    first, last = marks.get("0"), marks.get("end")
    if not first or not last or not first.get("cpu_s") or not last.get("cpu_s"):
        return None
    return {
        k: {"cpu_s": (last["cpu_s"].get(k) or 0.0) - (v or 0.0)} for k, v in first["cpu_s"].items()
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    """One row per scenario (two for latency, one per case for fleet-leases)."""
    rows: list[list[str]] = []
    for name, r in results.items():
        if name == "fleet-leases" and not r.get("skipped"):
            rows += _lease_rows(r)
        elif name == "latency":
            rows += _latency_rows(r)
        elif name == "memory" and not r.get("skipped"):
            rows += _memory_rows(r)
        else:
            rows.append(_row(name, r))
    header = [
        "scenario",
        "jobs",
        "done",
        "jobs/s",
        "p50 ms",
        "p99 ms",
        "CPU ms/job",
        "+load gen",
        "CPU s per process (its own window)",
        "note",
    ]
    return fmt_table(header, rows)


def _verdict(ok: bool | None) -> str:
    return "not run" if ok is None else "PASS" if ok else "FAIL"


def targets(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 13's targets, each measured in this run, with its verdict."""
    from fleet_leases_bench import RENEW_P99_TARGET_MS
    from latency_bench import P50_TARGET, P99_TARGET
    from queue_memory_bench import SERVICE_LIMIT_MB, STATUS_LIMIT_MS

    def jps(name: str) -> float | None:
        r = results.get(name) or {}
        # A run that lost jobs still measured its rate (completed jobs only); its row
        # in the table says LOST.
        return None if r.get("error") or r.get("skipped") else r.get("jobs_per_s")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    full = jps("jetfleet-noop")
    out: list[dict[str, Any]] = []

    def add(what: str, value: float | None, target: str, ok: bool | None) -> None:
        verdict = _verdict(ok) if target != "-" else "info" if value is not None else "not run"
        out.append({"what": what, "value": value, "target": target, "verdict": verdict})

    r = ratio(full, jps("arq-noop-tuned"))
    add(
        "full path / arq tuned, jobs/s",
        r,
        f">= {ARQ_RATIO_TARGET}",
        None if r is None else r >= ARQ_RATIO_TARGET,
    )
    r = ratio(full, jps("floor-flow"))
    add(
        "full path / per-job flow floor",
        r,
        f">= {FLOOR_RATIO_TARGET}",
        None if r is None else r >= FLOOR_RATIO_TARGET,
    )
    r = ratio(full, jps("floor-batched"))
    add("full path / batched floor (no target)", r, "-", None if r is None else True)
    r = ratio(full, jps("celery-noop"))
    add("full path / celery (live), no target", r, "-", None if r is None else True)
    lat = (results.get("latency") or {}).get("ratios") or {}
    p50, p99 = lat.get("p50_ms"), lat.get("p99_ms")
    add(
        "latency @ half peak: p50 / raw p50",
        p50,
        f"<= {P50_TARGET:g}",
        None if p50 is None else p50 <= P50_TARGET,
    )
    add(
        "latency @ half peak: p99 / raw p99",
        p99,
        f"<= {P99_TARGET:g}",
        None if p99 is None else p99 <= P99_TARGET,
    )
    for c in (results.get("fleet-leases") or {}).get("cases") or []:
        label = f"{c['workers']} workers, {c['replicas']} leaser(s)"
        losses = None if c.get("error") else c.get("spurious_losses")
        add(
            f"{label}: spurious lease losses",
            losses,
            "0",
            None if losses is None else losses == 0 and c.get("live_leases_after") == c["workers"],
        )
        p99r = None if c.get("error") else (c.get("renew") or {}).get("p99_ms")
        add(
            f"{label}: renew p99 ms",
            p99r,
            f"< {RENEW_P99_TARGET_MS:g}",
            None if p99r is None else p99r < RENEW_P99_TARGET_MS,
        )
    if not (results.get("fleet-leases") or {}).get("cases"):
        add("10k workers: no spurious loss, renew p99 < 250 ms", None, "0 / < 250", None)
    mem = (results.get("memory") or {}).get("summary")
    if mem:
        add(
            "memory: largest service RSS, MB",
            mem.get("largest_service_mb"),
            f"< {SERVICE_LIMIT_MB:g}",
            mem.get("largest_service_mb") is not None
            and mem["largest_service_mb"] < SERVICE_LIMIT_MB,
        )
        add(
            "memory: slowest status read, ms",
            mem.get("slowest_status_ms"),
            f"< {STATUS_LIMIT_MS:g}",
            mem.get("slowest_status_ms") is not None and mem["slowest_status_ms"] < STATUS_LIMIT_MS,
        )
        add(
            "memory: services' growth, first mark to last, MB",
            max(mem.get("growth_mb", {}).values(), default=None),
            "-",
            None,
        )
        add(
            "memory: `jetfleet status` CLI incl. Python start-up, ms",
            max(mem.get("cli_status_ms") or [], default=None),
            "-",
            None,
        )
    else:
        add("memory: services < 150 MB, status < 1 s", None, "--memory", None)
    return out


def targets_text(rows: list[dict[str, Any]]) -> str:
    cells = [[r["what"], _fmt(r["value"], 2), r["target"], r["verdict"]] for r in rows]
    return fmt_table(["target (issue 13)", "this run", "target", "verdict"], cells)


def memory_text(r: dict[str, Any]) -> str:
    s = r.get("summary") or {}
    rss = s.get("rss_mb_at_mark") or {}
    if not rss:
        return ""
    procs = list(next(iter(rss.values())))
    rows = [[label, *(_fmt(m.get(p)) for p in procs)] for label, m in rss.items()]
    growth = ", ".join(f"{k} {v:+.1f}" for k, v in (s.get("growth_mb") or {}).items())
    return (
        "memory: RSS MB when status first showed each mark queued\n"
        + fmt_table(["queued", *procs], rows)
        + f"\nservices' growth from the first mark to the last, MB: {growth}"
        + f"\n`jetfleet status` (a new process) at the end, ms: {s.get('cli_status_ms')}"
    )


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        import jetfleet  # noqa: F401
    except ImportError:
        print("jetfleet is not importable: run this with the venv's python", file=sys.stderr)
        return 2
    from stats import process_usage
    from tree_state import tree_state

    info = machine()
    info["command"] = " ".join([Path(sys.executable).name, "-m", "bench", *sys.argv[1:]])
    info["tree_before"] = tree_state()
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for name in args.names:
        skipped = _missing_peer(name)
        if skipped:
            results[name] = {"skipped": skipped}
            _say(args, f"{name}: {skipped}")
            continue
        _say(args, f"running {name}...")
        t0 = time.monotonic()
        before = process_usage(os.getpid())
        try:
            results[name] = _run(name, args, results)
        except Exception as exc:  # one scenario's failure must not lose the others'
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        after = process_usage(os.getpid())
        r = results[name]
        r["scenario_s"] = time.monotonic() - t0
        procs = r.get("processes")
        if (
            before
            and after
            and isinstance(procs, dict)
            and not any(k.startswith("bench") for k in procs)
        ):
            # The load generator (and, for jetfleet, the in-process target simulator).
            procs["bench (this process)"] = {
                "rss_mib": after["rss_mib"],
                "cpu_s": after["cpu_s"] - before["cpu_s"],
            }
        _say(
            args,
            f"  {name} done in {r['scenario_s']:.0f} s"
            + (f": {r['error']}" if r.get("error") else ""),
        )
    info["tree_after"] = tree_state()
    info["total_s"] = time.monotonic() - started
    goals = targets(results)
    failed = any(r.get("error") or r.get("lost") for r in results.values() if not r.get("skipped"))
    if args.json:
        out = {"machine": info, "results": results, "targets": goals}
        print(json.dumps(_json_safe(out), indent=2, default=str))
        return 1 if failed else 0
    from harness import tree_lines

    shown = {k: v for k, v in info.items() if not k.startswith("tree_") and k != "total_s"}
    print("machine: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    print(tree_lines(info["tree_before"], info["tree_after"]))
    print(
        f"whole run: {info['total_s']:.0f} s, {args.jobs} jobs per throughput scenario, "
        f"{args.workers} workers"
    )
    print()
    print(table(results))
    print()
    print(targets_text(goals))
    if "memory" in results:
        print()
        print(memory_text(results["memory"]))
    for name, r in results.items():
        for log_name, found in (r.get("log_problems") or {}).items():
            print(f"\n{name}: {found['count']} problem line(s) in {log_name}, first:")
            for line in found["first"]:
                print(f"  {line}")
        for c in r.get("cases") or []:
            for log_name, found in (c.get("log_problems") or {}).items():
                head = f"{name} x{c['replicas']}: {found['count']} problem line(s) in {log_name}"
                print(f"\n{head}, first:")
                for line in found["first"]:
                    print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
