"""Lease grant and renew latency with N leases held at once (default 1,000).

    python bench/lease_bench.py [--leases N] [--rounds R] [--concurrency 1,50]
                                [--replicas 1,2] [--mode inproc,process] [--json]

Each case (mode x replicas x concurrency) gets a fresh embedded nats-server and
redis-server (the leaser keeps the target's in-flight places there; the cap is set to
admit every lease) and topology (``jetfleet.topology.declare``), then its leaser
replica(s):

* ``inproc``: ``jetfleet.services.leaser.Leaser`` objects in this process, each on its own
  NATS connection, sharing this process's event loop (and CPU) with the caller;
* ``process``: ``python -m jetfleet serve leaser`` children (what DevStack runs).

Several replicas share the ``leaser`` queue group. A ``LeaseClient`` on its own connection
then grants N leases on N distinct job ids (every one is kept: ``lease_ttl_s`` is 120 s,
so none expires during the case), timing each grant, and renews all N leases R times,
timing each renew. ``--concurrency`` is how many callers are in flight at once (1 =
sequential). Grants and renews that are not answered with a grant count as failures.
After the renews the bench reads the lease bucket and reports how many leases were live.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness import (  # noqa: E402
    Children,
    close_case,
    counting_problems,
    fmt_table,
    load,
    run_with_tree,
    start_nats,
    start_redis,
    summary,
    timed_calls,
    write_config,
)
from jetfleet.schemas.lease import LeaseGrant, LeaseRequest  # noqa: E402
from jetfleet.schemas.report import Versions  # noqa: E402
from stats import process_usage  # noqa: E402

import jetfleet  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.lease_client import LeaseClient  # noqa: E402
from jetfleet.lease_store import LeaseStore  # noqa: E402
from jetfleet.topology import declare  # noqa: E402

TARGET = "demo"
LEASE_TTL_S = 120.0
CASE_TIMEOUT_S = 300.0
WARMUP = 50


def config_tables(leases: int) -> dict[str, dict[str, Any]]:
    return {
        # ack_wait must exceed the lease TTL (settings.validate).
        "fleet": {"lease_ttl_s": LEASE_TTL_S, "ack_wait_s": 2 * LEASE_TTL_S},
        # The leaser never contacts the target; base_url only has to be valid. Its
        # in-flight cap (places in Redis) must admit every lease held at once.
        f"targets.{TARGET}": {
            "base_url": "http://127.0.0.1:9/",
            "max_in_flight": max(64, leases + WARMUP),
        },
    }


async def start_leasers(
    mode: str, replicas: int, folder: Path, config: Path, settings: Any
) -> tuple[list[Any], Children | None]:
    """Start ``replicas`` leasers; returns (in-process (nc, leaser) pairs, children)."""
    if mode == "process":
        children = Children(folder, config)
        for n in range(replicas):
            children.spawn(f"leaser-{n}", ["serve", "leaser"])
        await children.wait_ready()
        return [], children
    from jetfleet.services.leaser import Leaser

    pairs = []
    for n in range(replicas):
        nc = await connect_nats(settings.nats, f"bench-leaser-{n}")
        leaser = Leaser(settings, nc)
        await leaser.start()
        pairs.append((nc, leaser))
    return pairs, None


async def stop_leasers(pairs: list[Any], children: Children | None) -> None:
    for nc, leaser in pairs:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(leaser.drain(10.0), 15.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 10.0)
    if children is not None:
        await children.stop()


def _request(job_id: str) -> LeaseRequest:
    return LeaseRequest(
        job_id=job_id,
        target=TARGET,
        key=f"key-{job_id}",
        worker="bench-worker",
        versions=Versions(jetfleet=jetfleet.__version__, handler="noop@1"),
        sends_request=False,  # as a current worker: it takes its permits itself
        reply_subject="",
    )


def _usage(pids: dict[str, int | None]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        u = process_usage(pid)
        out[name] = u["cpu_s"] if u else float("nan")
    return out


async def run_case(
    mode: str, replicas: int, concurrency: int, leases: int, rounds: int, keep: bool
) -> dict[str, Any]:
    """One case on fresh servers; never leaves a process behind."""
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-lease-"))
    result: dict[str, Any] = {
        "mode": mode,
        "replicas": replicas,
        "concurrency": concurrency,
        "leases": leases,
        "renew_rounds": rounds,
        "lease_ttl_s": LEASE_TTL_S,
    }
    nats = None
    redis = None
    nc = None
    pairs: list[Any] = []
    children: Children | None = None
    with counting_problems() as problems:
        try:
            nats = await start_nats(folder)
            redis = await start_redis(folder)
            config = write_config(folder, nats.url, config_tables(leases), redis.url)
            settings = load(config)
            nc = await connect_nats(settings.nats, "bench-lease-client")
            js = nc.jetstream()
            await declare(js, settings)
            pairs, children = await start_leasers(mode, replicas, folder, config, settings)
            client = LeaseClient(nc)

            # Warm-up (not timed): connections, KV buckets, the leaser's code paths. The
            # warm-up leases are released again, so exactly `leases` are held afterwards.
            warm = [f"warm-{n}" for n in range(WARMUP)]
            for job_id in warm:
                reply = await client.grant(_request(job_id))
                if isinstance(reply, LeaseGrant):
                    await client.renew(job_id, reply.fence)
                    await client.release(job_id, reply.fence)

            pids = {
                "nats-server": nats.process.pid if nats.process else None,
                "redis-server": redis.process.pid if redis.process else None,
            }
            if children is not None:
                pids.update({n: p.pid for n, p in children.procs.items()})
            else:
                import os

                pids["bench (leaser + caller)"] = os.getpid()
            cpu0 = _usage(pids)

            job_ids = [f"job-{n:07d}" for n in range(leases)]
            grant_calls = [lambda j=j: client.grant(_request(j)) for j in job_ids]
            lat, replies, wall = await timed_calls(grant_calls, concurrency, CASE_TIMEOUT_S)
            fences = {}
            for job_id, reply in zip(job_ids, replies, strict=True):
                if isinstance(reply, LeaseGrant):
                    fences[job_id] = reply.fence
            result["grant"] = summary(lat, wall)
            result["grant_failures"] = leases - len(fences)
            cpu1 = _usage(pids)

            renew_lat: list[float] = []
            renew_wall = 0.0
            renew_failures = 0
            held = list(fences.items())
            for _ in range(rounds):
                calls = [lambda j=j, f=f: client.renew(j, f) for j, f in held]
                lat, oks, wall = await timed_calls(calls, concurrency, CASE_TIMEOUT_S)
                renew_lat += lat
                renew_wall += wall
                renew_failures += sum(1 for ok in oks if ok is not True)
            result["renew"] = summary(renew_lat, renew_wall)
            result["renew_failures"] = renew_failures
            cpu2 = _usage(pids)
            result["cpu_ms_per_grant"] = {
                k: 1000.0 * (cpu1[k] - cpu0[k]) / max(1, leases) for k in pids
            }
            result["cpu_ms_per_renew"] = {
                k: 1000.0 * (cpu2[k] - cpu1[k]) / max(1, len(renew_lat)) for k in pids
            }
            store = await LeaseStore.open(js)
            result["live_leases_after"] = len(await store.all_live())
            result["rss_mib"] = {
                k: (process_usage(pid) or {}).get("rss_mib") for k, pid in pids.items()
            }
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            await stop_leasers(pairs, None)
            await close_case(nc, children, [nats, redis], folder, keep, result, problems)
    return result


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=1000, help="leases held (default 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="renew rounds (default 3)")
    parser.add_argument("--concurrency", default="1,50", help="callers in flight (1,50)")
    parser.add_argument("--replicas", default="1,2", help="leaser replicas (1,2)")
    parser.add_argument("--mode", default="inproc,process", help="inproc and/or process")
    parser.add_argument("--keep", action="store_true", help="keep the temp folders")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    if set(modes) - {"inproc", "process"}:
        parser.error("--mode takes inproc and/or process")
    results = []
    for mode in modes:
        for replicas in _ints(args.replicas):
            for conc in _ints(args.concurrency):
                if not args.json:
                    print(
                        f"lease case: {mode}, {replicas} replica(s), {conc} in flight...",
                        file=sys.stderr,
                        flush=True,
                    )
                started = time.monotonic()
                r = asyncio.run(run_case(mode, replicas, conc, args.leases, args.rounds, args.keep))
                r["case_s"] = time.monotonic() - started
                results.append(r)
                if r.get("error") and not args.json:
                    print(f"  ERROR {r['error']}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(render(results))
    failed = any(
        r.get("error") or r.get("grant_failures") or r.get("renew_failures") for r in results
    )
    return 1 if failed else 0


def render(results: list[dict[str, Any]]) -> str:
    header = [
        "leaser",
        "replicas",
        "in flight",
        "grant p50 ms",
        "p99",
        "max",
        "grants/s",
        "renew p50 ms",
        "p99",
        "max",
        "renews/s",
        "failed g/r",
        "live after",
    ]
    rows = []
    for r in results:
        g, rn = r.get("grant") or {}, r.get("renew") or {}
        rows.append(
            [
                r["mode"],
                r["replicas"],
                r["concurrency"],
                g.get("p50_ms"),
                g.get("p99_ms"),
                g.get("max_ms"),
                g.get("per_s"),
                rn.get("p50_ms"),
                rn.get("p99_ms"),
                rn.get("max_ms"),
                rn.get("per_s"),
                f"{r.get('grant_failures', '-')}/{r.get('renew_failures', '-')}",
                r.get("live_leases_after"),
            ]
        )
    out = [fmt_table(header, rows), ""]
    for r in results:
        label = f"{r['mode']} x{r['replicas']} c{r['concurrency']}"
        if r.get("cpu_ms_per_grant"):
            cpu_g = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_grant"].items())
            cpu_r = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_renew"].items())
            out.append(f"{label}: CPU ms per grant: {cpu_g}; per renew: {cpu_r}")
        problems = sum(v["count"] for v in r.get("log_problems", {}).values())
        problems += r.get("inproc_log_problems", {}).get("count", 0)
        if problems:
            out.append(
                f"{label}: {problems} log problem line(s): {r.get('log_problems')} "
                f"{r.get('inproc_log_problems')}"
            )
        if r.get("error"):
            out.append(f"{label}: ERROR {r['error']}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
