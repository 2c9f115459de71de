"""Benchmark jetfleet end to end against a peer (arq), all on loopback, in one run.

    python bench/run.py [--jobs N] [--workers N] [--only NAME[,NAME]] [--json]

Scenarios, run one after the other, each on its own fresh servers in a temp folder:

    jetfleet-noop   DevStack, W workers, N ``noop`` jobs (default 5000)
    jetfleet-http   DevStack, W workers, N ``http.get`` jobs on the simulator (default 2000)
    arq-noop        arq with its default worker settings, W workers, N no-op jobs (5000)
    arq-noop-tuned  arq with poll_delay 0.01 s (default 0.5 s), otherwise the same

and, only when named with --only:

    jetfleet-noop-nolease  jetfleet-noop with ``fleet.leases = false`` (the unfenced
                           baseline the leasing issue compares against)

Use the venv's Python (the one jetfleet is installed in): DevStack starts its children
with ``sys.executable -m jetfleet``. arq is optional: ``pip install arq``. See
docs/benchmarks.md for what each figure means.

Standalone benchmarks of single paths live next to this file, each run as
``python bench/<name>.py`` (``--help`` for options):

    lease_bench.py         lease grant and renew latency with 1,000 leases held
    dlq_bench.py           what a dead letter costs next to a commit (sink micro + end to end)
    targets_bench.py       throughput with 1, 10 and 100 targets
    queue_memory_bench.py  RSS of every process with up to 1,000,000 queued jobs
    ratelimit_bench.py     permit decisions/s per ratelimit replica, observed rate against cap
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench/ is not a package: its modules import each other flat
    sys.path.insert(0, str(HERE))

from harness import fmt_table  # noqa: E402

DEFAULT_SCENARIOS = ("jetfleet-noop", "jetfleet-http", "arq-noop", "arq-noop-tuned")
SCENARIOS = (*DEFAULT_SCENARIOS, "jetfleet-noop-nolease")
DEFAULT_JOBS = {
    "jetfleet-noop": 5000,
    "jetfleet-http": 2000,
    "arq-noop": 5000,
    "arq-noop-tuned": 5000,
    "jetfleet-noop-nolease": 5000,
}
TUNED_POLL_DELAY_S = 0.01


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="jobs per scenario (default: 5000, and 2000 for jetfleet-http)",
    )
    parser.add_argument(
        "--http-jobs",
        type=int,
        default=None,
        help="jobs for jetfleet-http only (overrides --jobs for it)",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated scenarios to run, of: "
        f"{', '.join(SCENARIOS)}; or all (default: all but the last)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="give up waiting for one scenario after this many seconds",
    )
    parser.add_argument(
        "--arq-max-jobs", type=int, default=10, help="arq max_jobs per worker (arq default 10)"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep each scenario's temp folder (logs) instead of deleting it",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(DEFAULT_SCENARIOS)
    if names == ["all"]:
        names = list(SCENARIOS)
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}"
        )
    if args.workers < 1 or (args.jobs is not None and args.jobs < 1):
        parser.error("--jobs and --workers must be at least 1")
    args.names = names
    return args


def _jobs_for(name: str, args: argparse.Namespace) -> int:
    if name == "jetfleet-http" and args.http_jobs is not None:
        return int(args.http_jobs)
    return int(args.jobs) if args.jobs is not None else DEFAULT_JOBS[name]


def _scenario(name: str, args: argparse.Namespace) -> Callable[[], Coroutine[Any, Any, Any]]:
    jobs, workers, timeout = _jobs_for(name, args), args.workers, args.timeout
    if name.startswith("jetfleet"):
        from jetfleet_bench import run_jetfleet

        handler = "http.get" if name == "jetfleet-http" else "noop"
        leases = name != "jetfleet-noop-nolease"
        return lambda: run_jetfleet(handler, jobs, workers, timeout, keep=args.keep, leases=leases)

    def run_arq_scenario() -> Coroutine[Any, Any, Any]:
        from arq_bench import run_arq

        poll = TUNED_POLL_DELAY_S if name == "arq-noop-tuned" else 0.5
        return run_arq(
            jobs, workers, timeout, max_jobs=args.arq_max_jobs, poll_delay=poll, keep=args.keep
        )

    return run_arq_scenario


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

    try:
        import arq

        arq_version = arq.VERSION
    except ImportError:
        arq_version = None
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
        "arq": arq_version,
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def table(results: dict[str, dict[str, Any]]) -> str:
    """The scenarios side by side, one row per figure."""
    names = list(results)
    rows: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("handler", lambda r: r.get("handler")),
        ("workers", lambda r: r.get("workers")),
        ("leases", lambda r: r.get("leases")),
        ("jobs submitted", lambda r: r.get("jobs")),
        ("completed", lambda r: r.get("committed")),
        ("dead / rejected", lambda r: f"{r.get('dead', '-')} / {r.get('rejected', '-')}"),
        ("lost (no terminal state)", lambda r: r.get("lost")),
        ("duplicates seen", lambda r: r.get("duplicates")),
        ("submit/enqueue time s", lambda r: r.get("submit_s")),
        ("first submit -> last done s", lambda r: r.get("elapsed_s")),
        ("jobs/s", lambda r: r.get("jobs_per_s")),
        ("latency p50 ms", lambda r: r.get("latency", {}).get("p50_ms")),
        ("latency p90 ms", lambda r: r.get("latency", {}).get("p90_ms")),
        ("latency p99 ms", lambda r: r.get("latency", {}).get("p99_ms")),
        ("latency max ms", lambda r: r.get("latency", {}).get("max_ms")),
        ("to task start p50 ms", lambda r: r.get("latency_to_start", {}).get("p50_ms")),
        ("to task start p99 ms", lambda r: r.get("latency_to_start", {}).get("p99_ms")),
    ]
    rows += [
        ("target requests", lambda r: (r.get("target") or {}).get("requests")),
        ("target max req in any 1 s", lambda r: (r.get("target") or {}).get("max_in_any_1s")),
        (
            "target configured rate/s",
            lambda r: (r.get("target") or {}).get("configured_rate_per_s"),
        ),
    ]
    procs: list[str] = []
    for r in results.values():
        for p in r.get("processes") or {}:
            if p not in procs:
                procs.append(p)
    for p in procs:
        rows.append(
            (
                f"RSS MiB {p}",
                lambda r, p=p: ((r.get("processes") or {}).get(p) or {}).get("rss_mib"),
            )
        )
    for p in procs:
        rows.append(
            (f"CPU s {p}", lambda r, p=p: ((r.get("processes") or {}).get(p) or {}).get("cpu_s"))
        )
    rows.append(
        ("log problem lines", lambda r: sum(v["count"] for v in r.get("log_problems", {}).values()))
    )
    rows.append(("stopped waiting because", lambda r: r.get("stop_reason")))
    rows.append(("error", lambda r: r.get("error")))
    cells = [[label] + [_fmt(get(results[n])) for n in names] for label, get in rows]
    return fmt_table(["figure", *names], cells)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


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
    info["tree_before"] = tree_state()
    results: dict[str, dict[str, Any]] = {}
    for name in args.names:
        if name.startswith("arq") and info["arq"] is None:
            results[name] = {"system": "arq", "error": "arq is not installed (pip install arq)"}
            continue
        if not args.json:
            print(
                f"running {name} ({_jobs_for(name, args)} jobs, {args.workers} workers)...",
                file=sys.stderr,
                flush=True,
            )
        before = process_usage(os.getpid())
        results[name] = asyncio.run(_scenario(name, args)())
        after = process_usage(os.getpid())
        if before and after and results[name].get("processes") is not None:
            # The load generator (and, for jetfleet, the in-process target simulator).
            results[name]["processes"]["bench (this process)"] = {
                "rss_mib": after["rss_mib"],
                "cpu_s": after["cpu_s"] - before["cpu_s"],
            }
        if not args.json:
            r = results[name]
            print(
                f"  {name}: {_fmt(r.get('jobs_per_s'))} jobs/s, "
                f"p50 {_fmt(r.get('latency', {}).get('p50_ms'))} ms"
                + (f", ERROR {r['error']}" if r.get("error") else ""),
                file=sys.stderr,
                flush=True,
            )
    info["tree_after"] = tree_state()
    failed = any(r.get("error") or r.get("lost") for r in results.values())
    if args.json:
        print(json.dumps(_json_safe({"machine": info, "results": results}), indent=2))
    else:
        from harness import tree_lines

        shown = {k: v for k, v in info.items() if not k.startswith("tree_")}
        print("machine: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
        print(tree_lines(info["tree_before"], info["tree_after"]))
        print(table(results))
        for name, r in results.items():
            for log_name, found in (r.get("log_problems") or {}).items():
                print(f"\n{name}: {found['count']} problem line(s) in {log_name}, first:")
                for line in found["first"]:
                    print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
