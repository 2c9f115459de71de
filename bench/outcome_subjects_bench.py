"""Outcome subjects and messages per job: N jobs through real services, counted on the wire.

Starts an embedded nats-server and redis-server, the target simulator and an in-process
stack (scheduler, ratelimit, leaser, sink, workers; tests/stack.py), submits ``--jobs``
jobs spread over ``--targets`` targets (``--fail-pct`` of them fail for good on their
first attempt, as many fail every attempt and are dead-lettered after ``max_attempts``,
the rest commit), waits until every job is committed or dead, then reports:

- JF_OUTCOMES' ``num_subjects`` as the server gives it (``nats stream info``);
- every message any client published during the run, by family (a wiretap on ``>``):
  outcome events, lease calls, ``jf-fences`` writes and reads, sink reports, replies...,
  in all and per job.

It measures counts, not time, so it runs the same on a loaded machine. Run it on two trees
to compare them (docs/scale.md, "Subject state", item 1):

    .venv/bin/python bench/outcome_subjects_bench.py --jobs 1000 --json-out /tmp/out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, for tests.stack

import msgspec
from jetfleet.schemas import DeadLetter, Job
from nats.aio.msg import Msg

from jetfleet import subjects
from jetfleet.client import resolve_url, submit_jobs
from jetfleet.connection import connect_nats
from jetfleet.dev.embedded import EmbeddedNats, EmbeddedRedis
from jetfleet.outcome_events import read_outcomes
from jetfleet.settings import (
    FleetSettings,
    NatsSettings,
    RedisSettings,
    Settings,
    TargetSettings,
    WorkerSettings,
)
from jetfleet.simulator import SimulatorConfig, TargetSimulator
from jetfleet.stream_reader import count_messages, read_stream
from tests.stack import InProcessStack


def family(subject: str) -> str:
    """The family a published subject counts under."""
    if subject.startswith("_INBOX."):
        return "replies (_INBOX)"
    if subject.startswith(f"$KV.{subjects.BUCKET_FENCES}."):
        return "jf-fences writes"
    if subject.startswith(
        (
            f"$JS.API.DIRECT.GET.KV_{subjects.BUCKET_FENCES}",
            f"$JS.API.STREAM.MSG.GET.KV_{subjects.BUCKET_FENCES}",
        )
    ):
        return "jf-fences reads"
    if subject.startswith(f"$KV.{subjects.BUCKET_LEASES}."):
        return "jf-leases writes"
    if subject.startswith(
        (
            f"$JS.API.DIRECT.GET.KV_{subjects.BUCKET_LEASES}",
            f"$JS.API.STREAM.MSG.GET.KV_{subjects.BUCKET_LEASES}",
        )
    ):
        return "jf-leases reads"
    if subject.startswith(f"$JS.API.DIRECT.GET.{subjects.STREAM_OUTCOMES}"):
        return "JF_OUTCOMES direct gets (old per-job history)"
    if subject.startswith("$JS.ACK."):
        return "acks (+ACK/-NAK/+WPI/+TERM)"
    if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
        return "pull requests"
    if subject.startswith("$JS.API.DIRECT.GET."):
        return "other direct gets"
    if subject.startswith("$JS."):
        return "other JetStream API"
    if subject.startswith("$KV."):
        return "other KV writes"
    parts = subject.split(".")
    return ".".join(parts[:2]) if subject.startswith("jf.") else parts[0]


def settings_for(nats_url: str, redis_url: str, sim: TargetSimulator, args: Any) -> Settings:
    target = TargetSettings(
        base_url=sim.base_url + "/",
        rate=100_000,
        burst=10_000,
        max_in_flight=256,
        timeout_s=5.0,
        obey_robots=False,
        robots_off_reason="a benchmark against the local simulator",
    )
    return Settings(
        nats=NatsSettings(url=nats_url),
        redis=RedisSettings(url=redis_url),
        fleet=FleetSettings(
            ack_wait_s=args.ack_wait_s,
            lease_ttl_s=args.lease_ttl_s,
            retry_base_s=0.05,
            retry_max_backoff_s=0.2,
            dedupe_ttl_s=3600.0,
            user_agent="jetfleet-bench (+loopback only)",
        ),
        worker=WorkerSettings(concurrency=args.concurrency),
        targets={f"t{n}": target for n in range(args.targets)},
    )


def job_paths(jobs: int, targets: int, fail_pct: float) -> dict[str, list[str]]:
    """Per target, its jobs' paths: every ``1 / fail_pct``-th a permanent failure (404),
    the next one a failure every attempt (500), the rest pages that commit."""
    every = max(2, round(100 / fail_pct)) if fail_pct > 0 else 0
    paths: dict[str, list[str]] = {f"t{n}": [] for n in range(targets)}
    for i in range(jobs):
        kind = "page"
        if every and i % every == 0:
            kind = "missing"
        elif every and i % every == 1:
            kind = "error"
        paths[f"t{i % targets}"].append(f"/{kind}/{i}")
    return paths


async def num_subjects(nc: Any, stream: str) -> int:
    answer = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=10)
    return int(json.loads(answer.data)["state"].get("num_subjects", 0))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="outcome-subjects-"))
    nats = EmbeddedNats(folder / "nats")
    redis = EmbeddedRedis(folder / "redis")
    await asyncio.to_thread(nats.start)
    await asyncio.to_thread(redis.start)
    try:
        async with TargetSimulator(SimulatorConfig()) as sim:
            settings = settings_for(nats.url, redis.url, sim, args)
            stack = InProcessStack(settings)
            await stack.start(workers=args.workers)
            tap = await connect_nats(settings.nats, "wiretap")
            seen: Counter[str] = Counter()

            async def count(msg: Msg) -> None:
                seen[family(msg.subject)] += 1

            await tap.subscribe(">", cb=count, pending_msgs_limit=10_000_000)
            await tap.flush()
            try:
                return await _submit_and_count(args, settings, stack, tap, seen)
            finally:
                await tap.close()
                await stack.stop()
    finally:
        await asyncio.to_thread(nats.stop)
        await asyncio.to_thread(redis.stop)


async def _submit_and_count(
    args: argparse.Namespace,
    settings: Settings,
    stack: InProcessStack,
    tap: Any,
    seen: Counter[str],
) -> dict[str, Any]:
    nc = stack.connections[0]
    js = nc.jetstream()
    paths = job_paths(args.jobs, args.targets, args.fail_pct)
    started = time.monotonic()
    for target, target_paths in paths.items():
        jobs = [
            Job(id=f"{target}-{n}", url=resolve_url(settings, target, path))
            for n, path in enumerate(target_paths)
        ]
        results = await submit_jobs(js, settings, target, jobs)
        assert all(r.published and r.rejection is None for r in results)

    async def settled() -> int:
        results = await count_messages(js, subjects.STREAM_RESULTS, "jf.results.>")
        dead = await count_messages(js, subjects.STREAM_DLQ, "jf.dlq.>")
        return results + dead

    deadline = time.monotonic() + args.budget_s
    while (done := await settled()) < args.jobs:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {done} of {args.jobs} jobs settled in {args.budget_s:g} s")
        await asyncio.sleep(0.5)
    took = time.monotonic() - started
    await asyncio.sleep(1.0)  # the last acks and lease expiries reach the tap
    await tap.flush()
    dead = await count_messages(js, subjects.STREAM_DLQ, "jf.dlq.>")
    reasons: Counter[str] = Counter()
    async for msg in read_stream(js, subjects.STREAM_DLQ, "jf.dlq.>"):
        letter = msgspec.json.decode(msg.data, type=DeadLetter)
        kind = letter.order.job.url.rsplit("/", 2)[-2]
        tried = ",".join(sorted({a.reason for a in letter.history}))
        reasons[f"{letter.reason} ({kind}; attempts: {tried})"] += 1
    outcome_messages = await count_messages(js, subjects.STREAM_OUTCOMES, "jf.outcome.>")
    # A worker's ok events come up to 64 to a message: count the events.
    outcomes = 0
    async for msg in read_stream(js, subjects.STREAM_OUTCOMES, "jf.outcome.>"):
        outcomes += len(read_outcomes(msg.subject, msg.data, msg.headers))
    total = sum(seen.values())
    return {
        "jobs": args.jobs,
        "targets": args.targets,
        "dead": dead,
        "dead_by_reason": dict(reasons),
        "committed": args.jobs - dead,
        "outcome_events": outcomes,
        "outcome_messages": outcome_messages,
        "outcomes_num_subjects": await num_subjects(nc, subjects.STREAM_OUTCOMES),
        "fences_num_subjects": await num_subjects(nc, f"KV_{subjects.BUCKET_FENCES}"),
        "messages": total,
        "messages_per_job": round(total / args.jobs, 2),
        "by_family": {k: v for k, v in sorted(seen.items(), key=lambda kv: -kv[1])},
        "seconds": round(took, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--targets", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="jobs in flight per worker (fewer: fewer "
        "leases lost on a loaded machine, whose retries would blur the counts)",
    )
    parser.add_argument("--fail-pct", type=float, default=5.0)
    parser.add_argument("--budget-s", type=float, default=600.0)
    # The production defaults: the tests' short ones (10 s, 3 s) lose leases on a loaded
    # machine, and the retries and releases that follow blur the counts.
    parser.add_argument("--ack-wait-s", type=float, default=60.0)
    parser.add_argument("--lease-ttl-s", type=float, default=30.0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
