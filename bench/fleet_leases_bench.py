"""10,000 simulated workers, each holding a lease on its own job and renewing it.

    python bench/fleet_leases_bench.py [--workers 10000] [--rounds 3] [--replicas 1,2]
                                       [--ttl S] [--ramp-s S] [--json]

Each case (one per replica count) gets its own nats-server and redis-server in a temp
folder, the topology, a scheduler and R leaser replicas as ``python -m jetfleet serve``
children (what DevStack runs), with one target, ``fleet``, whose ``max_in_flight`` is
the worker count (so its in-flight cap, kept in Redis by the leaser, admits every
lease, and its work consumers may hold that many deliveries unacked).

Set up the honest way, as a fleet gets there:

1. W ``noop`` jobs are submitted through ``jetfleet.client.submit_jobs`` and admitted by
   the scheduler into ``JF_WORK``.
2. This process pulls all W deliveries from the target's work consumers and keeps them
   unacked: each simulated worker owns one delivery.
3. Simulated worker i asks the leaser for its job's lease with the request a worker
   sends (``LeaseClient.grant``: its own worker id, the job's key, the delivery's reply
   subject, the process's version tuple, ``sends_request`` false). The grants are
   spread evenly over ``--ramp-s`` (default ttl/3), as a running fleet's leases start
   at scattered moments; ``--ramp-s 0`` grants all at once (the worst case: every
   renewal then falls due in the same instant). A refused grant is asked again after
   its retry-after (up to 10 times), as the job would come back to a worker.
4. Each then renews as the worker's lease keeper does (jetfleet/worker/runtime.py,
   ``_keep_lease``): every ttl/3 from when its last renewal was asked,
   ``LeaseClient.renew`` waited for no longer than the TTL has left, then ``+WPI``
   (``msg.in_progress()``) on its delivery; an unanswered or busy renewal is asked again
   soon (``Backoff``); ``lease-lost``, or no renewal answered for a whole TTL, is a lost
   lease. Nothing revokes or expires anything on purpose, so every loss is spurious.
   Each worker renews at least ``--rounds`` times and goes on until every worker has
   (so no lease lapses before the bucket is read).

Figures: spurious lease losses (must be 0), renew latency p50/p99/max (answered calls;
unanswered ones counted apart, as the worker's metric does), renewals/s, and CPU ms
per renewal of each leaser, nats-server, redis-server (the leaser extends each renewed
job's in-flight place there) and this process, over the renewal phase (from the last
grant to the last renewal). At the end the bench reads the lease bucket (every lease
live under its fence) and the work consumers (nothing redelivered: the +WPIs held).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench/ is not a package: its modules import each other flat
    sys.path.insert(0, str(HERE))

import msgspec  # noqa: E402
from harness import (  # noqa: E402
    Children,
    close_case,
    counting_problems,
    fmt_table,
    load,
    run_with_tree,
    start_nats,
    write_config,
)
from jetfleet.schemas.job import WorkOrder  # noqa: E402
from jetfleet.schemas.lease import LeaseGrant, LeaseRequest  # noqa: E402
from nats.errors import TimeoutError as NatsTimeoutError  # noqa: E402
from stats import cpu_snapshot, latency_summary, usage_since  # noqa: E402

from jetfleet import subjects  # noqa: E402
from jetfleet.backoff import Backoff  # noqa: E402
from jetfleet.client import jobs_for, submit_jobs  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.dev.embedded import EmbeddedRedis  # noqa: E402
from jetfleet.lease_client import LeaseClient  # noqa: E402
from jetfleet.lease_store import LeaseStore  # noqa: E402
from jetfleet.settings import ACK_WAIT_OVER_TTL_S  # noqa: E402
from jetfleet.topology import declare  # noqa: E402
from jetfleet.version_tuple import local_tuple, with_handler  # noqa: E402

TARGET = "fleet"
GRANTS_IN_FLIGHT = 64  # grant calls at once during the ramp (a fleet starting up)
SETUP_TIMEOUT_S = 180.0
PULL_BATCH = 500
GRANT_TRIES = 10  # a refused grant is asked again after its retry-after, this many times
RENEW_P99_TARGET_MS = 250.0
_order_decoder = msgspec.json.Decoder(WorkOrder)


@dataclass
class Tally:
    """What the simulated workers saw."""

    grant_latency: list[float] = field(default_factory=list)
    grant_refused: list[str] = field(default_factory=list)
    renew_latency: list[float] = field(default_factory=list)
    renew_done_at: list[float] = field(default_factory=list)
    unanswered: int = 0
    lost_refused: int = 0
    lost_expired: int = 0
    wpi_failed: int = 0
    held: dict[str, int] = field(default_factory=dict)
    never_granted: int = 0
    expected: int = 0
    grants_settled: int = 0
    all_answered: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once every simulated worker has its lease (or gave up asking)."""
    through: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once every simulated worker has renewed ``rounds`` times (or lost its lease):
    then all stop renewing, and every lease is still held when the bucket is read."""


def config_tables(workers: int, redis_url: str, ttl_s: float | None) -> dict[str, Any]:
    fleet: dict[str, Any] = {}
    if ttl_s is not None:
        fleet["lease_ttl_s"] = ttl_s
        # The settings' rule: the ack wait outlives the lease (plus its margin).
        fleet["ack_wait_s"] = max(60.0, math.ceil(ttl_s) + ACK_WAIT_OVER_TTL_S + 10.0)
    tables: dict[str, Any] = {
        "redis": {"url": redis_url},
        # The leaser never contacts the target; base_url only has to be valid.
        f"targets.{TARGET}": {"base_url": "http://127.0.0.1:9/", "max_in_flight": workers},
    }
    if fleet:
        tables["fleet"] = fleet
    return tables


async def _admit(js: Any, settings: Any, workers: int) -> None:
    """Submit ``workers`` noop jobs and wait until the scheduler routed them all."""
    jobs = jobs_for(TARGET, settings, [f"/page/{n}" for n in range(workers)], handler="noop")
    for outcome in await submit_jobs(js, settings, TARGET, jobs):
        if outcome.rejection is not None:
            raise RuntimeError(f"a job was refused at submit: {outcome.rejection}")
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while (await js.stream_info(subjects.STREAM_WORK)).state.messages < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler did not admit {workers} jobs in time")
        await asyncio.sleep(0.1)


async def _pull_all(js: Any, workers: int) -> list[Any]:
    """Every delivery of the target, held unacked (one per simulated worker)."""
    held: list[Any] = []
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    for tier in subjects.TIERS:
        sub = await js.pull_subscribe_bind(
            subjects.work_consumer(TARGET, tier), stream=subjects.STREAM_WORK
        )
        while len(held) < workers and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(PULL_BATCH, timeout=0.5)
            except (NatsTimeoutError, TimeoutError):
                break  # this tier is empty
            held.extend(msgs)
    if len(held) != workers:
        raise RuntimeError(f"pulled {len(held)} deliveries, expected {workers}")
    return held


async def _keeper(
    n: int,
    msg: Any,
    client: LeaseClient,
    versions: Any,
    start_at: float,
    gate: asyncio.Semaphore,
    ttl_s: float,
    rounds: int,
    tally: Tally,
) -> None:
    """One simulated worker: take its job's lease at ``start_at``, then renew it as the
    worker's lease keeper does, at least ``rounds`` times and until every worker has
    (so every lease is still held when the bench reads the bucket)."""
    marked = [False]

    def through() -> None:
        """This worker has its rounds (or will never have them): once each."""
        if not marked[0]:
            marked[0] = True
            tally.through += 1
            if tally.through >= tally.expected:
                tally.stop.set()

    try:
        order = _order_decoder.decode(msg.data)
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        granted = await _take_lease(n, order, msg, client, versions, gate, tally)
        if granted is not None:
            await _renew(order.job.id, msg, client, *granted, ttl_s, rounds, tally, through)
    finally:
        through()


async def _take_lease(
    n: int,
    order: WorkOrder,
    msg: Any,
    client: LeaseClient,
    versions: Any,
    gate: asyncio.Semaphore,
    tally: Tally,
) -> tuple[int, float, float] | None:
    """The grant (asked again after a refusal's retry-after, as the job would come back);
    its fence, TTL and when it was asked; None if it never came."""
    request = LeaseRequest(
        job_id=order.job.id,
        target=order.target,
        key=order.key,
        worker=f"sim-{n:05d}",
        versions=versions,
        reply_subject=msg.reply or "",
        sends_request=False,
    )
    reply = None
    for _ in range(GRANT_TRIES):
        async with gate:
            asked_at = time.monotonic()
            reply = await client.grant(request)
            tally.grant_latency.append(time.monotonic() - asked_at)
        if isinstance(reply, LeaseGrant):
            tally.held[order.job.id] = reply.fence
            _granted(tally)
            return reply.fence, reply.ttl_s, asked_at
        reason = "unanswered" if reply is None else getattr(reply, "reason", type(reply).__name__)
        tally.grant_refused.append(f"{reason}: {getattr(reply, 'detail', '')}"[:160])
        await asyncio.sleep(max(0.1, getattr(reply, "retry_after_s", 0.0)))
    tally.never_granted += 1
    _granted(tally)
    return None


def _granted(tally: Tally) -> None:
    tally.grants_settled += 1
    if tally.grants_settled >= tally.expected:
        tally.all_answered.set()


async def _renew(
    job_id: str,
    msg: Any,
    client: LeaseClient,
    fence: int,
    ttl: float,
    asked_at: float,
    ttl_s: float,
    rounds: int,
    tally: Tally,
    through: Callable[[], None],
) -> None:
    """The worker's ``_keep_lease`` loop (jetfleet/worker/runtime.py), counting; after
    ``rounds`` renewals it calls ``through`` and goes on until ``tally.stop``."""
    ttl = ttl or ttl_s
    interval = ttl / 3
    renewed_at, retry, wait_s, done = asked_at, Backoff(), interval, 0
    while True:
        wake = max(0.0, min(wait_s, renewed_at + ttl - time.monotonic()))
        if done >= rounds:
            through()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tally.stop.wait(), wake)
            if tally.stop.is_set():
                return
        else:
            await asyncio.sleep(wake)
        asked_at = time.monotonic()
        left = renewed_at + ttl - asked_at
        renewed: bool | None = None
        if left > 0:
            try:
                async with asyncio.timeout(left):
                    renewed = await client.renew(job_id, fence)
            except TimeoutError:
                renewed = None
        if renewed:
            now = time.monotonic()
            tally.renew_latency.append(now - asked_at)
            tally.renew_done_at.append(now)
            try:
                await msg.in_progress()
            except Exception:
                tally.wpi_failed += 1
            renewed_at, retry, wait_s = asked_at, Backoff(), interval
            done += 1
            continue
        if renewed is False:
            tally.lost_refused += 1
            return
        tally.unanswered += 1
        if time.monotonic() - renewed_at >= ttl:
            tally.lost_expired += 1
            return
        wait_s = min(interval, retry.next_s())


async def run_case(
    workers: int,
    replicas: int,
    rounds: int,
    ttl_s: float | None,
    ramp_s: float | None,
    keep: bool = False,
) -> dict[str, Any]:
    """One case on fresh servers; never leaves a process behind."""
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-fleet-leases-"))
    result: dict[str, Any] = {"workers": workers, "replicas": replicas, "rounds": rounds}
    nats = None
    redis = EmbeddedRedis(folder / "redis")
    nc = None
    children: Children | None = None
    keepers: list[asyncio.Task[None]] = []
    tally = Tally(expected=workers)
    with counting_problems() as problems:
        try:
            nats = await start_nats(folder)
            await asyncio.to_thread(redis.start)
            config = write_config(
                folder, nats.url, config_tables(workers, f"redis://127.0.0.1:{redis.port}/0", ttl_s)
            )
            settings = load(config)
            ttl = settings.fleet.lease_ttl_s
            ramp = ttl / 3 if ramp_s is None else ramp_s
            result.update({"lease_ttl_s": ttl, "renew_every_s": ttl / 3, "ramp_s": ramp})
            nc = await connect_nats(settings.nats, "bench-fleet-leases")
            js = nc.jetstream()
            await declare(js, settings)
            children = Children(folder, config)
            children.spawn("scheduler", ["serve", "scheduler"])
            for n in range(replicas):
                children.spawn(f"leaser-{n}", ["serve", "leaser"])
            await children.wait_ready()
            started = time.monotonic()
            await _admit(js, settings, workers)
            msgs = await _pull_all(js, workers)
            result["setup_s"] = time.monotonic() - started

            pids: dict[str, int | None] = {
                n: p.pid for n, p in children.procs.items() if n.startswith("leaser")
            }
            pids["nats-server"] = nats.process.pid if nats.process else None
            pids["redis-server"] = redis.process.pid if redis.process else None
            pids["bench (the simulated workers)"] = os.getpid()
            client = LeaseClient(nc)
            versions = with_handler(local_tuple(settings), "noop@1")
            gate = asyncio.Semaphore(GRANTS_IN_FLIGHT)
            cpu0 = cpu_snapshot(pids)
            t0 = time.monotonic()
            keepers = [
                asyncio.create_task(
                    _keeper(
                        n,
                        msg,
                        client,
                        versions,
                        t0 + ramp * n / workers,
                        gate,
                        ttl,
                        rounds,
                        tally,
                    )
                )
                for n, msg in enumerate(msgs)
            ]
            # Bounded: an overloaded leaser ends the case with what it got, not a hang.
            deadline = ramp + ttl * (rounds + 2) + 60.0
            result["stop_reason"] = "every worker renewed its rounds"
            try:
                await asyncio.wait_for(tally.all_answered.wait(), deadline)
            except TimeoutError:
                result["stop_reason"] = (
                    f"{workers - tally.grants_settled} grants unanswered after {deadline:.0f} s"
                )
                tally.stop.set()
            t_granted = time.monotonic()
            renewals_before = len(tally.renew_latency)
            cpu1 = cpu_snapshot(pids)
            done, pending = await asyncio.wait(keepers, timeout=deadline)
            if pending:
                result["stop_reason"] = f"{len(pending)} workers still renewing after the deadline"
                await _stop_keepers(keepers, tally)
            result["keeper_errors"] = sorted(
                {repr(t.exception())[:160] for t in done if not t.cancelled() and t.exception()}
            )
            t_end = max(tally.renew_done_at, default=time.monotonic())
            renewals = len(tally.renew_latency) - renewals_before
            phase_s = t_end - t_granted
            grant_usage = usage_since(pids, cpu0)
            renew_usage = usage_since(pids, cpu1)
            result.update(
                {
                    "grants": len(tally.held),
                    "grant_refusals": len(tally.grant_refused),
                    "grant_refusal_kinds": dict(Counter(tally.grant_refused).most_common(5)),
                    "never_granted": tally.never_granted,
                    "grant_s": t_granted - t0,
                    "grant": latency_summary(tally.grant_latency),
                    "renewals": len(tally.renew_latency),
                    "renew": latency_summary(tally.renew_latency),
                    "renewals_in_phase": renewals,
                    "renew_phase_s": phase_s,
                    "renewals_per_s": renewals / phase_s if phase_s > 0 else 0.0,
                    "unanswered_renewals": tally.unanswered,
                    "spurious_losses": tally.lost_refused + tally.lost_expired,
                    "lost_refused": tally.lost_refused,
                    "lost_expired": tally.lost_expired,
                    "wpi_failed": tally.wpi_failed,
                    "cpu_ms_per_renewal": {
                        k: 1000.0 * (v["cpu_s"] or 0.0) / max(1, renewals)
                        for k, v in renew_usage.items()
                    },
                    "cpu_ms_per_grant": {
                        k: 1000.0
                        * ((grant_usage[k]["cpu_s"] or 0.0) - (renew_usage[k]["cpu_s"] or 0.0))
                        / max(1, len(tally.held))
                        for k in pids
                    },
                    "rss_mib": {k: v["rss_mib"] for k, v in renew_usage.items()},
                }
            )
            await _check_end(js, tally, workers, result)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            await _stop_keepers(keepers, tally)
            await close_case(nc, children, [nats, redis], folder, keep, result, problems)
    return result


async def _stop_keepers(keepers: list[asyncio.Task[None]], tally: Tally) -> None:
    """Stop every simulated worker still running (before its connection closes)."""
    tally.stop.set()
    for task in keepers:
        task.cancel()
    await asyncio.gather(*keepers, return_exceptions=True)


async def _check_end(js: Any, tally: Tally, workers: int, result: dict[str, Any]) -> None:
    """Every lease still live under its fence; no delivery redelivered or expired."""
    store = await LeaseStore.open(js)
    live = {lease.record.job_id: lease.fence for lease in await store.all_live()}
    result["live_leases_after"] = sum(1 for j, f in tally.held.items() if live.get(j) == f)
    redelivered = ack_pending = 0
    for tier in subjects.TIERS:
        info = await js.consumer_info(subjects.STREAM_WORK, subjects.work_consumer(TARGET, tier))
        redelivered += info.num_redelivered or 0
        ack_pending += info.num_ack_pending or 0
    result["deliveries_redelivered"] = redelivered
    result["deliveries_held_after"] = ack_pending


def render(results: list[dict[str, Any]]) -> str:
    header = [
        "workers",
        "leasers",
        "grants",
        "renewals",
        "renewals/s",
        "renew p50 ms",
        "p99",
        "max",
        "unanswered",
        "spurious losses",
        "live after",
        "redelivered",
    ]
    rows = []
    for r in results:
        rn = r.get("renew") or {}
        rows.append(
            [
                r["workers"],
                r["replicas"],
                r.get("grants"),
                r.get("renewals"),
                r.get("renewals_per_s"),
                rn.get("p50_ms"),
                rn.get("p99_ms"),
                rn.get("max_ms"),
                r.get("unanswered_renewals"),
                r.get("spurious_losses"),
                r.get("live_leases_after"),
                r.get("deliveries_redelivered"),
            ]
        )
    out = [fmt_table(header, rows), ""]
    for r in results:
        label = f"{r['workers']} workers, {r['replicas']} leaser(s)"
        if r.get("cpu_ms_per_renewal"):
            cpu = ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_ms_per_renewal"].items())
            out.append(f"{label}: CPU ms per renewal: {cpu}")
            out.append(
                f"{label}: TTL {r['lease_ttl_s']:g} s, renew every {r['renew_every_s']:g} s, "
                f"grants spread over {r['ramp_s']:g} s (took {r['grant_s']:.1f} s, grant p50 "
                f"{r['grant']['p50_ms']:.1f} / p99 {r['grant']['p99_ms']:.1f} ms), "
                f"setup {r['setup_s']:.1f} s"
            )
        problems = sum(v["count"] for v in r.get("log_problems", {}).values())
        problems += r.get("inproc_log_problems", {}).get("count", 0)
        if problems:
            out.append(
                f"{label}: {problems} log problem line(s): {r.get('log_problems')} "
                f"{r.get('inproc_log_problems')}"
            )
        if r.get("grant_refusals"):
            out.append(
                f"{label}: {r['grant_refusals']} grant asks refused (each asked again after its "
                f"retry-after; {r.get('never_granted')} never granted): {r['grant_refusal_kinds']}"
            )
        if r.get("stop_reason") and r["stop_reason"] != "every worker renewed its rounds":
            out.append(f"{label}: STOPPED EARLY: {r['stop_reason']}")
        if r.get("keeper_errors"):
            out.append(f"{label}: simulated workers failed: {r['keeper_errors']}")
        if r.get("error"):
            out.append(f"{label}: ERROR {r['error']}")
    return "\n".join(out)


def verdict(r: dict[str, Any]) -> bool:
    """The issue's target for this case: no spurious loss, renew p99 under 250 ms."""
    p99 = (r.get("renew") or {}).get("p99_ms")
    return (
        not r.get("error")
        and r.get("spurious_losses") == 0
        and r.get("live_leases_after") == r["workers"]
        and p99 is not None
        and p99 < RENEW_P99_TARGET_MS
    )


def run_cases(
    workers: int,
    replicas: list[int],
    rounds: int,
    ttl_s: float | None,
    ramp_s: float | None,
    keep: bool = False,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    results = []
    for r in replicas:
        if not quiet:
            print(f"fleet leases: {workers} workers, {r} leaser(s)...", file=sys.stderr, flush=True)
        results.append(asyncio.run(run_case(workers, r, rounds, ttl_s, ramp_s, keep)))
    return results


def quiet_console() -> None:
    """Warnings reach the bench's counter (``counting_problems``) but only errors the
    console: an overloaded leaser makes the client warn once per unanswered call."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=10_000, help="simulated workers")
    parser.add_argument("--rounds", type=int, default=3, help="renewals per worker (3)")
    parser.add_argument("--replicas", default="1,2", help="leaser replicas per case (1,2)")
    parser.add_argument(
        "--ttl", type=float, default=None, help="fleet.lease_ttl_s (default: the settings')"
    )
    parser.add_argument(
        "--ramp-s", type=float, default=None, help="spread the grants over this (default ttl/3)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp folders")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.rounds < 1:
        parser.error("--workers and --rounds must be at least 1")
    quiet_console()
    replicas = [int(x) for x in args.replicas.split(",") if x.strip()]
    results = run_cases(
        args.workers, replicas, args.rounds, args.ttl, args.ramp_s, args.keep, args.json
    )
    print(json.dumps(results, indent=2, default=str) if args.json else render(results))
    return 0 if all(verdict(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
