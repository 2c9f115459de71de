"""Rate limits: permit decisions/s and observed rate against cap (issue 9's figures).

    python bench/ratelimit_bench.py [--part decisions,caps] [--json] ...

Two parts, each on its own fresh servers in a temp folder, all on 127.0.0.1:

``decisions``  For each mode (``inproc``: ``RateLimiter`` objects in this process, each on
    its own NATS connection; ``process``: ``jetfleet serve ratelimit`` children) and each
    replica count (1, 2): an embedded nats-server and redis-server, the replicas in the
    ``ratelimit`` queue group, and a ``PermitClient`` sending ``--permits`` PermitRequests
    with C callers in flight (``--concurrency``) to two targets: ``open`` (10^6/s, burst
    1000: every permit is allowed) and ``capped`` (10/s, burst 1: nearly every answer is
    ``wait``). Beside them, on the same redis-server, the permit script alone:
    ``RateCells.permit`` (one EVALSHA) from this process, same callers, same two limits.
``caps``  Per cap (1, 10, 100 requests/s, burst ``--burst``): a ``DevStack`` (every
    service as a child, 2 workers, the simulator as target ``demo``), the demo target's
    limit set at run time in ``jf-targets`` (as ``jetfleet target set`` would), a backlog
    of ``http.get`` jobs big enough for the whole window. ``--one-stack`` instead runs
    every cap in turn on one stack and one backlog (raising the cap under jobs that have
    waited). Per cap: ``--warm`` s to settle, then the simulator's counters are reset
    and read again ``--window`` s later (``--window-1`` for the 1/s cap): requests,
    the most in any 1 s and 10 s window, and utilisation = requests / (cap x seconds).

A third part, ``e2e``, ran ``make bench-smoke``'s 3,000 ``noop`` jobs with and without the
leaser's rate permit. Since the worker takes the permit itself, just before a request,
and a ``noop`` job sends none, those jobs take no permit at all and its variants would
all run the same path, so it is gone (docs/benchmarks.md, section 8c).

No figure is asserted anywhere; they are for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench/ is not a package: its modules import each other flat
    sys.path.insert(0, str(HERE))

import msgspec  # noqa: E402
from harness import (  # noqa: E402
    Children,
    counting_problems,
    fmt_table,
    load,
    run_with_tree,
    start_nats,
    summary,
    timed_calls,
    write_config,
)
from jetfleet.schemas.permit import (  # noqa: E402
    PermitAllowed,
    PermitRefused,
    PermitRequest,
    PermitWait,
)
from jetfleet.schemas.targets import TargetLimits  # noqa: E402
from jetfleet_bench import _wait_ready  # noqa: E402
from stats import process_usage, scan_logs  # noqa: E402

from jetfleet import subjects  # noqa: E402
from jetfleet.client import jobs_for, submit_jobs  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.dev.devstack import DevStack  # noqa: E402
from jetfleet.dev.embedded import EmbeddedRedis  # noqa: E402
from jetfleet.ops.status import fleet_status  # noqa: E402
from jetfleet.permit_client import PermitClient  # noqa: E402
from jetfleet.rate_cells import Cell, Decision, RateCells, cell_key  # noqa: E402
from jetfleet.topology import declare  # noqa: E402

PARTS = ("decisions", "caps")
OPEN_RATE, OPEN_BURST = 1_000_000.0, 1000
CAPPED_RATE, CAPPED_BURST = 10.0, 1
WARMUP = 200
CASE_TIMEOUT_S = 120.0
TARGET = "demo"
IN_FLIGHT = 256  # submissions awaiting their stream ack at once (as jetfleet.client)
WORKERS = 2
_ANSWER = re.compile(r'^jetfleet_ratelimit_answers_total\{answer="([^"]*)",limit="([^"]*)"')
_LEASE = re.compile(r'^jetfleet_lease_answers_total\{answer="([^"]*)",reason="([^"]*)"')


# ---------------------------------------------------------------- decisions


def decisions_tables(redis_url: str) -> dict[str, dict[str, Any]]:
    # The ratelimit service never contacts a target; base_url only has to be valid.
    base = {
        "base_url": "http://127.0.0.1:9/",
        "obey_robots": False,
        "robots_off_reason": "bench: no target behind it",
    }
    return {
        "redis": {"url": redis_url},
        "targets.open": {**base, "rate": OPEN_RATE, "burst": OPEN_BURST},
        "targets.capped": {**base, "rate": CAPPED_RATE, "burst": CAPPED_BURST},
    }


def _kind(reply: Any) -> str:
    if isinstance(reply, PermitAllowed) or (isinstance(reply, Decision) and reply.allowed):
        return "allowed"
    if isinstance(reply, PermitWait | Decision):
        return "wait"
    if isinstance(reply, PermitRefused):
        return f"refused:{reply.reason}"
    return type(reply).__name__


def _cpu(pids: dict[str, int | None]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        usage = process_usage(pid)
        out[name] = usage["cpu_s"] if usage else float("nan")
    return out


async def decisions_group(
    mode: str, replicas: int, permits: int, concurrencies: list[int], keep: bool
) -> list[dict[str, Any]]:
    """Fresh nats-server and redis-server, ``replicas`` ratelimit replicas, then every
    (target, concurrency) case through the service and through the script alone."""
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-ratelimit-"))
    results: list[dict[str, Any]] = []
    nats = None
    redis = EmbeddedRedis(folder / "redis")
    nc = None
    pairs: list[Any] = []
    children: Children | None = None
    raw: RateCells | None = None
    group_error = None
    with counting_problems() as problems:
        try:
            nats = await start_nats(folder)
            await asyncio.to_thread(redis.start)
            config = write_config(folder, nats.url, decisions_tables(redis.url))
            settings = load(config)
            nc = await connect_nats(settings.nats, "bench-permit-client")
            await declare(nc.jetstream(), settings)
            if mode == "process":
                children = Children(folder, config)
                for n in range(replicas):
                    children.spawn(f"ratelimit-{n}", ["serve", "ratelimit"])
                await children.wait_ready()
            else:
                from jetfleet.services.ratelimit import RateLimiter

                for n in range(replicas):
                    rnc = await connect_nats(settings.nats, f"bench-ratelimit-{n}")
                    limiter = RateLimiter(settings, rnc)
                    await limiter.start()
                    pairs.append((rnc, limiter))
            client = PermitClient(nc)
            raw = RateCells.connect(redis.url)
            for _ in range(WARMUP):  # connections, script cache, code paths; not timed
                await client.permit(PermitRequest(target="open", worker="bench"))
                await raw.permit("raw-open", [_raw_cell("raw-open", OPEN_RATE, OPEN_BURST)], 0)
            pids: dict[str, int | None] = {
                "nats-server": nats.process.pid if nats.process else None,
                "redis-server": redis.process.pid if redis.process else None,
            }
            if children is not None:
                pids.update({n: p.pid for n, p in children.procs.items()})
                pids["bench (caller)"] = os.getpid()
            else:
                pids["bench (replicas + caller)"] = os.getpid()
            for target, rate, burst in (
                ("open", OPEN_RATE, OPEN_BURST),
                ("capped", CAPPED_RATE, CAPPED_BURST),
            ):
                for conc in concurrencies:
                    for path in ("service", "script alone"):
                        results.append(
                            await _decisions_case(
                                mode,
                                replicas,
                                path,
                                target,
                                rate,
                                burst,
                                conc,
                                permits,
                                client,
                                raw,
                                pids,
                            )
                        )
        except Exception as exc:
            group_error = f"{type(exc).__name__}: {exc}"
        finally:
            for rnc, limiter in pairs:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(limiter.drain(10.0), 15.0)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(rnc.close(), 10.0)
            if children is not None:
                await children.stop()
            if raw is not None:
                with contextlib.suppress(Exception):
                    await raw.close()
            if nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.close(), 10.0)
            if nats is not None:
                await asyncio.to_thread(nats.stop)
            await asyncio.to_thread(redis.stop)
            logs = children.logs() if children is not None else []
            if nats is not None:
                logs.append(nats.log_path)
            logs.append(redis.log_path)
            log_problems = scan_logs(logs)
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)
    for r in results:
        r["log_problems"] = log_problems
        r["inproc_log_problems"] = {"count": problems.count, "first": problems.first}
    if group_error is not None or not results:
        results.append({"mode": mode, "replicas": replicas, "error": group_error or "no case ran"})
    return results


def _raw_cell(target: str, rate: float, burst: int) -> Cell:
    return Cell("target", cell_key("target", target), rate, burst)


async def _decisions_case(
    mode: str,
    replicas: int,
    path: str,
    target: str,
    rate: float,
    burst: int,
    conc: int,
    permits: int,
    client: PermitClient,
    raw: RateCells,
    pids: dict[str, int | None],
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "mode": mode,
        "replicas": replicas,
        "path": path,
        "target": target,
        "rate": rate,
        "burst": burst,
        "concurrency": conc,
        "permits": permits,
    }
    if path == "service":
        request = PermitRequest(target=target, worker="bench")
        calls = [lambda: client.permit(request)] * permits
    else:
        # Its own keys, so the script alone starts from the same empty cell.
        key = f"raw-{target}-{mode}-{replicas}-{conc}"
        cells = [_raw_cell(key, rate, burst)]
        calls = [lambda: raw.permit(key, cells, 0)] * permits
    try:
        cpu0 = _cpu(pids)
        lat, replies, wall = await timed_calls(calls, conc, CASE_TIMEOUT_S)
        cpu1 = _cpu(pids)
        result["calls"] = summary(lat, wall)
        result["answers"] = dict(Counter(_kind(r) for r in replies))
        result["cpu_ms_per_decision"] = {
            k: 1000.0 * (cpu1[k] - cpu0[k]) / permits
            for k in pids
            if path == "service"
            or k in ("redis-server", "bench (caller)", "bench (replicas + caller)")
        }
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def render_decisions(results: list[dict[str, Any]]) -> str:
    header = [
        "ratelimit",
        "replicas",
        "path",
        "target",
        "in flight",
        "decisions/s",
        "p50 ms",
        "p99",
        "max",
        "allowed / wait / other",
        "CPU ms/decision",
    ]
    rows = []
    notes = []
    for r in results:
        if "path" not in r:
            notes.append(f"{r['mode']} x{r['replicas']}: ERROR {r.get('error')}")
            continue
        c = r.get("calls") or {}
        a = r.get("answers") or {}
        other = sum(v for k, v in a.items() if k not in ("allowed", "wait"))
        cpu = r.get("cpu_ms_per_decision") or {}
        rows.append(
            [
                r["mode"],
                r["replicas"],
                r["path"],
                f"{r['target']} ({r['rate']:g}/s b{r['burst']})",
                r["concurrency"],
                c.get("per_s"),
                c.get("p50_ms"),
                c.get("p99_ms"),
                c.get("max_ms"),
                f"{a.get('allowed', 0)} / {a.get('wait', 0)} / {other}",
                ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()),
            ]
        )
        if r.get("error"):
            notes.append(f"{r['mode']} x{r['replicas']} {r['path']} {r['target']}: {r['error']}")
    seen = set()
    for r in results:
        key = (r["mode"], r["replicas"])
        if key in seen:
            continue
        seen.add(key)
        n = sum(v["count"] for v in (r.get("log_problems") or {}).values())
        n += (r.get("inproc_log_problems") or {}).get("count", 0)
        if n:
            notes.append(
                f"{key[0]} x{key[1]}: {n} log problem line(s): {r.get('log_problems')} "
                f"{r.get('inproc_log_problems')}"
            )
    return "\n".join([fmt_table(header, rows), *notes])


# ---------------------------------------------------------------- caps


async def put_limits(js: Any, target: str, rate: float, burst: int) -> None:
    """What ``jetfleet target set TARGET --rate R --burst B`` writes (``jf-targets``)."""
    kv = await js.key_value(subjects.BUCKET_TARGETS)
    limits = TargetLimits(rate=rate, burst=burst, set_by="bench", reason="ratelimit_bench")
    await kv.put(target, msgspec.json.encode(limits))


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5.0) as answer:  # loopback only
        return str(answer.read().decode())


def answers_from_metrics(text: str, pattern: re.Pattern[str]) -> dict[str, float]:
    """``answer[:limit or reason]`` -> count, summed over the other labels."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            answer, detail = match.groups()
            out[f"{answer}:{detail}" if detail else answer] += float(line.rsplit(" ", 1)[1])
    return dict(out)


async def stack_answers(stack: DevStack) -> dict[str, dict[str, float]]:
    """The ratelimit service's and the leaser's answers so far, from their /metrics."""
    out = {}
    for name, pattern in (("ratelimit", _ANSWER), ("leaser", _LEASE)):
        url = stack.ready_urls.get(name)
        if url is None:
            continue
        try:
            out[name] = answers_from_metrics(await asyncio.to_thread(scrape, url), pattern)
        except OSError as exc:
            out[name] = {"error": str(exc)}  # type: ignore[dict-item]
    return out


async def caps_run(
    caps: list[float], burst: int, window_s: float, window_1_s: float, warm_s: float, keep: bool
) -> dict[str, Any]:
    """One stack, the demo target's cap set to each of ``caps`` in turn over one backlog."""
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-caps-"))
    stack = DevStack(folder, workers=WORKERS)
    out: dict[str, Any] = {"burst": burst, "warm_s": warm_s, "cases": []}
    windows = [window_1_s if cap <= 1 else window_s for cap in caps]
    # Enough for every cap's warm-up and window, plus a third: the backlog never runs dry.
    backlog = int(1.34 * sum(cap * (w + warm_s) for cap, w in zip(caps, windows, strict=True)))
    out["backlog"] = backlog
    nc = None
    try:
        await asyncio.wait_for(stack.start(), 120.0)
        out["ready_s"] = await _wait_ready(stack, 60.0)
        assert stack.settings is not None
        settings = stack.settings
        nc = await connect_nats(settings.nats, "jetfleet-bench-caps")
        js = nc.jetstream()
        await declare(js, settings)
        await put_limits(js, TARGET, caps[0], burst)
        await asyncio.sleep(1.0)  # every replica applies a change within a second (KV watch)
        batch = jobs_for(
            TARGET, settings, [f"/page/{n}" for n in range(backlog)], handler="http.get"
        )
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def submit_one(job: Any) -> None:
            async with gate:
                await submit_jobs(js, settings, TARGET, [job])

        await asyncio.wait_for(asyncio.gather(*(submit_one(j) for j in batch)), 120.0)
        for cap, window in zip(caps, windows, strict=True):
            await put_limits(js, TARGET, cap, burst)
            await asyncio.sleep(warm_s)
            stack.simulator.reset()
            started = time.monotonic()
            await asyncio.sleep(window)
            seen = stack.simulator.counts()["total"]
            measured_s = time.monotonic() - started
            totals = (await fleet_status(js, settings)).totals
            out["cases"].append(
                {
                    "cap": cap,
                    "burst": burst,
                    "window_s": window,
                    "measured_s": measured_s,
                    "requests": seen,
                    "max_in_any_1s": stack.simulator.max_in_any_window(1.0),
                    "max_in_any_10s": stack.simulator.max_in_any_window(10.0),
                    "bound_1s": cap + burst,
                    "bound_10s": cap * 10 + burst,
                    "utilisation": seen / (cap * measured_s),
                    "dead_so_far": totals.dead,
                    "backlog_left": backlog - totals.committed - totals.dead,
                }
            )
            if stack.dead_children():
                out["error"] = "a child died: " + stack.describe_dead_children()
                break
        out["answers"] = await stack_answers(stack)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        from harness import stop_stack

        await stop_stack(stack, nc, folder, keep, out, extra_logs=[stack.redis.log_path])
    return out


def render_caps(results: list[dict[str, Any]]) -> str:
    header = [
        "cap req/s",
        "burst",
        "window s",
        "requests",
        "utilisation",
        "max in 1 s",
        "bound R+B",
        "max in 10 s",
        "bound 10R+B",
        "backlog / left",
    ]
    rows = [
        [
            c["cap"],
            c["burst"],
            round(c["measured_s"], 2),
            c["requests"],
            f"{100 * c['utilisation']:.1f} %",
            c["max_in_any_1s"],
            c["bound_1s"],
            c["max_in_any_10s"],
            c["bound_10s"],
            f"{result.get('backlog')} / {c['backlog_left']}",
        ]
        for result in results
        for c in result.get("cases", [])
    ]
    lines = [fmt_table(header, rows)]
    for result in results:
        caps = ", ".join(f"{c['cap']:g}" for c in result.get("cases", []))
        lines.append(f"caps {caps}: answers {result.get('answers')}")
        problems = sum(v["count"] for v in (result.get("log_problems") or {}).values())
        if problems:
            lines.append(f"  {problems} log problem line(s): {result.get('log_problems')}")
        if result.get("error"):
            lines.append(f"  ERROR {result['error']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default=",".join(PARTS), help="decisions and/or caps")
    parser.add_argument("--permits", type=int, default=3000, help="permits per case (3000)")
    parser.add_argument("--concurrency", default="1,50", help="callers in flight (1,50)")
    parser.add_argument("--replicas", default="1,2", help="ratelimit replicas (1,2)")
    parser.add_argument("--mode", default="inproc,process", help="inproc and/or process")
    parser.add_argument("--caps", default="1,10,100", help="caps in requests/s (1,10,100)")
    parser.add_argument("--burst", type=int, default=2, help="burst at every cap (2)")
    parser.add_argument("--window", type=float, default=20.0, help="measured s per cap (20)")
    parser.add_argument("--window-1", type=float, default=30.0, help="... at cap 1 (30)")
    parser.add_argument(
        "--one-stack",
        action="store_true",
        help="caps: one stack and one backlog for every cap in turn (default: a fresh "
        "stack and backlog per cap)",
    )
    parser.add_argument("--warm", type=float, default=3.0, help="s after a cap change (3)")
    parser.add_argument("--keep", action="store_true", help="keep the temp folders")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    if set(parts) - set(PARTS):
        parser.error(f"--part takes {', '.join(PARTS)}")
    out: dict[str, Any] = {}
    failed = False
    if "decisions" in parts:
        results: list[dict[str, Any]] = []
        for mode in [m.strip() for m in args.mode.split(",") if m.strip()]:
            for replicas in _ints(args.replicas):
                print(f"decisions: {mode} x{replicas}...", file=sys.stderr, flush=True)
                results += asyncio.run(
                    decisions_group(
                        mode, replicas, args.permits, _ints(args.concurrency), args.keep
                    )
                )
        out["decisions"] = results
        failed |= any(r.get("error") for r in results)
        if not args.json:
            print(render_decisions(results), flush=True)
    if "caps" in parts:
        caps = [float(c) for c in args.caps.split(",") if c.strip()]
        runs = [caps] if args.one_stack else [[cap] for cap in caps]
        caps_results = []
        for run in runs:
            print(f"caps: {run}...", file=sys.stderr, flush=True)
            caps_results.append(
                asyncio.run(
                    caps_run(run, args.burst, args.window, args.window_1, args.warm, args.keep)
                )
            )
        out["caps"] = caps_results
        failed |= any(r.get("error") for r in caps_results)
        if not args.json:
            print(render_caps(caps_results), flush=True)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
