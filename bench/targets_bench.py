"""Throughput and idle cost by number of targets, with dedicated or partitioned work lanes.

    python bench/targets_bench.py [--targets 1,10,100] [--layout dedicated,partitioned]
        [--partitions 16] [--jobs 3000] [--workers 2] [--ready-timeout 300]
        [--run-timeout 300] [--json]

Each (layout, K) case gets a fresh DevStack (W workers) whose user config declares K
targets: ``t001`` ... ``t<K-1>`` and ``demo`` (which DevStack writes itself, last), all
with demo's limits (rate 500/s, burst 100, max_in_flight 64) and a base_url on a target
simulator this bench runs itself (noop jobs never fetch it; the URL only has to be valid).
The layout is the ``[fleet]`` table of that config:

* ``dedicated``: ``dedicated_targets = K``. Every target has its own 3 work consumers (one
  per tier) and every worker runs 3 pull loops per target: 3K consumers, 3K loops.
* ``partitioned``: ``dedicated_targets = 0``, ``target_partitions = P`` (``--partitions``,
  default 16). Targets are hashed (crc32 % P) into at most P partitions; each has 3
  multi-filter consumers and every worker runs 3 pull loops per partition. The leaser caps
  each target's in-flight jobs in Redis, and the worker releases the lease after the ack.

nats-server 2.15 allows 1,000 consumers per stream by default, so ``dedicated`` with more
than 317 targets (beside 16 partitions) is refused by the settings' validation: the case
reports the configuration error.

Per case the bench measures, before any job: the number of work consumers on JF_WORK, the
idle CPU the fleet burns per second (each process, the workers together, all together),
the RSS of the workers and nats-server, and how long one ``fleet_status`` (what ``jetfleet
status`` and ``/v1/status`` compute) takes. Then it submits N/K jobs per target,
interleaved across targets (256 publishes in flight), and counts jobs/s from the first
submit to the last CommittedResult seen on ``jf.results.>`` (as bench/run.py does).

While the jobs run it watches the lease traffic: it counts the calls on ``jf.lease`` by
kind and the refusals (by reason) among all request replies (``_INBOX.*.*``: lease, sink
and publish-ack replies, not the workers' pull deliveries). At the end it reads Redis's
command counts (EVALSHA: cap scripts; ZREM: places freed) and the places still held, to
show that the leaser really used Redis for partitioned targets.

Every phase is bounded: start (``--ready-timeout``), ``fleet_status`` (its own timeout),
and the jobs (``--run-timeout``); a case that hits one reports what it measured so far.
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
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import msgspec  # noqa: E402
from harness import fmt_table, run_with_tree, wait_until_done  # noqa: E402
from jetfleet_bench import _decode_head, _wait_ready  # noqa: E402
from stats import latency_summary, process_usage, scan_logs  # noqa: E402

from jetfleet import subjects  # noqa: E402
from jetfleet.client import jobs_for, submit_jobs  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.dev.devstack import DevStack  # noqa: E402
from jetfleet.dev.settings_file import toml_tables  # noqa: E402
from jetfleet.inflight_caps import KEY_PREFIX  # noqa: E402
from jetfleet.ops.status import fleet_status  # noqa: E402
from jetfleet.simulator import TargetSimulator  # noqa: E402
from jetfleet.topology import declare  # noqa: E402
from jetfleet.work_lanes import LaneMap  # noqa: E402

LAYOUTS = ("dedicated", "partitioned")
IN_FLIGHT = 256
SETTLE_S = 3.0
IDLE_MEASURE_S = 5.0
STATUS_TIMEOUT_S = 120.0
DECLARE_TIMEOUT_S = 300.0
_refusal_decoder = msgspec.json.Decoder(dict[str, Any])


def target_names(k: int) -> list[str]:
    """``t001`` ... ``t<k-1>``, then ``demo`` (DevStack declares it after the user's)."""
    return [*(f"t{i:03d}" for i in range(1, k)), "demo"]


def fleet_table(layout: str, k: int, partitions: int) -> dict[str, int]:
    if layout == "dedicated":
        return {"dedicated_targets": k, "target_partitions": partitions}
    return {"dedicated_targets": 0, "target_partitions": partitions}


def _usage(pids: dict[str, int | None]) -> dict[str, dict[str, float]]:
    return {k: process_usage(v) or {} for k, v in pids.items()}


def _cpu_pct(
    u0: dict[str, dict[str, float]], u1: dict[str, dict[str, float]], seconds: float
) -> dict[str, float]:
    return {
        k: 100.0 * (u1[k].get("cpu_s", 0.0) - u0[k].get("cpu_s", 0.0)) / seconds
        for k in u0
        if k in u1
    }


def _workers_sum(values: dict[str, float]) -> float:
    return sum(v for k, v in values.items() if k.startswith("worker"))


def _rss(usage: dict[str, dict[str, float]]) -> dict[str, float | None]:
    return {k: u.get("rss_mib") for k, u in usage.items()}


class LeaseWatch:
    """Counts lease calls by kind and refusals by reason while the jobs run."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.details: dict[str, list[str]] = {}
        self.subs: list[Any] = []

    async def start(self, nc: Any) -> None:
        self.subs.append(await nc.subscribe(subjects.LEASE, cb=self._on_call))
        # Request replies only: 3 tokens. Pull deliveries go to 2-token inboxes.
        self.subs.append(await nc.subscribe("_INBOX.*.*", cb=self._on_reply))
        await nc.flush()

    async def stop(self) -> None:
        for sub in self.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.subs.clear()

    async def _on_call(self, msg: Any) -> None:
        data = msg.data
        for kind in ("grant", "renew", "release"):
            if b'"type":"%s"' % kind.encode() in data:
                self.calls[kind] += 1
                return
        self.calls["other"] += 1

    async def _on_reply(self, msg: Any) -> None:
        if b'"refused"' not in msg.data:
            return
        try:
            body = _refusal_decoder.decode(msg.data)
        except msgspec.MsgspecError:
            return
        if body.get("type") == "refused":
            reason = str(body.get("reason"))
            self.refusals[reason] += 1
            seen = self.details.setdefault(reason, [])
            detail = str(body.get("detail", ""))[:200]
            if len(seen) < 3 and detail not in seen:
                seen.append(detail)


async def redis_figures(url: str) -> dict[str, Any]:
    """Redis command counts and the in-flight places still held (None if unreachable)."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        stats = await client.info("commandstats")
        held = 0
        keys = 0
        async for key in client.scan_iter(match=KEY_PREFIX + "*", count=1000):
            keys += 1
            held += int(await client.zcard(key))
        return {
            "evalsha_calls": int(stats.get("cmdstat_evalsha", {}).get("calls", 0)),
            "zrem_calls": int(stats.get("cmdstat_zrem", {}).get("calls", 0)),
            "inflight_keys": keys,
            "places_held": held,
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()


async def run_case(
    layout: str,
    k: int,
    jobs: int,
    workers: int,
    partitions: int,
    ready_timeout_s: float,
    run_timeout_s: float,
    keep: bool,
) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"jetfleet-bench-targets-{layout}{k}-"))
    sim = TargetSimulator()
    result: dict[str, Any] = {
        "layout": layout,
        "targets": k,
        "jobs": jobs,
        "workers": workers,
        "phase": "start",
    }
    stack: DevStack | None = None
    nc = None
    case_started = time.monotonic()
    try:
        base = await sim.start()
        names = target_names(k)
        user = folder / "bench-user.toml"
        tables: dict[str, dict[str, Any]] = {"fleet": fleet_table(layout, k, partitions)}
        tables.update(
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
        user.write_text(toml_tables(tables))
        stack = DevStack(folder / "stack", workers=workers, user_config=user)
        await asyncio.wait_for(stack.start(), ready_timeout_s)
        result["ready_s"] = await _wait_ready(stack, ready_timeout_s)
        assert stack.settings is not None
        settings = stack.settings
        assert sorted(settings.targets) == sorted(names), sorted(settings.targets)
        lanes = LaneMap(settings)
        result["lanes"] = len(lanes.lanes)
        result["shared_lanes"] = sum(1 for lane in lanes.lanes if lane.shared)
        result["redis_url"] = settings.redis.url
        nc = await connect_nats(settings.nats, "bench-targets")
        js = nc.jetstream()
        result["phase"] = "declare"
        await asyncio.wait_for(declare(js, settings), DECLARE_TIMEOUT_S)
        info = await js.stream_info(subjects.STREAM_WORK)
        result["work_consumers"] = info.state.consumer_count

        pids: dict[str, int | None] = {n: p.pid for n, p in stack.children.items()}
        pids["nats-server"] = stack.nats.process.pid if stack.nats.process else None
        pids["redis-server"] = stack.redis.process.pid if stack.redis.process else None
        pids["bench"] = os.getpid()

        # Idle cost: what K targets cost with nothing to do (pull loops polling).
        result["phase"] = "idle"
        await asyncio.sleep(SETTLE_S)
        u0, t0 = _usage(pids), time.monotonic()
        await asyncio.sleep(IDLE_MEASURE_S)
        u1, t1 = _usage(pids), time.monotonic()
        idle = _cpu_pct(u0, u1, t1 - t0)
        result["idle_cpu_pct"] = idle
        result["idle_cpu_pct_all"] = sum(v for n, v in idle.items() if n != "bench")
        result["idle_cpu_pct_workers"] = _workers_sum(idle)
        result["rss_mib_idle"] = _rss(u1)
        result["phase"] = "status"
        started = time.perf_counter()
        await asyncio.wait_for(fleet_status(js, settings), STATUS_TIMEOUT_S)
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
        watch = LeaseWatch()
        await watch.start(nc)
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
        result["jobs"] = total
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def submit_one(name: str, job: Any) -> None:
            async with gate:
                submitted[job.id] = time.monotonic()
                await submit_jobs(js, settings, name, [job])

        result["phase"] = "run"
        ur0 = _usage(pids)
        first = time.monotonic()
        stop = "all committed"
        try:
            await asyncio.wait_for(
                asyncio.gather(*(submit_one(n, j) for n, j in order)), run_timeout_s
            )
        except TimeoutError:
            stop = "timeout while submitting"
        submit_s = time.monotonic() - first
        if stop == "all committed":
            stop = await wait_until_done(
                stack, lambda: len(arrived) >= total, first + run_timeout_s, stop
            )
        ur1 = _usage(pids)
        run_s = time.monotonic() - first
        await asyncio.sleep(0.5)
        await sub.unsubscribe()
        await watch.stop()
        last = max(arrived.values()) if arrived else time.monotonic()
        elapsed = last - first
        result.update(
            {
                "committed": len(arrived),
                "duplicates": dups,
                "stop_reason": stop,
                "submit_s": submit_s,
                "elapsed_s": elapsed,
                "jobs_per_s": len(arrived) / elapsed if elapsed > 0 else 0.0,
                "latency": latency_summary(arrived[j] - submitted[j] for j in arrived),
                "cpu_s_during_run": {
                    n: ur1[n].get("cpu_s", 0.0) - ur0[n].get("cpu_s", 0.0) for n in pids if n in ur1
                },
                "run_s": run_s,
                "rss_mib_end": _rss(ur1),
                "lease_calls": dict(watch.calls),
                "refusals": dict(watch.refusals),
                "refusal_details": watch.details,
            }
        )
        result["phase"] = "status at end"
        started = time.perf_counter()
        status = await asyncio.wait_for(fleet_status(js, settings), STATUS_TIMEOUT_S)
        result["status_ms_end"] = 1000.0 * (time.perf_counter() - started)
        result["status_at_end"] = msgspec.structs.asdict(status.totals)
        result["status_conserved"] = status.conserved
        result["redis"] = await redis_figures(settings.redis.url)
        result["phase"] = "done"
    except Exception as exc:
        detail = str(exc) or "(no message)"
        result["error"] = f"{type(exc).__name__} during {result['phase']}: {detail}"
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 10.0)
        logs: list[Path] = []
        if stack is not None:
            logs = [*sorted((stack.data_dir / "logs").glob("*.log")), stack.nats.log_path]
            stopping = time.monotonic()
            try:
                await stack.stop()
            except Exception as exc:
                result.setdefault("error", f"stop failed: {exc}")
            result["stop_s"] = time.monotonic() - stopping
        await sim.stop()
        result["log_problems"] = scan_logs(logs)
        result["case_s"] = time.monotonic() - case_started
        if keep:
            result["folder"] = str(folder)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return result


def _fmt(value: Any, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def short_error(error: str) -> str:
    """The first line of an error and, for a child's traceback, its exception lines."""
    lines = error.splitlines()
    found = [ln.strip() for ln in lines[1:] if "Error:" in ln or "exited (code" in ln]
    return " | ".join([lines[0], *found]) if lines else error


def render(results: list[dict[str, Any]]) -> str:
    header = [
        "layout",
        "targets",
        "work consumers",
        "ready s",
        "jobs",
        "committed",
        "submit s",
        "elapsed s",
        "jobs/s",
        "p50 ms",
        "p99 ms",
        "status ms idle/end",
        "idle CPU % all",
        "idle CPU % workers",
        "RSS MiB workers (idle/end)",
        "RSS MiB nats (idle/end)",
        "log problems",
    ]
    rows = []
    for r in results:
        lat = r.get("latency") or {}
        idle_rss = r.get("rss_mib_idle") or {}
        end_rss = r.get("rss_mib_end") or {}
        w_idle = [v for n, v in idle_rss.items() if n.startswith("worker") and v]
        w_end = [v for n, v in end_rss.items() if n.startswith("worker") and v]
        rows.append(
            [
                r["layout"],
                r["targets"],
                r.get("work_consumers"),
                r.get("ready_s"),
                r.get("jobs"),
                r.get("committed"),
                r.get("submit_s"),
                r.get("elapsed_s"),
                r.get("jobs_per_s"),
                lat.get("p50_ms"),
                lat.get("p99_ms"),
                f"{_fmt(r.get('status_ms_idle'))} / {_fmt(r.get('status_ms_end'))}",
                r.get("idle_cpu_pct_all"),
                r.get("idle_cpu_pct_workers"),
                f"{_fmt(max(w_idle) if w_idle else None)} / {_fmt(max(w_end) if w_end else None)}",
                f"{_fmt(idle_rss.get('nats-server'))} / {_fmt(end_rss.get('nats-server'))}",
                sum(v["count"] for v in r.get("log_problems", {}).values()),
            ]
        )
    out = [fmt_table(header, rows), ""]
    for r in results:
        name = f"{r['layout']} {r['targets']}"
        out.append(
            f"{name}: lanes {r.get('lanes')} ({r.get('shared_lanes')} shared), "
            f"stop {r.get('stop_reason')}, case {_fmt(r.get('case_s'))} s "
            f"(stack stop {_fmt(r.get('stop_s'))} s), status at end {r.get('status_at_end')} "
            f"conserved {r.get('status_conserved')}"
        )
        if r.get("idle_cpu_pct"):
            out.append(
                f"{name}, idle CPU %: "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["idle_cpu_pct"].items())
            )
        if r.get("cpu_s_during_run"):
            out.append(
                f"{name}, CPU s during the run: "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_s_during_run"].items())
            )
        if r.get("rss_mib_end"):
            out.append(
                f"{name}, RSS MiB at end: "
                + ", ".join(f"{k} {_fmt(v, '.1f')}" for k, v in r["rss_mib_end"].items())
            )
        out.append(
            f"{name}, lease calls {r.get('lease_calls')}, refusals {r.get('refusals')}, "
            f"redis {r.get('redis')}"
        )
        if r.get("refusal_details"):
            out.append(f"{name}, refusal details: {r['refusal_details']}")
        if r.get("log_problems"):
            out.append(f"{name}, log problems: {r['log_problems']}")
        if r.get("error"):
            out.append(f"{name}: ERROR {short_error(r['error'])}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="1,10,100", help="target counts (1,10,100)")
    parser.add_argument(
        "--layout",
        default=",".join(LAYOUTS),
        help="dedicated, partitioned or both, comma-separated (both)",
    )
    parser.add_argument("--partitions", type=int, default=16, help="fleet.target_partitions (16)")
    parser.add_argument("--jobs", type=int, default=3000, help="total noop jobs (3000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    parser.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to start a stack (300)"
    )
    parser.add_argument(
        "--run-timeout", type=float, default=300.0, help="seconds for the jobs of a case (300)"
    )
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    layouts = [x.strip() for x in args.layout.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or not layouts:
        parser.error(f"--layout: {', '.join(unknown) or 'none'}; choose from {LAYOUTS}")
    results = []
    for k in [int(x) for x in args.targets.split(",") if x.strip()]:
        for layout in layouts:
            print(
                f"targets case: {layout}, {k} targets, {args.jobs} jobs...",
                file=sys.stderr,
                flush=True,
            )
            results.append(
                asyncio.run(
                    run_case(
                        layout,
                        k,
                        args.jobs,
                        args.workers,
                        args.partitions,
                        args.ready_timeout,
                        args.run_timeout,
                        args.keep,
                    )
                )
            )
    print(json.dumps(results, indent=2, default=str) if args.json else render(results))
    return 1 if any(r.get("error") or r.get("committed") != r.get("jobs") for r in results) else 0


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
