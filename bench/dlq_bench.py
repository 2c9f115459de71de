"""What a dead letter costs, next to a commit, in two ways.

    python bench/dlq_bench.py [--part micro,e2e] [--reports N] [--jobs N] [--json]

``micro``: an embedded nats-server, the topology, a leaser and a sink (in this process,
or as ``jetfleet serve`` children with ``--mode process``). For every job the bench first
takes the job's lease and stores one outcome event on ``jf.outcome.<target>.<job>`` (as a
worker did before outcome events moved to ``jf.outcome.<target>``: this measures the old
path, a job from before the switch, docs/benchmarks.md section 3); neither is timed.
Then it sends the sink one report per job over ``nc.request(jf.sink.report.demo)`` and
times each round trip:

* ``success``: a ``Success`` (an ``http.get`` record) -> fence check, put-if-absent
  commit on ``jf.results.demo.<key>``;
* ``failure``: a ``Failure`` (``http-404``) -> fence check, the job's attempt history read
  back from ``JF_OUTCOMES``, the dead letter published to ``jf.dlq.demo``;
* ``failure-nohist``: the same, for jobs with no outcome event stored (the history read
  finds nothing and stops after one ``stream_info``).

with 1 report in flight (sequential) and with 50.

``e2e``: a DevStack with W workers; N ``http.get`` jobs on ``/page/i`` (committed), then N
on ``/missing/i`` (404: permanent, dead-lettered at the first attempt), jobs/s for each
phase in the same run, and each service's CPU per job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
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
    start_redis,
    stop_stack,
    summary,
    timed_calls,
    wait_until_done,
    write_config,
)
from jetfleet.schemas import (  # noqa: E402
    AttemptRecord,
    Failure,
    HttpFetch,
    Job,
    Outcome,
    SinkReply,
    Success,
    Versions,
    WorkOrder,
)
from jetfleet.schemas.lease import LeaseGrant, LeaseRequest  # noqa: E402
from stats import latency_summary, process_usage  # noqa: E402

import jetfleet  # noqa: E402
from jetfleet import subjects  # noqa: E402
from jetfleet.canonical import idempotency_key  # noqa: E402
from jetfleet.connection import connect_nats  # noqa: E402
from jetfleet.lease_client import LeaseClient  # noqa: E402
from jetfleet.topology import declare  # noqa: E402

TARGET = "demo"
BASE = "http://127.0.0.1:9"
LEASE_TTL_S = 300.0
TIMEOUT_S = 600.0
WARMUP_JOBS = 200
_encoder = msgspec.json.Encoder()
_reply = msgspec.json.Decoder(SinkReply)
VERSIONS = Versions(jetfleet=jetfleet.__version__, handler="http.get@1")


# --- micro --------------------------------------------------------------------------------


def _order(job_id: str, path: str) -> WorkOrder:
    url = f"{BASE}{path}"
    return WorkOrder(
        job=Job(id=job_id, url=url, handler="http.get"),
        target=TARGET,
        key=idempotency_key("http.get", url),
        max_attempts=3,
        timeout_s=10.0,
    )


def _report(kind: str, order: WorkOrder, fence: int) -> bytes:
    if kind == "success":
        return _encoder.encode(
            Success(
                order=order,
                worker="bench-w",
                attempt=1,
                duration_s=0.002,
                output=HttpFetch(
                    status=200,
                    final_url=order.job.url,
                    headers={"content-type": "text/html; charset=utf-8"},
                    body_sha256="0" * 64,
                    body_bytes=2048,
                ),
                versions=VERSIONS,
                fence=fence,
            )
        )
    record = AttemptRecord(
        attempt=1,
        worker="bench-w",
        fence=fence,
        duration_s=0.002,
        outcome="permanent",
        reason="http-404",
    )
    return _encoder.encode(
        Failure(
            order=order,
            worker="bench-w",
            reason="http-404",
            history=[record],
            versions=VERSIONS,
            detail=f"{order.job.url} answered 404",
            fence=fence,
        )
    )


async def run_micro(reports: int, mode: str, keep: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-dlq-micro-"))
    result: dict[str, Any] = {"part": "micro", "mode": mode, "reports_per_phase": reports}
    nats = None
    redis = None
    nc = None
    services: list[Any] = []
    children: Children | None = None
    with counting_problems() as problems:
        try:
            nats = await start_nats(folder)
            redis = await start_redis(folder)
            config = write_config(
                folder,
                nats.url,
                {
                    "fleet": {"lease_ttl_s": LEASE_TTL_S, "ack_wait_s": 2 * LEASE_TTL_S},
                    # The in-flight cap (places in Redis) must admit every lease the
                    # phases take: it is not what this bench measures.
                    f"targets.{TARGET}": {"base_url": BASE + "/", "max_in_flight": 100_000},
                },
                redis.url,
            )
            settings = load(config)
            nc = await connect_nats(settings.nats, "bench-dlq-client")
            js = nc.jetstream()
            await declare(js, settings)
            if mode == "process":
                children = Children(folder, config)
                children.spawn("leaser", ["serve", "leaser"])
                children.spawn("sink", ["serve", "sink"])
                await children.wait_ready()
            else:
                from jetfleet.services.leaser import Leaser
                from jetfleet.services.sink import Sink

                for cls, name in ((Leaser, "leaser"), (Sink, "sink")):
                    snc = await connect_nats(settings.nats, f"bench-{name}")
                    svc = cls(settings, snc)
                    await svc.start()
                    services.append((snc, svc))
            leases = LeaseClient(nc)

            phases = [
                ("success", 1, True),
                ("failure", 1, True),
                ("failure-nohist", 1, False),
                ("success", 50, True),
                ("failure", 50, True),
            ]
            # Prepare every phase's jobs first: lease taken, outcome event stored.
            prepared: list[list[tuple[str, bytes]]] = []
            for p, (kind, _conc, with_outcome) in enumerate(phases):
                path = "page" if kind == "success" else "missing"
                orders = [
                    _order(f"p{p}-{n:06d}", f"/{path}/{p * reports + n}") for n in range(reports)
                ]

                async def grant(o: WorkOrder) -> int:
                    reply = await leases.grant(
                        LeaseRequest(
                            job_id=o.job.id,
                            target=TARGET,
                            key=o.key,
                            worker="bench-w",
                            versions=VERSIONS,
                            sends_request=False,  # a current worker's grant: no permit
                        )
                    )
                    if not isinstance(reply, LeaseGrant):
                        raise RuntimeError(f"no lease for {o.job.id}: {reply}")
                    return reply.fence

                _, fences, _ = await timed_calls(
                    [lambda o=o: grant(o) for o in orders], 50, TIMEOUT_S
                )
                if with_outcome:
                    kind_of = "ok" if kind == "success" else "permanent"

                    async def outcome(o: WorkOrder, fence: int, kind_of: str = kind_of) -> None:
                        event = Outcome(
                            job_id=o.job.id,
                            target=TARGET,
                            worker="bench-w",
                            attempt=1,
                            kind=kind_of,  # type: ignore[arg-type]
                            duration_s=0.002,
                            versions=VERSIONS,
                            reason="" if kind_of == "ok" else "http-404",
                            fence=fence,
                        )
                        await js.publish(subjects.outcome(TARGET, o.job.id), _encoder.encode(event))

                    await timed_calls(
                        [
                            lambda o=o, f=f: outcome(o, f)
                            for o, f in zip(orders, fences, strict=True)
                        ],
                        50,
                        TIMEOUT_S,
                    )
                prepared.append(
                    [
                        (o.job.id, _report("success" if kind == "success" else "failure", o, f))
                        for o, f in zip(orders, fences, strict=True)
                    ]
                )

            pids: dict[str, int | None] = {
                "nats-server": nats.process.pid if nats.process else None
            }
            if children is not None:
                pids.update({n: p.pid for n, p in children.procs.items()})
            else:
                pids["bench (leaser + sink + caller)"] = os.getpid()

            subject = subjects.sink_report(TARGET)

            async def send(payload: bytes) -> str:
                answer = await nc.request(subject, payload, timeout=5.0)
                return _reply.decode(answer.data).status

            result["phases"] = []
            for (kind, conc, with_outcome), batch in zip(phases, prepared, strict=True):
                cpu0 = {k: (process_usage(v) or {}).get("cpu_s", 0.0) for k, v in pids.items()}
                lat, statuses, wall = await timed_calls(
                    [lambda p=p: send(p) for _, p in batch], conc, TIMEOUT_S
                )
                cpu1 = {k: (process_usage(v) or {}).get("cpu_s", 0.0) for k, v in pids.items()}
                counts: dict[str, int] = {}
                for s in statuses:
                    counts[s] = counts.get(s, 0) + 1
                result["phases"].append(
                    {
                        "kind": kind,
                        "concurrency": conc,
                        "outcome_event_stored": with_outcome,
                        "latency": summary(lat, wall),
                        "statuses": counts,
                        "cpu_ms_per_report": {
                            k: 1000.0 * (cpu1[k] - cpu0[k]) / max(1, len(batch)) for k in pids
                        },
                    }
                )
            result["rss_mib"] = {
                k: (process_usage(pid) or {}).get("rss_mib") for k, pid in pids.items()
            }
            # Each history read leaves an ephemeral consumer until its inactive_threshold.
            outcomes = await js.stream_info(subjects.STREAM_OUTCOMES)
            result["outcome_consumers_after"] = outcomes.state.consumer_count
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for snc, svc in reversed(services):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(svc.drain(10.0), 15.0)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(snc.close(), 10.0)
            await close_case(nc, children, [nats, redis], folder, keep, result, problems)
    return result


# --- e2e ----------------------------------------------------------------------------------


class _JobHead(msgspec.Struct):
    id: str


class _OrderHead(msgspec.Struct):
    job: _JobHead


class _LetterHead(msgspec.Struct):
    order: _OrderHead


class _ResultHead(msgspec.Struct):
    job_id: str


_letter = msgspec.json.Decoder(_LetterHead).decode
_result = msgspec.json.Decoder(_ResultHead).decode


async def run_e2e(jobs: int, workers: int, keep: bool) -> dict[str, Any]:
    from jetfleet_bench import _wait_ready

    from jetfleet.client import jobs_for, submit_jobs
    from jetfleet.dev.devstack import DevStack
    from jetfleet.ops.status import fleet_status

    folder = Path(tempfile.mkdtemp(prefix="jetfleet-bench-dlq-e2e-"))
    stack = DevStack(folder, workers=workers)
    result: dict[str, Any] = {"part": "e2e", "jobs_per_phase": jobs, "workers": workers}
    nc = None
    try:
        await asyncio.wait_for(stack.start(), 120.0)
        result["ready_s"] = await _wait_ready(stack, 60.0)
        assert stack.settings is not None
        settings = stack.settings
        nc = await connect_nats(settings.nats, "bench-dlq-e2e")
        js = nc.jetstream()
        await declare(js, settings)
        arrived: dict[str, float] = {}

        async def on_msg(msg: Any) -> None:
            now = time.monotonic()
            job_id = (
                _letter(msg.data).order.job.id
                if msg.subject.startswith("jf.dlq.")
                else _result(msg.data).job_id
            )
            arrived.setdefault(job_id, now)

        subs = [
            await nc.subscribe(
                s,
                cb=on_msg,
                pending_msgs_limit=max(65536, 4 * jobs),
                pending_bytes_limit=256 * 1024 * 1024,
            )
            for s in ("jf.results.>", "jf.dlq.>")
        ]
        await nc.flush()

        def pids() -> dict[str, int | None]:
            out: dict[str, int | None] = {n: p.pid for n, p in stack.children.items()}
            out["nats-server"] = stack.nats.process.pid if stack.nats.process else None
            out["bench (load + simulator)"] = os.getpid()
            return out

        result["phases"] = []
        plan = [
            ("warm-up (not reported)", "page", min(jobs, WARMUP_JOBS)),
            ("page (committed)", "page", jobs),
            ("missing (dead-lettered)", "missing", jobs),
        ]
        offset = 0
        for name, path, count in plan:
            batch = jobs_for(
                TARGET,
                settings,
                [f"/{path}/{offset + n}" for n in range(count)],
                handler="http.get",
            )
            offset += count
            submitted: dict[str, float] = {}
            gate = asyncio.Semaphore(256)

            async def submit_one(
                job: Any, gate: asyncio.Semaphore = gate, submitted: dict[str, float] = submitted
            ) -> None:
                async with gate:
                    submitted[job.id] = time.monotonic()
                    await submit_jobs(js, settings, TARGET, [job])

            cpu0 = {k: (process_usage(v) or {}).get("cpu_s", 0.0) for k, v in pids().items()}
            first = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*(submit_one(j) for j in batch)), TIMEOUT_S)
            submit_s = time.monotonic() - first
            stop = await wait_until_done(
                stack,
                # Awaited at once, inside this iteration: the loop variables are current.
                lambda: sum(1 for j in submitted if j in arrived) >= count,  # noqa: B023
                first + TIMEOUT_S,
                "all arrived",
            )
            cpu1 = {k: (process_usage(v) or {}).get("cpu_s", 0.0) for k, v in pids().items()}
            done = [j for j in submitted if j in arrived]
            last = max((arrived[j] for j in done), default=time.monotonic())
            elapsed = last - first
            result["phases"].append(
                {
                    "phase": name,
                    "jobs": count,
                    "arrived": len(done),
                    "stop_reason": stop,
                    "submit_s": submit_s,
                    "elapsed_s": elapsed,
                    "jobs_per_s": len(done) / elapsed if elapsed > 0 else 0.0,
                    "latency": latency_summary(arrived[j] - submitted[j] for j in done),
                    "cpu_ms_per_job": {
                        k: 1000.0 * (cpu1[k] - cpu0[k]) / max(1, count) for k in cpu0
                    },
                }
            )
            await asyncio.sleep(0.5)
        result["phases"] = [p for p in result["phases"] if not p["phase"].startswith("warm")]
        for sub in subs:
            await sub.unsubscribe()
        outcomes = await js.stream_info(subjects.STREAM_OUTCOMES)
        result["outcome_consumers_after"] = outcomes.state.consumer_count
        totals = (await fleet_status(js, settings)).totals
        result["status_at_end"] = msgspec.structs.asdict(totals)
        result["rss_mib"] = {k: (process_usage(v) or {}).get("rss_mib") for k, v in pids().items()}
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        # Logs are scanned after the stop, so errors logged while draining count too.
        await stop_stack(stack, nc, folder, keep, result)
    return result


# --- main ---------------------------------------------------------------------------------


def render(results: list[dict[str, Any]]) -> str:
    out = []
    for r in results:
        if r["part"] == "micro":
            out.append(
                f"micro (sink and leaser {r['mode']}), {r['reports_per_phase']} reports per phase:"
            )
            rows = []
            for p in r.get("phases", []):
                lat = p["latency"]
                cpu = ", ".join(f"{k} {v:.2f}" for k, v in p["cpu_ms_per_report"].items())
                rows.append(
                    [
                        p["kind"],
                        p["concurrency"],
                        lat["p50_ms"],
                        lat["p90_ms"],
                        lat["p99_ms"],
                        lat["max_ms"],
                        lat["per_s"],
                        ", ".join(f"{k} {v}" for k, v in p["statuses"].items()),
                        cpu,
                    ]
                )
            out.append(
                fmt_table(
                    [
                        "report",
                        "in flight",
                        "p50 ms",
                        "p90",
                        "p99",
                        "max",
                        "reports/s",
                        "answers",
                        "CPU ms per report",
                    ],
                    rows,
                )
            )
        else:
            out.append(
                f"e2e (DevStack, {r['workers']} workers, {r['jobs_per_phase']} jobs per phase):"
            )
            rows = []
            for p in r.get("phases", []):
                cpu = ", ".join(f"{k} {v:.2f}" for k, v in p["cpu_ms_per_job"].items())
                rows.append(
                    [
                        p["phase"],
                        p["arrived"],
                        p["submit_s"],
                        p["elapsed_s"],
                        p["jobs_per_s"],
                        p["latency"]["p50_ms"],
                        p["latency"]["p99_ms"],
                        cpu,
                    ]
                )
            out.append(
                fmt_table(
                    [
                        "phase",
                        "done",
                        "submit s",
                        "elapsed s",
                        "jobs/s",
                        "p50 ms",
                        "p99 ms",
                        "CPU ms per job",
                    ],
                    rows,
                )
            )
            out.append(f"status at end: {r.get('status_at_end')}")
        if "outcome_consumers_after" in r:
            out.append(
                f"consumers on JF_OUTCOMES right after the last phase: "
                f"{r['outcome_consumers_after']}"
            )
        problems = sum(v["count"] for v in r.get("log_problems", {}).values())
        problems += (r.get("inproc_log_problems") or {}).get("count", 0)
        out.append(
            f"log problem lines: {problems}"
            + (f" {r.get('log_problems')} {r.get('inproc_log_problems')}" if problems else "")
        )
        if r.get("error"):
            out.append(f"ERROR {r['error']}")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="micro,e2e", help="micro and/or e2e")
    parser.add_argument("--mode", default="inproc,process", help="micro: inproc and/or process")
    parser.add_argument("--reports", type=int, default=1000, help="micro: reports per phase")
    parser.add_argument("--jobs", type=int, default=2000, help="e2e: jobs per phase")
    parser.add_argument("--workers", type=int, default=2, help="e2e: worker processes")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    results = []
    if "micro" in parts:
        for mode in [m.strip() for m in args.mode.split(",") if m.strip()]:
            print(f"dlq micro ({mode})...", file=sys.stderr, flush=True)
            results.append(asyncio.run(run_micro(args.reports, mode, args.keep)))
    if "e2e" in parts:
        print("dlq e2e...", file=sys.stderr, flush=True)
        results.append(asyncio.run(run_e2e(args.jobs, args.workers, args.keep)))
    print(json.dumps(results, indent=2, default=str) if args.json else render(results))
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(run_with_tree(main))
